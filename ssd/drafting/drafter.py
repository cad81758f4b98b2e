"""The draft side of SSD: build the speculation cache while the target verifies.

For each round the target announces the speculation s_T it is verifying (`begin_round`). The
drafter then, for every sequence of the batch:
  1. glue-decodes [tokens committed since last round, s_T] in one forward, which gives its
     K+1 next-token distributions, one per possible number k of accepted tokens;
  2. forks: at each k takes the top F_k tokens (by raw draft logits) as bonus candidates,
     excluding s_T[k] (had it been right, k would be larger);
  3. tree-decodes all B = sum F_k branches together, K forwards of B tokens each, every branch
     attending to the committed prefix, s_T[:k], its candidate and its own earlier tokens only;
  4. keeps each branch's K tokens and draft distributions under (k, candidate). When the outcome
     arrives before the tree is done, the tree stops at the depth reached and the branches
     hold that many tokens (a shorter speculation beats making the target wait).
When the outcome (k, bonus) arrives (`resolve`), a hit returns the cached branch; a miss is
answered just in time by the draft (neural backup) or left to the target's fast backup.

Sharding: D drafters (a pool) split each round's branch grid. The round's fan-out is the
whole pool's; every drafter glue-decodes and forks the whole grid (the same top-F_k candidates,
so all agree on which outcomes are covered), then tree-decodes only its share, the branches n
with n mod D = its shard (branches are numbered by outcome, then rank, so every share mixes
outcomes). On resolve, the drafter whose share holds the outcome answers with the branch; the
others report the row covered but not theirs. Each drafter keeps its own KV cache of every
sequence and its own generators (seeded apart), so no two drafters ever share a random draw.
After a reply in which every row hit, the next announcement is known but for its arrival
(`predict_round`): a drafter in its own process begins that round at once and takes it back
whole if the announcement differs (`begin_round(stale=...)`, `abandon_round`).

Shapes: b sequences, N = B branches per sequence, K speculation length, V target vocab.
The drafter keeps its own KV cache of committed tokens only; tree columns live for one round.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ssd.drafting.draft_proposer import DraftModelProposer, pad_rows
from ssd.drafting.saguaro import row_fanout, saguaro_probs
from ssd.engine.sampling import BatchSampling, sample_from
from ssd.model.kv_cache import additive_mask
from ssd.model.runner import ModelRunner
from ssd.transport.messages import (
    RANK_DEPTH,
    AdmitMsg,
    BeginRoundMsg,
    DrafterCounters,
    DraftNowMsg,
    ResolveMsg,
    SpeculationReply,
)


@dataclass
class _SeqState:
    tokens: list[int]  # committed tokens (prompt + output) as the drafter knows them
    generator: torch.Generator
    temperature: float
    top_k: int
    top_p: float


@dataclass
class _Round:
    """The speculation cache of one round."""

    seq_ids: list[int]
    spec_tokens: list[list[int]]  # s_T per row (real tokens only)
    branch_index: list[dict[tuple[int, int], int]]  # per row: (k, bonus) -> branch n of the whole grid
    tokens: torch.Tensor  # [b, N_own, K]: this drafter's share, branch n at n // num_shards
    probs: torch.Tensor  # [b, N_own, K, V]
    fanout: list[int] = field(default_factory=list)
    # [b, K+1, R] the candidates of each outcome in the draft's order (R = RANK_DEPTH or the
    # vocabulary, if smaller): the bonus token's rank is its place here
    ranked: torch.Tensor | None = None
    build_seconds: float = 0.0  # the whole build's duration (projected to depth K when cut short)
    depth: int = 0  # tree depth reached: cached branches hold this many tokens (1..K)
    # A round begun on a prediction: how to take it back (generator states, committed columns
    # the glue added per row) if the target's announcement turns out different.
    undo: tuple[list[torch.Tensor], torch.Tensor] | None = None


class Drafter:
    """Plain class (no Ray, no process): the channel layer decides where it runs."""

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab: int,
        k: int,
        saguaro_c: float = 1.0,
        shard: int = 0,
        num_shards: int = 1,
    ) -> None:
        assert 0 <= shard < num_shards
        self.runner = runner
        self.k = k
        self.saguaro_c = saguaro_c
        self.shard, self.num_shards = shard, num_shards
        self.jit = DraftModelProposer(runner, target_vocab)  # shares probs handling and padding
        self.cache = self.jit.cache
        self.states: dict[int, _SeqState] = {}
        self.order: list[int] = []  # seq id of each cache row
        self.round: _Round | None = None
        self.counters = DrafterCounters()

    # ---- membership -------------------------------------------------------------------------

    @torch.inference_mode()
    def admit(self, msg: AdmitMsg) -> None:
        new_rows = []
        for i, seq_id in enumerate(msg.seq_ids):
            gen = torch.Generator().manual_seed(int(msg.seeds[i]))
            self.states[seq_id] = _SeqState(
                list(msg.prompts[i]), gen, float(msg.temperature[i]), int(msg.top_k[i]), float(msg.top_p[i])
            )
            new_rows.append(msg.prompts[i][:-1])
        cache = self.runner.new_cache()
        tokens, valid = pad_rows(new_rows)
        self.runner.forward(cache, tokens, valid)
        self.cache.extend(cache)
        self.order.extend(msg.seq_ids)

    @torch.inference_mode()
    def release(self, seq_ids: list[int]) -> None:
        gone = set(seq_ids)
        keep = [i for i, s in enumerate(self.order) if s not in gone]
        self.cache.select(torch.tensor(keep, dtype=torch.long))
        self.order = [self.order[i] for i in keep]
        for s in gone:
            self.states.pop(s, None)

    def _rows(self, seq_ids: list[int]) -> None:
        """Bring the cache rows into the order of seq_ids (the target's running batch)."""
        if seq_ids != self.order:
            index = {s: i for i, s in enumerate(self.order)}
            assert set(seq_ids) == set(self.order), "drafter and target disagree on the batch"
            self.cache.select(torch.tensor([index[s] for s in seq_ids], dtype=torch.long))
            self.order = list(seq_ids)

    def _sampling(self, seq_ids: list[int]) -> BatchSampling:
        st = [self.states[s] for s in seq_ids]
        return BatchSampling(
            torch.tensor([s.temperature for s in st], dtype=torch.float32),
            torch.tensor([s.top_k for s in st], dtype=torch.long),
            torch.tensor([s.top_p for s in st], dtype=torch.float32),
        )

    # ---- the round ----------------------------------------------------------------------------

    @torch.inference_mode()
    def begin_round(
        self, msg: BeginRoundMsg, interrupted: Callable[[], bool] | None = None, stale: Callable[[], bool] | None = None
    ) -> bool:
        """Glue decode, fork and tree decode for every row; fills the speculation cache.

        `interrupted` is polled after each tree depth: once it is true (the outcome has
        arrived), the tree stops at that depth and the cache holds shorter speculations.
        `stale` is given for a round begun on a prediction (predict_round) before the target
        announced it; it is polled after the glue and each depth, and once it is true the round
        is taken back: cache and generators are as before the call. Returns whether the round
        was built."""
        started = time.perf_counter()
        seq_ids = list(msg.seq_ids)
        self._rows(seq_ids)
        undo_states = [self.states[s].generator.get_state() for s in seq_ids] if stale is not None else []
        b, k = len(seq_ids), self.k
        fanout = list(msg.fanout)
        # This drafter's share of the grid (the same for every row: row_fanout keeps the sum).
        share = torch.arange(self.shard, sum(fanout), self.num_shards)
        n_branches = share.numel()
        assert n_branches > 0, "the pool's budget gives every drafter at least one branch"
        sampling = self._sampling(seq_ids)
        synced = self.cache.lengths().tolist()
        spec = [msg.spec_tokens[r][: int(msg.num_draft[r])].tolist() for r in range(b)]
        pending = [self.states[s].tokens[synced[r] :] for r, s in enumerate(seq_ids)]
        assert all(pending), "the last committed token is always pending"
        tokens, valid = pad_rows([p + s for p, s in zip(pending, spec)])
        glue_start = self.cache.num_columns
        logits = self.runner.forward(self.cache, tokens, valid)  # [b, P+K, V_draft]
        pending_lens = torch.tensor([len(p) for p in pending])
        glue_lens = valid.sum(1)  # [b] columns the glue added: pending + s_T
        if stale is not None and stale():
            self._take_back(seq_ids, undo_states, glue_lens)
            return False
        # Row r's distribution after accepting j tokens sits at column len(pending_r) - 1 + j.
        base = torch.tensor([len(p) - 1 for p in pending])
        cols = base.unsqueeze(1) + torch.arange(k + 1).unsqueeze(0)  # [b, K+1]
        cols = torch.minimum(cols, torch.tensor([len(p) + len(s) - 1 for p, s in zip(pending, spec)]).unsqueeze(1))
        glue_logits = logits.gather(1, cols.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [b, K+1, Vd]
        glue_logits = glue_logits[..., : self.jit.target_vocab]

        # Fork: branch n of row r belongs to outcome j_rn and starts with candidate token t_rn.
        # A row whose speculation is shorter than K spends the budget on the outcomes it can have.
        row_fan = [row_fanout(fanout, len(spec[r]), self.jit.target_vocab) for r in range(b)]
        j_of = torch.tensor([[j for j, f in enumerate(rf) for _ in range(f)] for rf in row_fan], dtype=torch.long)[
            :, share
        ]  # [b, N_own]
        cand, branch_index, ranked = self._fork(glue_logits, msg.spec_tokens, spec, row_fan)
        cand = cand[:, share]

        # Tree decode: depth d feeds the branch tokens at depth d (the candidate at d = 0).
        committed = torch.tensor([len(self.states[s].tokens) for s in seq_ids])  # [b]
        spec_lens = torch.tensor([len(s) for s in spec])
        tree_start = self.cache.num_columns
        # History visibility of the glue columns: pending always; s_T[i] only for branches with i < j_n.
        col = torch.arange(tree_start)
        rel = col.view(1, 1, -1) - glue_start - base.view(b, 1, 1) - 1  # s_T index of each glue column
        is_spec = (rel >= 0) & (rel < spec_lens.view(b, 1, 1))
        glue_vis = ~is_spec | (rel < j_of.unsqueeze(-1))  # [b, N, tree_start]
        # Every depth appends N columns and every branch sees its own columns of all depths, so
        # one mask over the whole tree serves every depth: depth d attends to its first
        # tree_start + (d+1) N columns. Built once per round instead of once per depth.
        own = torch.eye(n_branches, dtype=torch.bool).repeat(b, 1, k)  # [b, N, K*N]
        allowed = torch.cat([glue_vis & self.cache.valid.unsqueeze(1), own], dim=-1)
        tree_mask = additive_mask(allowed, self.runner.attention_dtype).unsqueeze(1)  # [b, 1, N, tree_start + K*N]
        uniforms = torch.stack([torch.rand(k, n_branches, generator=self.states[s].generator) for s in seq_ids])
        one_hot = bool(sampling.greedy.all())
        feed = cand
        tree_started = time.perf_counter()
        out_tokens, out_probs = [], []
        fan_t = torch.tensor(fanout[:k] + [0] * max(0, k - len(fanout)), dtype=torch.long)
        for d in range(k):
            positions = committed.view(b, 1) + j_of + d
            step = self.runner.forward(
                self.cache, feed, positions=positions, attn_mask=tree_mask[..., : tree_start + (d + 1) * n_branches]
            )
            probs = self.jit.draft_probs(step, sampling)  # [b, N, V]
            probs = (
                saguaro_probs(probs, fan_t[d].expand(b, n_branches), self.saguaro_c) if self.saguaro_c < 1 else probs
            )
            feed = sample_from(probs, uniforms[:, d], one_hot)  # [b, N]
            out_tokens.append(feed)
            out_probs.append(probs)
            if stale is not None and stale():
                self._take_back(seq_ids, undo_states, glue_lens + (d + 1) * n_branches)
                return False
            if d < k - 1 and interrupted is not None and interrupted():
                break
        depth = len(out_tokens)
        self.cache.drop_last(spec_lens + depth * n_branches)
        now = time.perf_counter()
        build = (tree_started - started) + (now - tree_started) * k / depth
        self.round = _Round(
            seq_ids,
            spec,
            branch_index,
            torch.stack(out_tokens, -1),
            torch.stack(out_probs, 2),
            fanout,
            ranked,
            build,
            depth,
            (undo_states, pending_lens) if stale is not None else None,
        )
        self.counters.branch_probs_bytes = max(self.counters.branch_probs_bytes, self.round.probs.nbytes)
        return True

    def _take_back(self, seq_ids: list[int], states: list[torch.Tensor], columns: torch.Tensor) -> None:
        """Undo a predicted round: drop the `columns` [b] it added (glue, tree) and rewind the
        generators, so the next round draws exactly what it would have drawn without it."""
        self.cache.drop_last(columns)
        for s, state in zip(seq_ids, states):
            self.states[s].generator.set_state(state)
        self.round = None

    @torch.inference_mode()
    def abandon_round(self) -> None:
        """Take back a predicted round that was built but not announced: the target sent
        something else. Only rounds begun with `stale` can be taken back."""
        rnd = self.round
        assert rnd is not None and rnd.undo is not None, "only a predicted round can be abandoned"
        states, pending_lens = rnd.undo
        self._take_back(rnd.seq_ids, states, pending_lens)

    def predict_round(self, resolve: ResolveMsg, reply: SpeculationReply) -> BeginRoundMsg | None:
        """The round the target will most likely announce next, so that its build can start
        before the announcement arrives: after a round in which every row hit, the target
        verifies the branches it was just sent, with the fan-out the outcome message carried.
        None when that cannot be known (a miss: the target's backup decides that row's
        speculation)."""
        if not resolve.next_fanout or not bool(reply.hit.all()):
            return None
        committed = [len(self.states[s].tokens) for s in reply.seq_ids]  # resolve() has added the round's tokens
        return BeginRoundMsg(
            resolve.round_id + 1,
            list(reply.seq_ids),
            reply.tokens.clone(),
            reply.num_draft.clone(),
            list(resolve.next_fanout),
            committed,
        )

    @staticmethod
    def _fork(glue_logits: torch.Tensor, spec_tokens: torch.Tensor, spec: list[list[int]], row_fan: list[list[int]]):
        """Bonus candidates: for each row r and outcome j, the top row_fan[r][j] tokens of the
        glue distribution at j (raw draft logits), never the drafted token s_T[j].

        glue_logits [b, K+1, V], spec_tokens [b, K] (padded) -> cand [b, N], per row
        (j, token) -> branch n, and ranked [b, K+1, R]: each outcome's first R candidates in
        order (R = RANK_DEPTH, or V if smaller). Branches are numbered by outcome, then by rank."""
        b, k1, vocab = glue_logits.shape
        k = k1 - 1
        lens = torch.tensor([len(x) for x in spec])
        drafted = torch.zeros(b, k1, vocab, dtype=torch.bool)
        drafted[:, :k].scatter_(
            -1, spec_tokens[:, :k].long().unsqueeze(-1), (torch.arange(k) < lens.unsqueeze(1)).unsqueeze(-1)
        )
        widest = max(max(f) for f in row_fan)
        ranked = (
            glue_logits.masked_fill(drafted, float("-inf")).topk(min(max(widest, RANK_DEPTH), vocab), dim=-1).indices
        )
        top = ranked[..., :widest].tolist()  # [b][K+1][widest]
        cand, branch_index = [], []
        for r in range(b):
            row, index = [], {}
            for j, f in enumerate(row_fan[r]):
                for t in top[r][j][:f]:
                    index[(j, t)] = len(row)
                    row.append(t)
            cand.append(row)
            branch_index.append(index)
        return torch.tensor(cand, dtype=torch.long), branch_index, ranked[..., :RANK_DEPTH]

    @torch.inference_mode()
    def resolve(self, msg: ResolveMsg) -> SpeculationReply:
        """Record the outcome of every row; return cached branches for hits and, when asked,
        neural-backup speculations for misses."""
        rnd = self.round
        seq_ids = list(msg.seq_ids)
        b, k = len(seq_ids), self.k
        hit = torch.zeros(b, dtype=torch.bool)
        covered = torch.zeros(b, dtype=torch.bool)
        rank = torch.full((b,), -1, dtype=torch.long)
        tokens = torch.zeros(b, k, dtype=torch.long)
        probs = torch.zeros(b, k, self.jit.target_vocab)
        for r, s in enumerate(seq_ids):
            acc, bonus = int(msg.num_accepted[r]), int(msg.bonus_tokens[r])
            if rnd is not None and s in rnd.seq_ids:
                i = rnd.seq_ids.index(s)
                self.states[s].tokens.extend(rnd.spec_tokens[i][:acc] + [bonus])
                n = rnd.branch_index[i].get((acc, bonus))
                covered[r] = n is not None
                place = (rnd.ranked[i, acc] == bonus).nonzero()
                rank[r] = int(place[0, 0]) if place.numel() else RANK_DEPTH
                if n is not None and n % self.num_shards == self.shard:
                    hit[r] = True
                    tokens[r, : rnd.depth] = rnd.tokens[i, n // self.num_shards]
                    probs[r, : rnd.depth] = rnd.probs[i, n // self.num_shards]
        build_seconds = rnd.build_seconds if rnd is not None else 0.0
        num_draft = torch.where(hit, rnd.depth if rnd is not None else 0, 0)
        if rnd is not None:
            self.counters.rounds += 1
            self.counters.cut += int(rnd.depth < k)
        self.round = None
        # The neural backup drafts the rows no share holds (a row another drafter holds is
        # answered by that one); the pool asks one drafter per round.
        if msg.neural_backup and not bool(covered.all()):
            spec = self.draft_now(seq_ids, (~covered).tolist())
            tokens[~covered], probs[~covered] = spec.tokens[~covered], spec.probs[~covered]
            num_draft = torch.where(covered, num_draft, k)
        return SpeculationReply(
            msg.round_id,
            msg.seq_ids,
            hit,
            tokens,
            probs,
            num_draft,
            build_seconds,
            dataclasses.replace(self.counters),
            covered,
            rank,
        )

    @torch.inference_mode()
    def draft_reply(self, msg: DraftNowMsg) -> SpeculationReply:
        """Speculations drafted just in time for every row (sequences with no cached one)."""
        spec = self.draft_now(list(msg.seq_ids), list(msg.need))
        b = len(msg.seq_ids)
        return SpeculationReply(
            round_id=msg.round_id,
            seq_ids=msg.seq_ids,
            hit=torch.zeros(b, dtype=torch.bool),
            tokens=spec.tokens,
            probs=spec.probs,
            num_draft=spec.num_draft,
            counters=dataclasses.replace(self.counters),
        )

    @torch.inference_mode()
    def draft_now(self, seq_ids: list[int], need: list[bool]):
        """Neural backup: ordinary just-in-time drafting. The batch forward covers every row,
        but only rows in `need` draw from their own generators (the others draw from a
        scratch one and their drafts are discarded), so a seeded sequence's draws do not
        depend on which other sequences missed."""
        self._rows(list(seq_ids))
        scratch = torch.Generator()

        class _View:  # the attributes DraftModelProposer.propose reads from a sequence
            def __init__(self, st: _SeqState, needed: bool):
                self.generator = st.generator if needed else scratch
                self.num_tokens = len(st.tokens)
                self._tokens = st.tokens

            def tokens_from(self, start: int) -> list[int]:
                return self._tokens[start:]

        views = [_View(self.states[s], n) for s, n in zip(seq_ids, need)]
        spec = self.jit.propose(views, self.k, self._sampling(list(seq_ids)))
        # Keep only committed tokens in the cache: the drafts are rolled back at once.
        committed = torch.tensor([v.num_tokens for v in views])
        self.cache.drop_last(self.cache.lengths() - committed + 1)
        return spec
