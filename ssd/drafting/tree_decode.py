"""SSD drafter steps 1 and 3 (tree_drafter.py): the glue decode, one forward over the tokens the
draft's cache lacks and the speculation being verified, which gives the K+1 distributions the
fork ranks its candidates by; and the tree decode, K forwards over the branches of this
drafter's shard, every branch attending to its own history only (tree.py's mask), each depth
drawing one token per branch and feeding it to the next.

On an accelerator a depth reads nothing back: the draw, Saguaro's scaling and the kept
distributions stay on the device until the reply. (A round in which a row has a grammar or
adjustments runs on the host: their processing follows host-side matchers and histories.) A draw
from a distribution without mass is -1 there (the host's sampler raises); the reply refuses a
branch holding one (SpeculationTree.branches). The host waits for each depth to finish before
it polls `halt`: what cuts the tree short and what times the build must see real progress, not
queued work (a wait, no data read back). It queues the next depth before that wait, so the
device runs depth d + 1 while the host waits for depth d, polls and issues: a depth costs the
device's time, not the device's plus the host's. A cut drops the one depth queued past it (its
columns are scratch, its uniforms drawn with the round's). Each depth's tokens are copied to the
host behind it (pinned memory, no wait), so the reply to an outcome reads them, and the grid it
looks the outcome up in (tree_drafter.py), without waiting for the depth still queued.

Shapes: b sequences, N branches per sequence (this shard's), K speculation length, V the
target's vocabulary, W the cache's width before the tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from ssd.core.protocol import GridMsg
from ssd.core.sampling import BatchSampling, sample_from, sample_on_device, sampling_tensors
from ssd.core.transfer import to_device, to_host_async
from ssd.drafting.saguaro import saguaro_probs
from ssd.drafting.sd_proposer import draw_step, to_vocab
from ssd.drafting.tree import BranchProbs
from ssd.drafting.tree_processing import BranchProcessing
from ssd.model.kv_cache import StaticKVCache
from ssd.model.runner import ModelRunner, pad_rows
from ssd.model.step_graphs import run_step


@dataclass(frozen=True)
class Glue:
    """What the glue forward gave for a round (step 1)."""

    logits: torch.Tensor  # [b, K+1, V] the draft's next-token logits after accepting j tokens
    start: torch.Tensor  # [b] the cache column where each row's glue columns begin (its length before)
    base: torch.Tensor  # [b] the glue column (relative to start) of each row's last committed token
    columns: torch.Tensor  # [b] columns the glue added: pending committed tokens + s_T


def glue_decode(
    runner: ModelRunner,
    cache: StaticKVCache,
    pending: list[list[int]],
    spec: list[list[int]],
    k: int,
    vocab: int,
    on_device: bool,
) -> Glue:
    """One forward over [pending, s_T] per row: pending, the committed tokens the cache lacks (at
    least the last one), spec, the speculation being verified (its real tokens); -> its logits at
    each row's last committed token and after each of its drafts, in the target's vocabulary of
    `vocab` tokens (left on the draft's device when `on_device`). The columns stay in the cache."""
    start = cache.lengths()
    tokens, valid = pad_rows([p + s for p, s in zip(pending, spec)])
    logits = runner.forward(cache, tokens, valid, on_host=not on_device)  # [b, P+K, V_draft]
    # Row r's distribution after accepting j tokens sits at column len(pending_r) - 1 + j.
    base = torch.tensor([len(p) - 1 for p in pending])
    cols = base.unsqueeze(1) + torch.arange(k + 1).unsqueeze(0)  # [b, K+1]
    last = torch.tensor([len(p) + len(s) - 1 for p, s in zip(pending, spec)]).unsqueeze(1)
    cols = to_device(torch.minimum(cols, last), logits.device)
    glue_logits = logits.gather(1, cols.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))  # [b, K+1, V_draft]
    return Glue(glue_logits[..., :vocab], start, base, valid.sum(1))


