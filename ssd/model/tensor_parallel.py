"""A model (the target, or a draft) split over t tensor-parallel ranks, one process each, behind
ModelRunner's interface.

Rank 0 lives in the process that runs the model (the engine's; a draft worker's): it calls
`TensorParallelRunner.forward` and the cache methods exactly as it calls a ModelRunner's. Each
call is first broadcast to ranks 1..t-1 as a step (a fixed header, then one payload of token ids
and, for a tree's forward, its mask), and then every rank runs the same
operation on its own shard and its own cache: a forward's attention and MLP each end in an
all-reduce, the logits' vocabulary slices are gathered on rank 0 (shards.py says how the weights
are cut). The other ranks run `serve_steps`: a loop that receives a step and runs it, with no
Python per token beyond that.

Step (header [HEADER] long, broadcast by rank 0; then the payload when its size is > 0, then the
mask when its size is > 0):
    op, cache id, a, b, c, d, payload size, mask size
    NEW_CACHE  a = rows                  a cache the ranks keep in step with rank 0's
    ADD_ROWS   a = count                 its new rows, as the window the next forward writes
    KEEP       payload rows [m]          the kept rows, in order
    DROP_LAST  payload counts [b]        each row rolled back by its count
    FORWARD    a = window?, b = n, c = flags (WITH_LOGITS, POSITIONS, COLUMNS), d = mask width;
               payload tokens [b, n], new_valid [b, n], then positions [b, n] and columns [b, n]
               where flagged; mask: the attention mask's allowed entries [b, 1, n, d] as uint8
               (a draft's scratch forward: SSD's tree decode)
    STOP                                 the rank exits
Every rank's cache sees the same operations in the same order, so default positions, lengths and
masks agree without being sent; what a scratch forward chooses itself is sent.

Communication: a gloo group carries the steps, sent by rank 0 to each rank (CPU tensors, waited
for indefinitely by idle ranks); the forward's collectives run on the same group on CPU (as
point-to-point messages: ShardComm says why) and on an NCCL group on GPUs, each bounded by
STEP_TIMEOUT, so a rank that hung fails the engine's call instead of stalling it. A failed call
raises TensorParallelFailed and stops every rank: the group cannot be trusted after a collective
failed midway, and the serving layer replaces an engine that raised.
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.nn.functional as F

from ssd.model.kv_cache import COLUMN_MULTIPLE, StaticKVCache, additive_mask
from ssd.model.shards import ShardPlan

HEADER = 8
NEW_CACHE, ADD_ROWS, KEEP, DROP_LAST, FORWARD, STOP = range(1, 7)
WITH_LOGITS, POSITIONS, COLUMNS = 1, 2, 4  # a FORWARD step's flags
# A collective of a forward waits at most this long for the other ranks: a rank that died fails
# at once (its sockets close), one that hung after this.
STEP_TIMEOUT = datetime.timedelta(seconds=30)
IDLE_TIMEOUT = datetime.timedelta(days=7)  # how long a rank waits for rank 0's next step


class TensorParallelFailed(RuntimeError):
    """A rank died or hung: the tensor-parallel model cannot run another forward."""


_STEP, _DATA = 1, 2  # message tags: steps from rank 0, the forward's partial sums and logits


class ShardComm:
    """One rank's side of the collectives the lean forward calls on a shard (fast_forward.py).

    On CPU (gloo) they are written as point-to-point messages: gloo's own all-reduce took 1.3 ms
    for 2048 floats between two processes on the development VM, an exchange of the same tensor
    by send and receive 0.08 ms (both ad hoc). Every rank then adds the t partial sums in rank
    order, so every rank holds the same bits. On GPUs the forward's collectives are NCCL's."""

    def __init__(self, plan: ShardPlan, control, data) -> None:
        self.plan, self.rank, self.world = plan, plan.rank, plan.world
        self.control, self.data = control, data  # gloo group for steps; group of the forward's collectives
        self.point_to_point = data is control  # CPU: one gloo group for everything
        self.others = [r for r in range(self.world) if r != self.rank]

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """ids [b, n] -> their embeddings [b, n, hidden]: each rank looks up the ids in its
        vocabulary slice (zeros elsewhere), the all-reduce adds the one non-zero row."""
        first, end = self.plan.vocabulary
        local = ids - first
        inside = (local >= 0) & (local < end - first)
        x = F.embedding(local.clamp(0, max(end - first - 1, 0)), weight)
        return self.all_reduce(x.masked_fill(~inside.unsqueeze(-1), 0))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if not self.point_to_point:
            self.data.allreduce([x]).wait(STEP_TIMEOUT)
            return x
        parts = {self.rank: x}
        works = [self.data.send([x], r, _DATA) for r in self.others]
        for r in self.others:
            parts[r] = torch.empty_like(x)
            works.append(self.data.recv([parts[r]], r, _DATA))
        for work in works:
            work.wait(STEP_TIMEOUT)
        total = parts[0]
        for r in range(1, self.world):
            total = total + parts[r]
        return total

    def gather_vocabulary(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[b, n, share] on every rank -> [b, n, V] on rank 0, None on the others."""
        logits = logits.contiguous()
        if self.rank != 0:
            if self.point_to_point:
                self.data.send([logits], 0, _DATA).wait(STEP_TIMEOUT)
            else:
                self.data.gather([], logits, 0, STEP_TIMEOUT).wait(STEP_TIMEOUT)
            return None
        parts = [logits] + [torch.empty_like(logits) for _ in self.others]
        if self.point_to_point:
            works = [self.data.recv([parts[r]], r, _DATA) for r in self.others]
        else:
            works = [self.data.gather(parts, logits, 0, STEP_TIMEOUT)]
        for work in works:
            work.wait(STEP_TIMEOUT)
        return torch.cat(parts, dim=-1)[..., : self.plan.vocabulary_size]

    # ---- steps --------------------------------------------------------------------------------

    def send_step(self, op: int, cache_id: int, fields=(), payload=None, mask=None) -> None:
        """fields: up to four ints (a, b, c, d); payload: long; mask: uint8."""
        parts = [t.contiguous() for t in (payload, mask) if t is not None and t.numel()]
        sizes = [0 if t is None else t.numel() for t in (payload, mask)]
        header = torch.tensor([op, cache_id, *fields, *[0] * (4 - len(fields)), *sizes], dtype=torch.long)
        works = [self.control.send([t], r, _STEP) for r in self.others for t in [header, *parts]]
        for work in works:
            work.wait(STEP_TIMEOUT)

    def receive_step(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """-> the header's fields, the payload and the mask (each empty when the step has none)."""
        header = torch.zeros(HEADER, dtype=torch.long)
        self.control.recv([header], 0, _STEP).wait(IDLE_TIMEOUT)
        fields = header.tolist()
        payload = torch.zeros(fields[6], dtype=torch.long)
        mask = torch.zeros(fields[7], dtype=torch.uint8)
        for part in (payload, mask):
            if part.numel():
                self.control.recv([part], 0, _STEP).wait(STEP_TIMEOUT)
        return fields, payload, mask


class MirroredCache:
    """Rank 0's cache (or a window of it): every change is sent to the other ranks first."""

    def __init__(self, runner: TensorParallelRunner, cache_id: int, local: StaticKVCache, window: bool) -> None:
        self.runner, self.id, self.local, self.window = runner, cache_id, local, window

    @property
    def batch_size(self) -> int:
        return self.local.batch_size

    @property
    def capacity(self) -> tuple[int, int]:
        return self.local.capacity

    def lengths(self) -> torch.Tensor:
        return self.local.lengths()

    def nbytes(self) -> int:
        return self.local.nbytes()

    def add_rows(self, count: int) -> MirroredCache:
        def here() -> MirroredCache:
            return MirroredCache(self.runner, self.id, self.local.add_rows(count), True)

        return self.runner.run(ADD_ROWS, self.id, (count,), then=here)

    def keep(self, rows: torch.Tensor) -> None:
        self.runner.run(KEEP, self.id, payload=rows.long(), then=lambda: self.local.keep(rows))

    def drop_last(self, counts: torch.Tensor) -> None:
        self.runner.run(DROP_LAST, self.id, payload=counts.long(), then=lambda: self.local.drop_last(counts))


class TensorParallelRunner:
    """ModelRunner's interface (forward, new_cache, device, vocab_size, attention_dtype) for rank
    0 of t, the target's or a draft's (role names which, in errors).

    local: rank 0's ModelRunner over its shard; ranks: the other ranks (ssd.model.tp_launch's
    RankGroup: poll() -> how those that ended ended, close() stops them); store: the store the
    groups met over, which rank 0 serves (kept for as long as the ranks run). Calls are serialized
    (a lock): every rank must see the steps in one order."""

    def __init__(self, local, comm: ShardComm, ranks, store=None, role: str = "target") -> None:
        self.local, self.comm, self.ranks, self.store, self.role = local, comm, ranks, store, role
        self.device, self.vocab_size, self.attention_dtype = local.device, local.vocab_size, local.attention_dtype
        # The model's Hugging Face config and generation config, as a loaded model has them (the
        # engine reads its EOS there); set by the loader.
        self.config = self.generation_config = None
        self.steps = None  # a split model's round steps run eagerly, as its forwards do
        self._lock = threading.Lock()
        self._caches = 0
        self.failure: str | None = None

    def run(self, op: int, cache_id: int, fields=(), payload=None, mask=None, then=None):
        """Send a step to the other ranks, then run `then()` here (its collectives meet theirs)."""
        with self._lock:
            if self.failure is not None:
                raise TensorParallelFailed(self.failure)
            try:
                self.comm.send_step(op, cache_id, fields, payload, mask)
                return then() if then is not None else None
            except RuntimeError as err:
                self.failure = f"tensor-parallel {self.role} failed ({self.ranks.describe()}): {err}"
                self.ranks.close(kill=True)
                raise TensorParallelFailed(self.failure) from err

    def graph_stats(self) -> None:
        """A split model runs eagerly (its collectives are not captured)."""
        return None

    def broken(self) -> str | None:
        """Why this model cannot run another forward (a call failed, or a rank exited while it
        was idle), or None. Polls the rank processes without waiting: a serving health check
        calls it from another thread."""
        if self.failure is None and self.ranks.poll():
            return f"tensor-parallel {self.role}: {self.ranks.describe()}"
        return self.failure

    def new_cache(self, rows: int = 1, columns: int = COLUMN_MULTIPLE, max_bytes: int | None = None) -> MirroredCache:
        cache_id = self._caches
        self._caches += 1
        columns = self.local.start_columns(rows, columns, max_bytes)  # every rank's, as rank 0 sizes it
        local = self.run(NEW_CACHE, cache_id, (rows, columns), then=lambda: self.local.new_cache(rows, columns))
        return MirroredCache(self, cache_id, local, False)

    def forward(
        self, cache: MirroredCache, tokens: torch.Tensor, new_valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
        columns: torch.Tensor | None = None, *, on_host: bool = True, with_logits: bool = True,
    ) -> torch.Tensor | None:  # fmt: skip
        """ModelRunner.forward, every kind: a target's prefill or verification, a draft's steps,
        and a draft's scratch forward (SSD's tree: positions, columns and attn_mask given; the
        mask is sent as its allowed entries, which every rank makes additive again)."""
        b, n = tokens.shape
        if new_valid is None:
            new_valid = torch.ones(b, n, dtype=torch.bool)
        given = [t.reshape(-1).long().cpu() for t in (positions, columns) if t is not None]
        payload = torch.cat([tokens.reshape(-1).long(), new_valid.reshape(-1).long(), *given])
        flags = (WITH_LOGITS if with_logits else 0) | (POSITIONS if positions is not None else 0)
        flags |= COLUMNS if columns is not None else 0
        allowed = None if attn_mask is None else (attn_mask == 0).to("cpu", torch.uint8)  # additive_mask's zeros
        width = 0 if attn_mask is None else attn_mask.shape[-1]

        def here():
            return self.local.forward(
                cache.local, tokens, new_valid, positions, attn_mask, columns, on_host=on_host, with_logits=with_logits
            )

        return self.run(FORWARD, cache.id, (int(cache.window), n, flags, width), payload, allowed, then=here)

    def close(self) -> None:
        """Stop the other ranks (idempotent)."""
        with self._lock:
            if self.failure is None:
                self.failure = f"the tensor-parallel {self.role} was closed"
                try:
                    self.comm.send_step(STOP, 0)
                except RuntimeError:
                    self.ranks.close(kill=True)
                    return
            self.ranks.close(kill=False)


def serve_steps(runner, comm: ShardComm) -> None:
    """Ranks 1..t-1: run rank 0's steps on this rank's shard until STOP. runner: this rank's
    ModelRunner over its shard (its collectives meet rank 0's)."""
    caches: dict[int, StaticKVCache] = {}
    windows: dict[int, StaticKVCache] = {}
    while True:
        (op, cache_id, a, b, c, d, _, _), payload, mask = comm.receive_step()  # as rank 0's run() sent them
        if op == STOP:
            return
        if op == NEW_CACHE:
            caches[cache_id] = runner.new_cache(a, b)
        elif op == ADD_ROWS:
            windows[cache_id] = caches[cache_id].add_rows(a)
        elif op == KEEP:
            caches[cache_id].keep(payload)
        elif op == DROP_LAST:
            caches[cache_id].drop_last(payload)
        elif op == FORWARD:
            cache = windows.pop(cache_id) if a else caches[cache_id]
            _forward_step(runner, cache, b, c, d, payload, mask)
        else:
            raise AssertionError(f"unknown step {op}")


def _forward_step(runner, cache: StaticKVCache, n: int, flags: int, width: int, payload, mask) -> None:
    """A FORWARD step on this rank's shard (its fields as TensorParallelRunner.forward sent them)."""
    parts = payload.view(2 + bool(flags & POSITIONS) + bool(flags & COLUMNS), -1, n)  # [2 + given, b, n]
    tokens, valid, given = parts[0], parts[1].bool(), iter(parts[2:])
    positions = next(given) if flags & POSITIONS else None
    columns = next(given) if flags & COLUMNS else None
    attn_mask = None
    if width:
        allowed = mask.view(tokens.shape[0], 1, n, width).bool()
        attn_mask = additive_mask(allowed, runner.attention_dtype)
    runner.forward(cache, tokens, valid, positions, attn_mask, columns, with_logits=bool(flags & WITH_LOGITS))
