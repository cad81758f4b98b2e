"""A static KV cache: buffers allocated once per size, written in place, rows of their own length.

Each layer keeps two buffers
    keys, values   # [rows, kv_heads, capacity, head_dim]
and row r holds its committed tokens in columns [0, lengths[r]). A forward of n tokens per row
writes them at columns lengths[r] + 0..n-1 (a batch's rows are right-padded, so a row's real
tokens come first and its padding after them, past what it commits) and attends over the first
`width` = max(lengths + n) columns of every row, the mask hiding each row's columns past its
own length. So:
- rolling a row back is lowering its length (the columns beyond are hidden, then overwritten by
  the next write): exact, with no tensor work;
- there are no holes, hence no compaction: dropping finished rows moves the kept rows to the
  front (one gather of the used columns), and admitted rows are prefilled in place, through a
  `window` over the rows past the batch;
- a scratch forward (SSD's tree decode) writes at explicit columns past every row's length and
  commits nothing: its columns are gone the moment it ends.

Why one slab per layer rather than vLLM's and nano-vllm's blocks: blocks pay off through a
paged-attention kernel that reads them in place and through prefix sharing; here attention is
torch's scaled_dot_product_attention (on CPU, and the eager path on GPU), which needs each row's
keys in one strided tensor, so blocks would be gathered into one every forward. A slab per
layer is read as a view, with no copy, and a row's rollback stays a length.

Memory stays flat: the buffers are created at the first forward with room for the rows and
columns the owner expects (an engine's caches: max_num_seqs rows of max_model_len columns, plus a
draft tree's scratch columns, so that a server's memory is what its first request made it; the
soak, loadtest/soak.py, found a cache sized by the sequences seen so far doubling its columns
minutes into the run), grow (doubling, logged) when a forward needs more, and never shrink. They are zero-filled: a
column no row has written is still read (masked) by rows shorter than the widest, and attention
multiplies masked values by a weight of 0, which keeps garbage out only if it is finite.

Lengths live on the host ([rows] long): every shape decision (width, growth) reads them without
waiting for a device; the write columns go to the device as one index tensor per forward.

Invariants: 0 <= lengths[r] <= columns of the buffers, for rows in use; a row's columns below its
length hold its first lengths[r] tokens in order, so lengths[r] is the row's next position id.
"""

from __future__ import annotations

import logging

import torch

from ssd.core.transfer import to_device

logger = logging.getLogger(__name__)

COLUMN_MULTIPLE = 256  # first growth step of the columns (then they double): few sizes over a server's life