@dataclass(frozen=True)
class TreeRound:
    """What one round's tree decode starts from."""

    # Where the round runs (the draft's device on its device round, else the host): candidates,
    # uniforms and fanout. The mask is always on the draft's device.
    candidates: torch.Tensor  # [b, N] long: each branch's first token
    outcome: torch.Tensor  # [b, N] long, host: the outcome each branch stands for
    committed: torch.Tensor  # [b] long, host: committed tokens per row (a branch's positions follow them)
    mask: torch.Tensor  # [b, 1, N, W + K N]: the whole tree's (tree_mask), sliced per depth
    uniforms: torch.Tensor  # [b, K, N]: one draw per branch and depth
    fanout: torch.Tensor  # [K] long: Saguaro's F_d at depth d
    sampling: BatchSampling  # the rows' settings (host)


# What the caller says after each depth d: None (go on), "cut" (the outcome arrived: stop at
# this depth) or "stale" (a predicted round that was not announced: give it up).
Halt = Callable[[int], str | None]
# What is handed each depth d as it ends: (d, its draws [b, N] on the host, the distributions
# [b, N, V] they were drawn from on the host, or None where none are at hand there).
Publish = Callable[[int, torch.Tensor, torch.Tensor | None], None]
# Handed a round's branch grid once forked, before the tree decode, with this shard's branches
# per row and whether some row keeps distributions: -> what each depth is handed to as it ends
# (Publish), or None. A worker sends the grid to its target where asked (a pool's grid
# shard) and publishes the depths on its board (ssd/transport/shm_board.py).
OnFork = Callable[[GridMsg, int, bool], Publish | None]


def decode_tree(
    runner: ModelRunner,
    cache: StaticKVCache,
    rnd: TreeRound,
    saguaro_c: float,
    draft_probs: Callable[..., torch.Tensor],
    vocab: int,
    on_device: bool,
    processed: BranchProcessing | None,
    halt: Halt,
    publish: Publish | None = None,
) -> tuple[torch.Tensor, BranchProbs, float] | None:
    """-> tokens [b, N, depth] (on the host: copied depth by depth as the depths run), their
    distributions (BranchProbs: sparse where it can, on the draft's device), depth <= K, and when
    the tree began (time.perf_counter(): on a device, when the glue and fork queued before it had
    run, so that a build's preparation and its depths are timed apart); None when `halt` said
    stale. Each depth writes its N columns at W + d N + 0..N-1 of every row, a
    scratch forward (the caller drops its columns). draft_probs: SDProposer.draft_probs, into
    the target's vocabulary of `vocab` tokens; processed: the branches' grammars and adjustments
    (tree_processing.py), None when no row has any. publish: handed each depth as it ends (a
    worker's board, ssd/transport/shm_board.py), before `halt` is asked."""
    b, n, k = *rnd.candidates.shape, rnd.uniforms.shape[1]
    tree_start = rnd.mask.shape[-1] - k * n
    greedy = rnd.sampling.greedy.tolist()
    # A greedy batch without processing draws each branch's argmax, which is what sampling its one-hot
    # distribution gives (process_logits, Saguaro's scaling keeps it one-hot), and keeps none.
    argmax_only = processed is None and all(greedy)
    one_hot = not on_device and all(greedy)  # a greedy batch with processing: its draws are argmaxes too
    # Sampled rows kept sparse: top-k ones, by their counted support, on the host.
    narrow = (rnd.sampling.top_k > 0).tolist()
    sampling = rnd.sampling.to(rnd.candidates.device)
    if on_device and processed is None and not argmax_only:  # each branch a row of the depths' draw step
        flat_settings = tuple(t.repeat_interleave(n) for t in sampling_tensors(sampling))  # [b N] each
    tokens, kept = [], BranchProbs(vocab, greedy)

    def issue(d: int, feed: torch.Tensor) -> _Depth:
        """Queue depth d's forward and draw, fed `feed` [b, N] (the depth before's draws)."""
        positions = rnd.committed.view(b, 1) + rnd.outcome + d
        columns = (tree_start + d * n + torch.arange(n)).expand(b, n)
        mask = rnd.mask[..., : tree_start + (d + 1) * n]
        step = runner.forward(cache, feed, positions=positions, attn_mask=mask, columns=columns, on_host=not on_device)
        if argmax_only:
            return _Depth.queued(to_vocab(step, vocab).argmax(-1), None)  # [b, N]
        if on_device and processed is None:
            return _Depth.queued(*_draw_on_device(runner, step, rnd, d, flat_settings, saguaro_c, vocab))
        return _Depth.queued(*_draw(step, rnd, d, sampling, saguaro_c, draft_probs, on_device, one_hot, processed))

    # A device round queues depth d + 1 before it waits for depth d, so that the device never idles
    # while the host issues a depth (module doc); a cut then drops the depth queued past it.
    ahead = on_device
    prepared, started = _recorded(rnd.candidates.device), time.perf_counter()
    queued = issue(0, rnd.candidates)
    if prepared is not None:  # depth 0 is queued behind the preparation: the device stays busy
        prepared.synchronize()
        started = time.perf_counter()
    for d in range(k):
        depth = queued
        if ahead and d < k - 1:
            queued = issue(d + 1, depth.drawn.clamp(min=0))  # what a -1 feeds is never read
        depth.wait()
        tokens.append(depth.host)
        if depth.probs is not None:
            kept.add(depth.probs, narrow, counted=not on_device)
            kept.done, kept.device = depth.done, depth.probs.device
        if processed is not None and d < k - 1:
            processed.advance(depth.drawn)
        if publish is not None:  # a device round's distributions stay there: its tokens only
            publish(d, depth.host, None if on_device else depth.probs)
        said = halt(d)
        if said == "stale":
            return None
        if said == "cut" and d < k - 1:
            break
        if not ahead and d < k - 1:
            queued = issue(d + 1, depth.drawn)
    return torch.stack(tokens, -1), kept, started


