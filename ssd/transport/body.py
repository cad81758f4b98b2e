"""The parts of a drafter frame's bodies (ssd/transport/wire.py): reading them in order and
building the int body from Python lists and tensors."""

from __future__ import annotations

import torch

_SMALL_PART = 256  # elements up to which a tensor part joins flat_ints' Python list


class BodyReader:
    """Reads a body part (a host tensor, as every transport hands it to unframe) in order:
    numbers and lists through a memoryview (indexing the tensor makes a tensor first:
    microseconds each), arrays as tensor views (clone what outlives the frame). Reading past
    the end or a negative count raises ValueError, which ends the session like any malformed
    frame."""

    def __init__(self, values: torch.Tensor) -> None:
        self.ints, self.pos = values, 0  # `ints`: the int body, or the float one for a values reader
        self._view = memoryview(values.numpy()) if values.numel() else memoryview(b"")

    def _advance(self, n: int) -> int:
        start, self.pos = self.pos, self.pos + n
        if n < 0 or self.pos > len(self._view):
            raise ValueError(f"malformed frame: {n} values asked at {start} of a body of {len(self._view)}")
        return start

    def take(self, n: int) -> torch.Tensor:
        start = self._advance(n)
        return self.ints[start : self.pos]

    def take_list(self, n: int) -> list:
        start = self._advance(n)
        return self._view[start : self.pos].tolist()

    def one(self) -> int | float:  # a float from a values reader
        return self._view[self._advance(1)]


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
