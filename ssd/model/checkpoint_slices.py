"""Rows or columns of the tensors of a safetensors checkpoint, read from the files into memory of
the caller's own, a bounded chunk at a time.

Why not `safe_open(...).get_slice`: it maps the whole file, and every page a slice touches stays
resident in the reading process for as long as the mapping lives. A tensor-parallel rank that
read its slices that way peaked at about the whole checkpoint's size on this CPU (t = 2, 1940 MiB
of weights: 2647 MiB peak for a 970 MiB shard). Here a slice of rows is one read of its bytes,
and a slice of columns reads at most CHUNK_BYTES of whole rows at a time and keeps the columns,
so the peak is the shard plus one chunk; the page cache holds the file, not the process.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a
JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...}, then
the data, each tensor row-major at its offsets past the header. A sharded checkpoint lists which
file holds each tensor in model.safetensors.index.json.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CHUNK_BYTES = 32 * 2**20

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class CheckpointSlices:
    """Tensors by name across a checkpoint directory's safetensors files."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        index = directory / INDEX_FILE
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (directory / SINGLE_FILE).exists():
            files = [SINGLE_FILE]
        else:
            raise ValueError(
                f"tensor parallelism reads safetensors checkpoints: {directory} has neither {SINGLE_FILE} nor "
                f"{INDEX_FILE} (save the model with safe_serialization=True)"
            )
        self._entries: dict[str, tuple[Path, int, torch.dtype, list[int]]] = {}  # name -> file, offset, dtype, shape
        for name in files:
            path = directory / name
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                if entry["dtype"] not in _DTYPES:
                    raise ValueError(f"{path}: tensor {key!r} has dtype {entry['dtype']}, which cannot be loaded")
                begin = 8 + length + entry["data_offsets"][0]
                self._entries[key] = (path, begin, _DTYPES[entry["dtype"]], entry["shape"])

    def has(self, name: str) -> bool:
        return name in self._entries

    def rows(self, name: str, span: tuple[int, int] | None = None) -> torch.Tensor:
        """Rows [span) of tensor `name` (all of it when span is None), in its stored dtype."""
        path, offset, dtype, shape = self._entries[name]
        first, end = span if span is not None else (0, shape[0] if shape else 1)
        row_items = _product(shape[1:])
        out = torch.empty([end - first, *shape[1:]] if shape else [], dtype=dtype)
        with open(path, "rb") as f:
            f.seek(offset + first * row_items * out.element_size())
            _read_into(f, out)
        return out

    def columns(self, name: str, span: tuple[int, int]) -> torch.Tensor:
        """Columns [span) of the 2-D tensor `name`, in its stored dtype."""
        path, offset, dtype, shape = self._entries[name]
        assert len(shape) == 2, (name, shape)
        rows, width = shape
        out = torch.empty(rows, span[1] - span[0], dtype=dtype)
        step = max(1, CHUNK_BYTES // max(1, width * out.element_size()))
        with open(path, "rb") as f:
            f.seek(offset)
            for first in range(0, rows, step):
                chunk = torch.empty(min(step, rows - first), width, dtype=dtype)
                _read_into(f, chunk)
                out[first : first + chunk.shape[0]] = chunk[:, span[0] : span[1]]
        return out


def _product(dims: list[int]) -> int:
    total = 1
    for d in dims:
        total *= d
    return total


def _read_into(f, tensor: torch.Tensor) -> None:
    view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        count = f.readinto(view[done:])
        if not count:
            raise ValueError(f"{f.name}: the file ends before the tensor does (a truncated checkpoint?)")
        done += count
