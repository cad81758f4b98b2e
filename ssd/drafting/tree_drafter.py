"""The draft side of SSD: build the speculation cache while the target verifies.

For each round the target announces the speculation s_T it is verifying (`begin_round`). The
drafter then, for every sequence of the batch:
  1. glue-decodes [tokens committed since last round, s_T] in one forward, which gives its
     K+1 next-token distributions, one per possible number j of accepted tokens;
  2. forks: at each j takes the top F_j tokens (by raw draft logits) as bonus candidates,
     excluding s_T[j] (had it been right, j would be larger);
  3. tree-decodes all B = sum F_j branches together, K forwards of B tokens each, every branch
     attending to the committed prefix, s_T[:j], its candidate and its own earlier tokens only;
  4. keeps each branch's K tokens and draft distributions under (j, candidate). When the outcome
     arrives before the tree is done, the tree stops at the depth reached and the branches
     hold that many tokens (a shorter speculation beats making the target wait).
When the outcome (j, bonus) arrives (`resolve`), a hit returns the cached branch; a miss is
answered just in time by the draft (neural backup) or left to the target's fast backup.

Shards: D drafters (a pool) split each round's branch grid. The round's fan-out is the whole
tree's; every drafter glue-decodes and forks the whole grid (the same top-F_j candidates, so all
agree on which outcomes are covered), then tree-decodes only its shard, the branches n with
n mod D = its shard index (branches are numbered by outcome, then rank, so every shard mixes
outcomes). On resolve, the drafter whose shard holds the outcome answers with the branch; the
others report the row covered but not theirs. Each drafter keeps its own KV cache of every
sequence and its own generators (seeded apart), so no two drafters ever share a random draw.
After a reply in which every row hit, the next announcement is known but for its arrival
(`predict_round`): a drafter in its own process begins that round at once and takes it back
whole if the announcement differs (`begin_round(stale=...)`, `abandon_round`).

Shapes: b sequences, N = B branches per sequence, K speculation length, V target vocab.
The drafter keeps its own KV cache: of committed tokens, and from a round's glue to its outcome
also s_T's columns, of which the outcome keeps the accepted ones (the next glue computes only
the bonus token and the next speculation); tree columns are scratch, past every row's length.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from ssd.core.protocol import (
    AdmitMsg,
    BeginRoundMsg,
    DrafterCounters,
    GridMsg,
    JoinMsg,
    NeuralBackupMsg,
    ReleaseMsg,
    ResolveMsg,
    SpeculationReply,
)
from ssd.core.sampling import BatchSampling
from ssd.core.speculation import Speculation
from ssd.core.transfer import to_device, to_host_async
from ssd.drafting.draft_grammars import DraftGrammars
from ssd.drafting.neural_backup import NeuralBackup, SeqState
from ssd.drafting.saguaro import row_fanout
from ssd.drafting.sd_proposer import SDProposer
from ssd.drafting.tree import BranchProbs, SpeculationTree, fork, tree_mask
from ssd.drafting.tree_answers import backed_up, commit_outcomes, known_rows, look_up, took_from_board
from ssd.drafting.tree_decode import Glue, OnFork, Publish, TreeRound, decode_tree, glue_decode
from ssd.drafting.tree_processing import BranchProcessing, ForkProcessing
from ssd.model.kv_cache import COLUMN_MULTIPLE
from ssd.model.runner import ModelRunner, pad_rows


class TreeDrafter:
    """The drafter of one draft process (no Ray, no channel: a worker session or the engine's
    own thread drives it). It implements the draft protocol (ssd.core.protocol.DraftClient)."""

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab: int,
        k: int,
        saguaro_c: float = 1.0,
        shard: int = 0,
        num_shards: int = 1,
        tokenizer: Callable[[], object] | None = None,
        early_drafts: bool = True,
        rows: int = 1,
        columns: int = COLUMN_MULTIPLE,
        max_bytes: int | None = None,
    ) -> None:
        """tokenizer: loads the target's tokenizer, for the grammars of constrained sequences
        (draft_grammars.py); None: their speculations are unmasked. early_drafts: draft new rows'
        first speculations at admission (neural_backup.py; off where the backup is fixed to fast,
        which never asks for them). rows, columns: the cache's size at its first forward (the most
        sequences admitted at once; their longest plus a tree's scratch columns; at most max_bytes)."""
        assert 0 <= shard < num_shards
        self.runner = runner
        self.k = k
        self.saguaro_c = saguaro_c
        self.shard, self.num_shards = shard, num_shards
        # What drafts just in time (the neural backup's drafter, neural_backup.py); shares the
        # cache and the probs handling.
        self.just_in_time = SDProposer(runner, target_vocab, rows, columns, max_bytes)
        self.cache = self.just_in_time.cache
        # Rounds on an accelerator run on it (device_round below); tests force it on the CPU.
        self.device_round = runner.device.type != "cpu"
        self.grammars = DraftGrammars(tokenizer, target_vocab)
        self.states: dict[int, SeqState] = {}
        self.order: list[int] = []  # seq id of each cache row
        self.round: SpeculationTree | None = None
        self.counters = DrafterCounters()
        self._reply: SpeculationReply | None = None  # the answer to the last resolve(), until reply()
        self._answered = False  # resolve() ran and reply() has not taken its answer yet
        self.backup = NeuralBackup(self.just_in_time, self.grammars, k)
        self.early_drafts = early_drafts
        self.last_build_s = 0.0  # the last round's build, projected to depth K (SpeculationTree.build_seconds)

    # ---- membership -------------------------------------------------------------------------

    def join(self, msg: JoinMsg) -> None:
        """Build shard msg.shard of msg.num_shards from now on (before any sequence is admitted)."""
        assert not self.order, "a drafter joins a pool before any sequence is admitted"
        self.shard, self.num_shards = int(msg.shard), int(msg.num_shards)

    @torch.inference_mode()
    def admit(self, msg: AdmitMsg) -> None:
        self.backup.settle(self.states)
        for seq_id, committed, seed, sampling in zip(msg.seq_ids, msg.tokens, msg.seeds, msg.sampling):
            self.states[seq_id] = SeqState(list(committed), torch.Generator().manual_seed(int(seed)), sampling)
            self.grammars.admit(seq_id, sampling, list(committed))
        tokens, valid = pad_rows([t[:-1] for t in msg.tokens])
        self.runner.forward(self.cache.add_rows(len(msg.tokens)), tokens, valid, with_logits=False)
        self.order.extend(msg.seq_ids)
        self._draft_early(list(msg.seq_ids))

    def _draft_early(self, new: list[int]) -> None:
        """Rows admitted to a drafter that holds no others: their first speculation, drafted now,
        while the target prefills them (neural_backup.py). In a pool that splits outcomes only
        shard 0 does it: the neural backup asks the first live shard."""
        if self.early_drafts and self.shard == 0 and self.round is None and self.order == new:
            self.backup.draft_early(new, self.states)

    @torch.inference_mode()
    def release(self, msg: ReleaseMsg) -> None:
        self.backup.settle(self.states)
        gone = set(msg.seq_ids)
        keep = [i for i, s in enumerate(self.order) if s not in gone]
        self.cache.keep(torch.tensor(keep, dtype=torch.long))
        self.order = [self.order[i] for i in keep]
        for s in gone:
            self.states.pop(s, None)
            self.grammars.release(s)

    def reset(self) -> None:
        """Forget every sequence, the shard and the counters (a worker's next target session)."""
        self.release(ReleaseMsg(list(self.order)))
        self.round, self._reply, self._answered = None, None, False
        self.shard, self.num_shards = 0, 1
        self.counters = DrafterCounters()

    def held(self) -> dict:
        """What this drafter holds for its target: sequences and rows of its KV cache."""
        return {"sequences": len(self.states), "cache_rows": self.cache.batch_size}

    def _rows(self, seq_ids: list[int]) -> None:
        """Bring the cache rows into the order of seq_ids (the target's running batch)."""
        if seq_ids != self.order:
            index = {s: i for i, s in enumerate(self.order)}
            assert set(seq_ids) == set(self.order), "drafter and target disagree on the batch"
            self.cache.keep(torch.tensor([index[s] for s in seq_ids], dtype=torch.long))
            self.order = list(seq_ids)

    def _sampling(self, seq_ids: list[int]) -> BatchSampling:
        return BatchSampling.of([self.states[s].sampling for s in seq_ids])

    def _greedy(self, seq_ids: list[int]) -> torch.Tensor:
        """[b] bool: greedy rows (temperature 0), whose replies carry tokens only (SpeculationReply)."""
        return torch.tensor([self.states[s].sampling.greedy for s in seq_ids], dtype=torch.bool)

    # ---- the round ----------------------------------------------------------------------------

    @torch.inference_mode()
    def begin_round(
        self,
        msg: BeginRoundMsg,
        interrupted: Callable[[], bool] | None = None,
        stale: Callable[[], bool] | None = None,
        on_fork: OnFork | None = None,
    ) -> bool:
        """Glue decode, fork and tree decode for every row; fills the speculation cache.

        `interrupted` is polled after each tree depth: once it is true (the outcome has
        arrived), the tree stops at that depth and the cache holds shorter speculations.
        `stale` is given for a round begun on a prediction (predict_round) before the target
        announced it; it is polled after the glue and each depth, and once it is true the round
        is taken back: cache and generators are as before the call. `on_fork`: see OnFork.
        Returns whether the round was built."""
        started = time.perf_counter()
        self.backup.settle(self.states)
        seq_ids = list(msg.seq_ids)
        self._rows(seq_ids)
        undo = [self.states[s].generator.get_state() for s in seq_ids] if stale is not None else []
        # This drafter's shard of the grid (the same for every row: row_fanout keeps the sum).
        shard = torch.arange(self.shard, sum(msg.fanout), self.num_shards)
        assert shard.numel() > 0, "the pool's budget gives every drafter at least one branch"
        spec = [msg.spec_tokens[r][: int(msg.num_draft[r])].tolist() for r in range(len(seq_ids))]
        rows = [(self.states[s].sampling, self.states[s].tokens) for s in seq_ids]
        processing = ForkProcessing(self.grammars, seq_ids, rows, spec, msg.spec_tokens, self.k)
        # Grammars and adjustments follow host-side matchers and histories: such rounds run on the host.
        on_device = self.device_round and not processing.active
        glue = self._glue(seq_ids, spec, on_device)
        glue = dataclasses.replace(glue, logits=processing.glue(glue.logits))
        if stale is not None and stale():
            self._take_back(seq_ids, undo, glue.columns)
            return False
        row_fan = [row_fanout(msg.fanout, len(s), self.just_in_time.target_vocab) for s in spec]
        grid = fork(glue.logits, msg.spec_tokens, torch.tensor([len(s) for s in spec]), row_fan)
        cand, outcome = grid.candidates[:, to_device(shard, grid.candidates.device)], grid.outcome[:, shard]
        # The outcome is looked up on the host, in a copy made before the tree's first depth runs.
        lookup = dataclasses.replace(grid, candidates=to_host_async(grid.candidates), ranked=to_host_async(grid.ranked))
        sampling = self._sampling(seq_ids)
        publish = None
        if on_fork is not None:  # on a device the grid's copy waits for the glue and the fork, not the tree
            forked = GridMsg(msg.round_id, seq_ids, grid.outcome, grid.candidates.cpu())
            publish = on_fork(forked, cand.shape[1], not all(sampling.greedy.tolist()))
        processed = processing.tree(cand, outcome, sampling)
        tree = self._tree_decode(
            seq_ids, spec, msg.fanout, cand, outcome, glue, undo, interrupted, stale, sampling, processed, on_device,
            publish,
        )  # fmt: skip
        if tree is None:
            return False
        tokens, probs, tree_started = tree
        depth = tokens.shape[-1]
        now = time.perf_counter()
        self.round = SpeculationTree(
            seq_ids, spec, lookup, tokens, probs, list(msg.fanout),
            (tree_started - started) + (now - tree_started) * self.k / depth, depth,
            (undo, glue.columns) if stale is not None else None,
        )  # fmt: skip
        self.last_build_s = self.round.build_seconds
        self.counters.count_build(depth, tree_started - started, now - tree_started)
        self.counters.branch_probs_bytes = max(self.counters.branch_probs_bytes, probs.nbytes)
        return True

    def _glue(self, seq_ids: list[int], spec: list[list[int]], on_device: bool) -> Glue:
        """Step 1 over [committed tokens the cache lacks, s_T] per row (tree_decode.glue_decode)."""
        synced = self.cache.lengths().tolist()
        pending = [self.states[s].tokens[synced[r] :] for r, s in enumerate(seq_ids)]
        assert all(pending), "the last committed token is always pending"
        return glue_decode(self.runner, self.cache, pending, spec, self.k, self.just_in_time.target_vocab, on_device)

    def _tree_decode(
        self,
        seq_ids: list[int],
        spec: list[list[int]],
        fanout: list[int],
        cand: torch.Tensor,
        outcome: torch.Tensor,
        glue: Glue,
        undo: list[torch.Tensor],
        interrupted: Callable[[], bool] | None,
        stale: Callable[[], bool] | None,
        sampling: BatchSampling,
        processed: BranchProcessing | None,
        on_device: bool,
        publish: Publish | None = None,
    ) -> tuple[torch.Tensor, BranchProbs, float] | None:
        """Steps 2-3 for this shard's branches: cand, outcome [b, N_own] -> (tokens [b, N_own,
        depth], probs [b, N_own, depth, V] sparse where it can be, when the tree began), or None
        when the round went stale and was taken back (tree_decode.py). The tree is a scratch
        forward past every row's length: its columns are gone when it ends, and s_T's glue
        columns are rolled back."""
        k, device = self.k, cand.device
        spec_lens = torch.tensor([len(s) for s in spec])
        lengths = self.cache.lengths()  # the glue's included
        mask = tree_mask(lengths, glue.start, glue.base, spec_lens, outcome, k, self.runner.attention_dtype)
        uniforms = torch.stack([torch.rand(k, cand.shape[1], generator=self.states[s].generator) for s in seq_ids])
        rnd = TreeRound(
            cand, outcome, torch.tensor([len(self.states[s].tokens) for s in seq_ids]),
            to_device(mask, self.runner.device),  # built once a round; each depth attends to a slice of it
            to_device(uniforms, device),
            to_device(torch.tensor(fanout[:k] + [0] * max(0, k - len(fanout)), dtype=torch.long), device), sampling,
        )  # fmt: skip

        def halt(d: int) -> str | None:
            if stale is not None and stale():
                return "stale"
            return "cut" if interrupted is not None and interrupted() else None

        probs_of, vocab = self.just_in_time.draft_probs, self.just_in_time.target_vocab
        tree = decode_tree(
            self.runner, self.cache, rnd, self.saguaro_c, probs_of, vocab, on_device, processed, halt, publish
        )
        if tree is None:
            self._take_back(seq_ids, undo, glue.columns)
        return tree

    def _take_back(self, seq_ids: list[int], states: list[torch.Tensor], columns: torch.Tensor) -> None:
        """Undo a predicted round: drop the `columns` [b] its glue added and rewind the
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
        states, columns = rnd.undo
        self._take_back(rnd.seq_ids, states, columns)

    def predict_round(self, resolve: ResolveMsg, reply: SpeculationReply | None) -> BeginRoundMsg | None:
        """The round the target will most likely announce next, so that its build can start
        before the announcement arrives: after a reply that carried every row's next
        speculation (here), whether a hit's branch or a miss's just-in-time draft, the target
        verifies those. None when that cannot be known (a row this reply left out: another shard
        holds its branch, or the target's fast backup speculates for it)."""
        if reply is None or not resolve.next_fanout or not bool((reply.num_draft > 0).all()):
            return None
        committed = [len(self.states[s].tokens) for s in reply.seq_ids]  # resolve() has added the round's tokens
        return BeginRoundMsg.after_reply(resolve, reply, committed)

    # ---- answers --------------------------------------------------------------------------------

    @torch.inference_mode()
    def resolve(self, msg: ResolveMsg) -> None:
        """Record the outcome of every row; the answer (reply()) holds cached branches for hits
        and, when asked, neural-backup speculations for misses: tokens, and the distributions of
        the sampled rows only (a greedy row's verification reads none). In a pool whose target
        names the answering shard of each row (msg.answering), this drafter answers its own rows
        only, and none at all when it has none (reply() is then None). Rows are tracked in host
        lists: this sits between the target's outcome and its next verification (at batch 1 each
        tensor operation costs microseconds)."""
        self.backup.settle(self.states)
        rnd, seq_ids, k = self.round, list(msg.seq_ids), self.k
        b = len(seq_ids)
        mine = [a == self.shard for a in msg.answering] if msg.answering else [True] * b
        greedy = [self.states[s].sampling.greedy for s in seq_ids]
        tokens = torch.zeros(b, k, dtype=torch.long)
        probs = None if all(greedy) else torch.zeros(b, k, self.just_in_time.target_vocab)
        hit, covered, rank = self._look_up(rnd, msg, greedy, tokens, probs)
        hit = [h and m for h, m in zip(hit, mine)]
        depth = rnd.depth if rnd is not None else 0
        num_draft = torch.tensor([depth if h else 0 for h in hit], dtype=torch.long)
        took_from_board(msg, hit, tokens, probs, num_draft)
        if rnd is not None:
            self.counters.rounds += 1
            self.counters.cut += int(rnd.depth < k)
        self.round = None
        need = backed_up(msg, mine, hit, covered, self.shard)
        if any(need):
            missed = torch.tensor(need, dtype=torch.bool)
            spec = self._draft_just_in_time(seq_ids, need)
            spec = spec.on_host(missed)
            tokens[missed] = spec.tokens[missed]
            if probs is not None:
                sampled = missed & ~torch.tensor(greedy, dtype=torch.bool)
                probs[sampled] = spec.probs[sampled]
            num_draft = torch.where(missed, k, num_draft)
        self._answered = True
        if not any(mine):
            self._reply = None
            return
        flags = torch.tensor([hit, covered, greedy], dtype=torch.bool)  # [3, b]
        seconds = rnd.build_seconds if rnd is not None else 0.0
        self._reply = SpeculationReply(
            msg.round_id, msg.seq_ids, flags[0], tokens, probs, num_draft, seconds, self.counters.copy(), flags[1],
            torch.tensor(rank, dtype=torch.long), flags[2],
        )  # fmt: skip

    def _look_up(
        self, rnd: SpeculationTree | None, msg: ResolveMsg, greedy: list[bool], tokens: torch.Tensor, probs
    ) -> tuple[list[bool], list[bool], list[int]]:
        """Commit the outcome of every row the round holds, then look it up (tree_answers.look_up)."""
        known, index = known_rows(rnd, msg)
        if known:
            commit_outcomes(rnd, msg, known, index, self.states, self.grammars, self.cache)
        return look_up(rnd, msg, known, index, greedy, tokens, probs, self.shard, self.num_shards)

    def reply(self, deadline_s: float = 0.0) -> SpeculationReply | None:
        """The answer to the last resolve() (computed there: nothing to wait for); None where this
        drafter answers no row of it (ResolveMsg.answering)."""
        assert self._answered, "reply() without its resolve()"
        out, self._reply, self._answered = self._reply, None, False
        return out

    @torch.inference_mode()
    def neural_backup(self, msg: NeuralBackupMsg) -> SpeculationReply:
        """Speculations drafted just in time for the rows in msg.need (sequences with no cached one),
        or at their admission where that drafted these (neural_backup.py)."""
        seq_ids, need, b = list(msg.seq_ids), list(msg.need), len(msg.seq_ids)
        spec = self.backup.take_early(seq_ids, need)
        if spec is not None:
            self.counters.drafted_early += b
        else:
            self.backup.settle(self.states)
            spec = self._draft_just_in_time(seq_ids, need).on_host(torch.tensor(need, dtype=torch.bool))
        tokens = spec.tokens.clamp(min=0)  # rows not needed are discarded, but the wire carries ids
        greedy = self._greedy(msg.seq_ids)
        probs = None if bool(greedy.all()) else spec.probs.masked_fill(greedy.view(b, 1, 1), 0.0)
        return SpeculationReply(
            msg.round_id, msg.seq_ids, torch.zeros(b, dtype=torch.bool), tokens, probs, spec.num_draft,
            counters=self.counters.copy(), greedy=greedy,
        )  # fmt: skip

    def _draft_just_in_time(self, seq_ids: list[int], need: list[bool]) -> Speculation:
        """The neural backup's speculations for the rows in `need` (neural_backup.py)."""
        self._rows(seq_ids)
        return self.backup.draft(seq_ids, self.states, need)

    def close(self) -> None:
        """Stop a split draft's ranks (a whole draft has nothing to release)."""
        self.runner.close()
