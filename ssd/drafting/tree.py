"""One round's speculation tree on the draft side: the fork that picks each outcome's bonus
candidates, the attention mask that lets every branch see only its own history, and the cache
of finished branches (`SpeculationTree`) that the outcome is looked up in.

Shapes: b sequences, K speculation length, N branches per sequence (the whole grid) or N_own
(this drafter's shard of it), V the target's vocabulary, R = RANK_DEPTH (or V, if smaller).
Branches are numbered by outcome, then by rank: branch n of row r belongs to outcome j and
starts with the j-th outcome's candidate of that rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ssd.core.protocol import RANK_DEPTH, branch_of
from ssd.core.sampling import no_mass
from ssd.core.transfer import read_after, to_device
from ssd.model.kv_cache import additive_mask


@dataclass
class SpeculationTree:
    """The speculation cache of one round: this drafter's shard of every row's branches."""

    seq_ids: list[int]
    spec_tokens: list[list[int]]  # s_T per row (real tokens only)
    grid: Fork  # the whole grid's candidates and outcomes (every shard's), what the outcome is looked up in (host)
    tokens: torch.Tensor  # [b, N_own, depth], host: this shard's branches, branch n at n // num_shards
    probs: BranchProbs  # [b, N_own, depth, V], kept sparse per row where it can be (BranchProbs.add)
    fanout: list[int] = field(default_factory=list)
    build_seconds: float = 0.0  # the whole build's duration (projected to depth K when cut short)
    depth: int = 0  # tree depth reached: cached branches hold this many tokens (1..K)
    # A round begun on a prediction: how to take it back (generator states, the columns the
    # glue added per row) if the target's announcement turns out different.
    undo: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def lookup(self, rows: list[int], accepted: list[int], bonus: list[int]) -> tuple[list[int], list[int], list[int]]:
        """The outcomes (accepted, bonus) of rows `rows` of this round -> per row whether the grid
        holds the branch (1 or 0), its number n in the whole grid (0 where not), and the bonus
        token's rank among its outcome's candidates (RANK_DEPTH where not among the first R):
        on host lists. The grid is on the host (a device round's was copied there as its tree
        began: tree_decode.py, so the lookup reads nothing back), and this sits between the
        target's outcome and its next verification, where the dozen tensor operations it took
        on a few numbers cost about 0.1 ms a round."""
        found, branch, rank = [], [], []
        for i, a, t in zip(rows, accepted, bonus):
            n = branch_of(self.grid.outcome[i].tolist(), self.grid.candidates[i].tolist(), a, t)
            order = self.grid.ranked[i, a].tolist()
            found.append(int(n is not None))
            branch.append(n or 0)
            rank.append(order.index(t) if t in order else RANK_DEPTH)
        return found, branch, rank

    def branch_tokens(self, picks: list[tuple[int, int]]) -> torch.Tensor:
        """Branches of this shard, (row i, branch n // num_shards) each -> their tokens [m, depth]
        on the host. A -1 token (a round on an accelerator drew from a distribution
        without mass) raises as the host's sampler does."""
        tokens = torch.stack([self.tokens[i, n] for i, n in picks]).cpu()
        if bool((tokens < 0).any()):
            raise no_mass("draft", "draft_dtype")
        return tokens

    def branch_probs(self, picks: list[tuple[int, int]]) -> torch.Tensor:
        """The same branches' distributions [m, depth, V], on the host (one copy, which on a device
        waits for the depths kept, not for the one the tree queued past its cut)."""

        def gathered() -> torch.Tensor:
            return torch.stack([self.probs.branch(i, n) for i, n in picks]).cpu()

        return read_after(self.probs.done, self.probs.device, gathered)

    def copy_branches(self, picks: list[tuple[int, int]], rows: list[int], greedy: list[bool], tokens, probs) -> None:
        """Branches of this shard (picks, as in branch_tokens) into reply rows `rows` (one each, in
        order) of tokens [b, K], and the sampled rows' (greedy [b]) distributions into probs
        [b, K, V] (None: no row is sampled)."""
        tokens[rows, : self.depth] = self.branch_tokens(picks)
        sampled = [(p, r) for p, r in zip(picks, rows) if not greedy[r]]
        if sampled:
            probs[[r for _, r in sampled], : self.depth] = self.branch_probs([p for p, _ in sampled])


@dataclass
class BranchProbs:
    """A round's branch distributions [b, N_own, depth, V] of its sampled rows (a greedy row's
    reply carries its tokens alone: none are kept for it), each kept in as few numbers as it
    needs: a row whose distributions have at most S <= V / 4 tokens of positive mass (top-k: k,
    ties with the k-th included) keeps those S values and their token ids, [N_own, depth, S]
    each; any other row keeps its values dense, [N_own, depth, V]. At V = 128256, N = 16, K = 6
    a dense row is 49 MB, a top-50 one 58 KB. Built depth by depth (`add`), so the dense
    [b, N, V] of one depth is the most ever held beside them."""

    vocab: int
    greedy: list[bool]  # [b]: rows whose distributions are not kept
    values: list[torch.Tensor] = field(default_factory=list)  # per sparse row: [N_own, depth, S_r]
    indices: list[torch.Tensor | None] = field(default_factory=list)  # per row: [N_own, depth, S_r], None if dense
    # per dense row: each depth's distributions [N_own, V], kept apart (concatenating depth after
    # depth copied everything kept so far: about 60 ms a tree at N = 16, V = 128k on the
    # development CPU)
    _dense: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # On a device: recorded after the last depth kept, so that a read waits for nothing queued after
    # it (the depth the tree queued past its cut: tree_decode.py).
    done: torch.cuda.Event | None = None
    device: torch.device | None = None  # where the kept distributions are, with `done`

    def add(self, probs: torch.Tensor, narrow: list[bool], counted: bool = True) -> None:
        """Append one depth: probs [b, N_own, V]; narrow [b]: the sampled rows that may be kept
        sparse (top-k: their support is counted; any other row is kept dense uncounted, a count
        over b x N x V costing milliseconds per depth at V = 128k). counted=False (a round on an
        accelerator: a count is a host read) keeps every sampled row dense."""
        b, n, vocab = probs.shape
        if not self.values:  # every row starts sparse, with no depth yet
            self.values = [probs.new_zeros(n, 0, 0) for _ in range(b)]
            self.indices = [torch.zeros(n, 0, 0, dtype=torch.long, device=probs.device) for _ in range(b)]
        support = [vocab] * b  # the widest distribution of each row
        rows = [r for r in range(b) if narrow[r] and not self.greedy[r]]
        if counted and rows:
            for r, s in zip(rows, (probs[rows] > 0).sum(-1).amax(-1).tolist()):
                support[r] = s
        for r in range(b):
            if self.greedy[r]:
                continue
            if self.indices[r] is not None and support[r] <= vocab // 4:
                values, index = probs[r].topk(max(1, support[r]), dim=-1)  # [N_own, S]: every positive entry
                self.values[r], self.indices[r] = (
                    _cat_padded(self.values[r], values),
                    _cat_padded(self.indices[r], index),
                )
                continue
            if self.indices[r] is not None:  # turning dense: what the row kept so far, spread out
                self._dense[r] = list(self.dense(r).unbind(1))
                self.values[r], self.indices[r] = self.values[r][:, :0], None
            # A view holds the whole depth's [b, N_own, V]: only a batch of one keeps it that way.
            self._dense[r].append(probs[r] if b == 1 else probs[r].clone())

    def dense(self, r: int) -> torch.Tensor:
        """Row r's distributions as [N_own, depth, V]."""
        if self.indices[r] is None:
            return torch.stack(self._dense[r], 1)
        return _spread(self.values[r], self.indices[r], self.vocab)

    def branch(self, r: int, n: int) -> torch.Tensor:
        """Branch n of row r (a sampled row): [depth, V]."""
        assert not self.greedy[r], "a greedy row's distributions are not kept"
        if self.indices[r] is None:
            return torch.stack([depth[n] for depth in self._dense[r]])
        return _spread(self.values[r][n], self.indices[r][n], self.vocab)

    def row_nbytes(self, r: int) -> int:
        """Bytes row r keeps: a sparse row's values and ids, a dense row's distributions."""
        if self.indices[r] is None:
            return sum(depth.nbytes for depth in self._dense[r])
        return self.values[r].nbytes + self.indices[r].nbytes

    @property
    def nbytes(self) -> int:
        return sum(self.row_nbytes(r) for r in range(len(self.values)))


def _spread(values: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """Kept entries [..., S] -> dense [..., V]. Padding entries add 0.0 to token 0: exact,
    whatever token 0 holds."""
    return values.new_zeros(*values.shape[:-1], vocab).scatter_add_(-1, index, values)


def _cat_padded(kept: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """kept [N, d, S], new [N, S'] -> [N, d+1, max(S, S')], the narrower padded with zeros."""
    width = max(kept.shape[-1], new.shape[-1])
    kept = torch.nn.functional.pad(kept, (0, width - kept.shape[-1]))
    new = torch.nn.functional.pad(new, (0, width - new.shape[-1]))
    return torch.cat([kept, new.unsqueeze(1)], 1)


@dataclass(frozen=True)
class Fork:
    """The branch grid of a round, as every shard computes it alike."""

    candidates: torch.Tensor  # [b, N] long, on the glue's device: branch n's first token (its bonus candidate)
    outcome: torch.Tensor  # [b, N] long, host: the outcome j (accepted tokens) branch n stands for
    ranked: torch.Tensor  # [b, K+1, R] long, on the glue's device: each outcome's first R candidates, in order


def fork(
    glue_logits: torch.Tensor, spec_tokens: torch.Tensor, spec_lens: torch.Tensor, row_fan: list[list[int]]
) -> Fork:
    """Bonus candidates: for each row r and outcome j, the top row_fan[r][j] tokens of the glue
    distribution at j (raw draft logits), never the drafted token s_T[j] (had it been right,
    more tokens would have been accepted).

    glue_logits [b, K+1, V] (on any device), spec_tokens [b, K] (padded), spec_lens [b] the real
    tokens per row (host), row_fan [b][K+1] the fan-out per row (ssd.drafting.saguaro.row_fanout;
    every row's sums to the same N). The grid's layout comes from the host's fan-outs; the
    ranking stays where the logits are (`rank_candidates`: no host read)."""
    vocab = glue_logits.shape[-1]
    outcome, rank = _layout(row_fan)  # [b, N] each
    widest = max(max(f) for f in row_fan)
    assert widest <= vocab, "a fan-out wider than the draft's vocabulary"  # ranks would spill into the next outcome
    depth = min(max(widest, RANK_DEPTH), vocab)
    device = glue_logits.device
    real = torch.arange(spec_tokens.shape[1]) < spec_lens.unsqueeze(1)  # [b, K]
    flat = to_device(outcome * depth + rank, device)  # [b, N]: where each branch's candidate sits in ranked
    spec_tokens, real = to_device(spec_tokens, device), to_device(real, device)
    candidates, ranked = rank_candidates(glue_logits, spec_tokens, real, flat, depth)
    return Fork(candidates, outcome, ranked[..., :RANK_DEPTH])


def rank_candidates(
    glue_logits: torch.Tensor, spec_tokens: torch.Tensor, real: torch.Tensor, flat: torch.Tensor, depth: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fork's device step: glue_logits [b, K+1, V], spec_tokens [b, K], real [b, K] bool (the
    real drafted tokens), flat [b, N] (outcome * depth + rank of each branch) -> candidates [b,
    N] and ranked [b, K+1, depth]: at each outcome the draft's `depth` likeliest tokens other
    than the drafted one."""
    b, k1, vocab = glue_logits.shape
    drafted = torch.zeros(b, k1, vocab, dtype=torch.bool, device=glue_logits.device)
    drafted[:, : k1 - 1].scatter_(-1, spec_tokens[:, : k1 - 1].long().unsqueeze(-1), real.unsqueeze(-1))
    ranked = glue_logits.masked_fill(drafted, float("-inf")).topk(depth, dim=-1).indices  # [b, K+1, depth]
    return ranked.reshape(b, -1).gather(1, flat), ranked


def _layout(row_fan: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Branches numbered by outcome, then rank: -> outcome [b, N] and rank [b, N] (host)."""
    outcome = [[j for j, f in enumerate(fan) for _ in range(f)] for fan in row_fan]
    rank = [[i for f in fan for i in range(f)] for fan in row_fan]
    return torch.tensor(outcome, dtype=torch.long), torch.tensor(rank, dtype=torch.long)


def tree_mask(
    lengths: torch.Tensor,
    glue_start: torch.Tensor,
    base: torch.Tensor,
    spec_lens: torch.Tensor,
    outcome: torch.Tensor,
    depth: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The additive attention mask of the whole tree decode, [b, 1, N, T + depth N] with T =
    max(lengths): depth d writes its N columns at T + d N + 0..N-1 in every row and attends to
    the first T + (d+1) N columns, where every branch sees its own columns of all depths so far,
    so one mask, built once per round and sliced, serves every depth.

    lengths [b]: each row's cache length before the tree (the glue's columns included; a row's
    columns from its length up to T are stale and hidden); row r's glue columns start at
    glue_start[r], and its speculation s_T sits from glue_start[r] + base[r] + 1 on, spec_lens[r]
    of them; outcome [b, N]: the outcome each branch stands for. A branch of outcome j sees the
    committed tokens and s_T[:j], never the drafts it rejects."""
    b, n = outcome.shape
    col = torch.arange(int(lengths.max())).view(1, 1, -1)
    rel = col - (glue_start + base + 1).view(b, 1, 1)  # s_T index of each glue column
    is_spec = (rel >= 0) & (rel < spec_lens.view(b, 1, 1))
    glue_vis = (col < lengths.view(b, 1, 1)) & (~is_spec | (rel < outcome.unsqueeze(-1)))  # [b, N, T]
    own = torch.eye(n, dtype=torch.bool).repeat(b, 1, depth)  # [b, N, depth N]
    allowed = torch.cat([glue_vis, own], dim=-1)
    return additive_mask(allowed, dtype).unsqueeze(1)