def _recorded(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on a CUDA device's current stream (None elsewhere)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass(frozen=True)
class _Depth:
    """One depth of the tree decode, queued on the draft's device."""

    drawn: torch.Tensor  # [b, N] long: each branch's token at this depth (-1: a draw without mass, on a device)
    host: torch.Tensor  # drawn's copy on the host (drawn itself there), complete once `done` is
    probs: torch.Tensor | None  # [b, N, V]: the distributions drawn from; None for argmax draws (kept nowhere)
    done: torch.cuda.Event | None  # recorded after the depth's work on a CUDA device

    @staticmethod
    def queued(drawn: torch.Tensor, probs: torch.Tensor | None) -> _Depth:
        host = to_host_async(drawn)
        return _Depth(drawn, host, probs, _recorded(drawn.device))

    def wait(self) -> None:
        """Until the depth has run: what cuts the tree short and what times the build must see
        real progress, not queued work (a wait, no data read back)."""
        if self.done is not None:
            self.done.synchronize()


def _draw_on_device(runner: ModelRunner, step, rnd: TreeRound, d: int, flat_settings: tuple, saguaro_c, vocab):
    """_draw of a depth without processing on the draft's device, as one step (draw_step) that
    replays a CUDA graph where the runner has them. The b x N branches are the step's rows (each
    draws from its own logits with its row's settings, flat_settings [b N] each), so that its
    captures vary with b N in power-of-two buckets, not with every budget and batch size."""
    b, n = rnd.candidates.shape
    fanout = rnd.fanout[d].expand(b * n, 1)
    inputs = (step.reshape(b * n, 1, -1), rnd.uniforms[:, d].reshape(b * n, 1), *flat_settings, fanout)
    draw = partial(draw_step, vocab, False, c=saguaro_c)
    tokens, probs = run_step(runner.steps, runner.device, f"tree draw V={vocab} C={saguaro_c}", draw, *inputs)
    return tokens.view(b, n), probs.view(b, n, -1)


def _draw(step, rnd: TreeRound, d: int, sampling: BatchSampling, saguaro_c, draft_probs, on_device, one_hot, processed):
    """Depth d's draw from the draft's logits step [b, N, V_draft]: -> (tokens [b, N], the
    distributions [b, N, V] they were drawn from, Saguaro's scaling included); one_hot: every
    row is greedy (sample_from)."""
    b, n = rnd.candidates.shape
    if processed is None:
        probs = draft_probs(step, sampling, on_device)  # [b, N, V]
    else:
        probs = processed.probs(step, rnd.sampling, draft_probs)
    if saguaro_c < 1:
        probs = saguaro_probs(probs, rnd.fanout[d].expand(b, n), saguaro_c)
    u = rnd.uniforms[:, d]
    return (sample_on_device(probs, u) if on_device else sample_from(probs, u, one_hot)), probs