def start_columns(rows: int, wanted: int, slot_bytes: int, max_bytes: int) -> int:
    """The columns a cache of `rows` rows takes at its first forward: `wanted` when rows x wanted
    slots of `slot_bytes` (one row's column over every layer's keys and values) fit in
    `max_bytes`, else as many as fit, at least COLUMN_MULTIPLE."""
    return min(wanted, max(COLUMN_MULTIPLE, max_bytes // max(1, rows * slot_bytes)))


class _Storage:
    """The buffers every window of one cache shares: layer index -> (keys, values)."""

    def __init__(self, rows: int, columns: int) -> None:
        self.rows, self.columns = rows, columns  # the sizes the buffers have (or will have, before the first write)
        self.lengths = torch.zeros(rows, dtype=torch.long)  # [rows], host
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # What a runner recorded against these buffers' addresses (CUDA graphs): emptied whenever
        # the buffers move, and gone with them.
        self.captured: dict = {}

    def reserve(self, rows: int, columns: int) -> None:
        """Room for `rows` rows of `columns` columns, keeping every row's contents."""
        if rows <= self.rows and columns <= self.columns:
            return
        new_rows = max(rows, 2 * self.rows) if rows > self.rows else self.rows
        new_columns = self.columns
        if columns > self.columns:
            new_columns = max(_round_up(columns, COLUMN_MULTIPLE), 2 * self.columns)
        if self.layers:  # the buffers exist: they move (a resident step of a long-running process)
            logger.info(
                "KV cache grows from %d x %d to %d x %d (rows x columns) for a forward of %d x %d",
                self.rows, self.columns, new_rows, new_columns, rows, columns,
            )  # fmt: skip
        for index, pair in self.layers.items():
            self.layers[index] = tuple(_moved(t, new_rows, new_columns) for t in pair)
        self.captured.clear()
        lengths = torch.zeros(new_rows, dtype=torch.long)
        lengths[: self.rows] = self.lengths
        self.rows, self.columns, self.lengths = new_rows, new_columns, lengths

    def buffers(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s buffers; created at its first write, shaped after `like` [b, kv_heads,
        n, head_dim]."""
        pair = self.layers.get(index)
        if pair is None:
            _, heads, _, dim = like.shape
            pair = self.layers[index] = tuple(like.new_zeros(self.rows, heads, self.columns, dim) for _ in range(2))
        return pair


class StaticKVCache:
    """Rows [start, start + batch_size) of one storage. A runner's new cache starts at row 0 with
    no rows; `add_rows` and `keep` change the batch, `drop_last` rolls rows back."""

    def __init__(self, rows: int = 1, columns: int = COLUMN_MULTIPLE) -> None:
        self._storage = _Storage(max(1, rows), _round_up(max(1, columns), 64))
        self._start = 0
        self.batch_size = 0
        # The forward in progress (begin_forward): where it writes and how wide it attends.
        self._columns: torch.Tensor | None = None  # [b, n] long, on the model's device (unless _first)
        self._first: int | None = None  # the common first column, when every row writes the same n consecutive ones
        self._width = 0
        self._scratch = False

    # ---- rows ---------------------------------------------------------------------------------

    def lengths(self) -> torch.Tensor:  # [b] long, host (a copy)
        return self._storage.lengths[self._start : self._start + self.batch_size].clone()

    @torch.inference_mode()
    def add_rows(self, count: int) -> StaticKVCache:
        """Append `count` empty rows to the batch -> a window over them, for their prefill."""
        assert self._start == 0, "rows are added to a cache, not to a window"
        first = self.batch_size
        self._storage.reserve(first + count, 1)
        self._storage.lengths[first : first + count] = 0
        self.batch_size += count
        return self._window(first, count)

    def _window(self, start: int, count: int) -> StaticKVCache:
        window = StaticKVCache.__new__(StaticKVCache)
        window.__dict__.update(self.__dict__)
        window._start, window.batch_size = start, count
        return window

    @torch.inference_mode()
    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the given rows (host [m] long), in that order, as rows 0..m-1."""
        storage, m = self._storage, len(rows)
        if m and torch.equal(rows, torch.arange(m)):
            self.batch_size = m
            return
        used = int(storage.lengths[rows].max()) if m else 0
        for keys, values in storage.layers.values():
            keys[:m, :, :used] = keys[rows, :, :used]
            values[:m, :, :used] = values[rows, :, :used]
        storage.lengths[:m] = storage.lengths[rows].clone()
        self.batch_size = m

    @torch.inference_mode()
    def drop_last(self, counts: torch.Tensor) -> None:
        """Roll row r back by its counts[r] newest tokens (counts [b] long, host, >= 0)."""
        lengths = self._storage.lengths[self._start : self._start + self.batch_size]
        assert bool((counts >= 0).all()) and bool((counts <= lengths).all()), (counts, lengths)
        lengths -= counts

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, columns) the buffers hold."""
        return self._storage.rows, self._storage.columns

    @property
    def dtype(self) -> torch.dtype | None:
        """The buffers' dtype (None before the first forward)."""
        return next(iter(self._storage.layers.values()))[0].dtype if self._storage.layers else None

    def nbytes(self) -> int:
        """Bytes of the buffers (allocated; CPU pages no row reached are not resident)."""
        return sum(t.nbytes for pair in self._storage.layers.values() for t in pair)

    # ---- what a captured forward needs ----------------------------------------------------------

    def captured(self) -> dict | None:
        """The storage's record of captured forwards (see _Storage.captured), or None where a
        captured forward cannot run: a window (its rows start past 0) or buffers not created yet
        (a capture would allocate them in the graph's memory)."""
        return self._storage.captured if self._start == 0 and self._storage.layers else None

    @torch.inference_mode()
    def reserve(self, rows: int, columns: int) -> None:
        """Room for `rows` rows of `columns` columns (a captured forward's padded shape)."""
        self._storage.reserve(rows, columns)

    def static_view(self, rows: int, columns: torch.Tensor, width: int) -> StaticKVCache:
        """A view of rows [0, rows) whose forward writes at the device tensor `columns` [rows, n]
        (read when the forward runs, so a captured forward writes wherever it is told at replay)
        and attends over `width` columns; it commits nothing itself."""
        view = self._window(0, rows)
        view._first, view._columns, view._width, view._scratch = None, columns, width, True
        return view

    # ---- one forward --------------------------------------------------------------------------

    @torch.inference_mode()
    def begin_forward(self, n: int, device: torch.device, columns: torch.Tensor | None = None) -> int:
        """Prepare a forward of n tokens per row -> its attention width. By default row r writes
        at lengths[r] + 0..n-1 and commit() advances its length; `columns` [b, n] (host) gives
        a scratch forward's write columns instead, each at or past its row's length, and
        commit() keeps no column of it."""
        lengths = self.lengths()
        scratch = columns is not None
        if not scratch:
            columns = lengths.unsqueeze(1) + torch.arange(n)
        assert columns.shape == (self.batch_size, n)
        assert not scratch or bool((columns >= lengths.unsqueeze(1)).all()), "a scratch forward writes past each row"
        width = int(columns.max()) + 1 if columns.numel() else 0
        self._storage.reserve(self._start + self.batch_size, width)
        first = columns[:, :1]
        uniform = bool((columns == first[:1] + torch.arange(n)).all()) if self.batch_size else False
        self._first = int(first[0, 0]) if uniform else None
        # The index goes to the device only where the write needs it (rows at different columns).
        self._columns = None if uniform else to_device(columns, device)
        self._width, self._scratch = width, scratch
        return width

    def append(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's n new columns k, v [b, kv_heads, n, head_dim] into layer `index`
        -> its keys and values [b, kv_heads, width, head_dim]: views of the buffers, no copy."""
        keys, values = self._storage.buffers(index, k)
        rows = slice(self._start, self._start + self.batch_size)
        keys, values = keys[rows], values[rows]
        if self._first is not None:  # every row writes the same consecutive columns: a slice copy
            end = self._first + k.shape[2]
            keys[:, :, self._first : end] = k
            values[:, :, self._first : end] = v
        else:
            batch = torch.arange(self.batch_size, device=k.device).unsqueeze(1)  # [b, 1]
            keys[batch, :, self._columns] = k.transpose(1, 2)  # the indexed view is [b, n, kv_heads, head_dim]
            values[batch, :, self._columns] = v.transpose(1, 2)
        return keys[:, :, : self._width], values[:, :, : self._width]

    @torch.inference_mode()
    def commit(self, new_valid: torch.Tensor) -> None:
        """End the forward: each row keeps its real new tokens (new_valid [b, n], host; a prefix
        of each row), or none in a scratch forward."""
        if not self._scratch:
            self._storage.lengths[self._start : self._start + self.batch_size] += new_valid.sum(1)
        self._columns = None

    def attention_mask(self, new_valid: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Additive mask [b, 1, n, width] of a default forward (after begin_forward): token i of
        row r sees the row's committed columns and its own real new tokens up to i."""
        return default_mask(to_device(self.lengths(), device), to_device(new_valid, device), self._width, dtype)


def default_mask(lengths: torch.Tensor, new_valid: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """lengths [b] and new_valid [b, n] (on the device) -> the additive mask [b, 1, n, width] of
    a default forward: token i of row r sees the row's first lengths[r] columns and its own real
    new tokens up to i. Columns past lengths[r] + n are hidden, so any width that covers the
    widest row gives the same mask on the columns they share."""
    b, n = new_valid.shape
    col = torch.arange(width, device=new_valid.device).view(1, 1, -1)
    rel = col - lengths.view(b, 1, 1)  # [b, 1, width]: which new token a column holds, if >= 0
    real_new = new_valid.gather(1, rel.view(b, -1).clamp(0, n - 1)).view(b, 1, -1)
    query = torch.arange(n, device=new_valid.device).view(1, n, 1)
    allowed = (rel < 0) | ((rel <= query) & real_new)
    return additive_mask(allowed, dtype).unsqueeze(1)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """allowed [..., L] bool -> the additive attention mask [..., L]: 0 where allowed, the
    dtype's lowest value elsewhere."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _moved(buffer: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A larger buffer holding all of `buffer`: every column, not only those up to the longest
    row's length, since a tree that grows the buffers mid-way attends to its earlier depths'
    scratch columns past every length."""
    grown = buffer.new_zeros(rows, buffer.shape[1], columns, buffer.shape[3])
    grown[: buffer.shape[0], :, : buffer.shape[2]] = buffer
    return grown
