"""The parts of a drafter frame's bodies (ssd/transport/wire.py): reading them in order and
building the int body from Python lists and tensors."""

from __future__ import annotations

import torch


class BodyReader:
    """Reads a body part in order: numbers and lists through a memoryview (indexing the tensor
    makes a tensor first: microseconds each), tensors as views (clone what outlives the frame)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.ints, self.pos = values, 0  # `ints`: the int body, or the float one for a values reader
        self._view = memoryview(values.numpy()) if values.numel() else memoryview(b"")

    def take(self, n: int) -> torch.Tensor:
        out = self.ints[self.pos : self.pos + n]
        self.pos += n
        return out

    def take_list(self, n: int) -> list:
        out = self._view[self.pos : self.pos + n].tolist()
        self.pos += n
        return out

    def one(self) -> int | float:  # a float from a values reader
        self.pos += 1
        return self._view[self.pos - 1]


def flat_ints(*parts) -> torch.Tensor:
    """Lists of ints and long tensors -> one flat long tensor: small parts through one Python
    list (a tensor per part cost ~20 us a message), large ones (a sparse layout) as tensors."""
    out: list[torch.Tensor] = []
    small: list[int] = []
    for part in parts:
        if not isinstance(part, torch.Tensor):
            small.extend(part)
        elif part.numel() <= _SMALL_PART:
            small.extend(part.reshape(-1).tolist())
        else:
            if small:
                out.append(torch.tensor(small, dtype=torch.long))
                small = []
            out.append(part.reshape(-1).long())
    if small or not out:
        out.append(torch.tensor(small, dtype=torch.long))
    return out[0] if len(out) == 1 else torch.cat(out)


_SMALL_PART = 256  # elements up to which a tensor part joins flat_ints' Python list
