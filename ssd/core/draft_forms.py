"""Which form of the adjustments a draft steps (draft_adjustments.py's tensor operations, or
host_draft_adjustments.py's compiled loops), by where its rows are processed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ssd.core.draft_adjustments import DraftAdjustments
from ssd.core.logits_processing import Adjustments

if TYPE_CHECKING:
    from ssd.core.host_draft_adjustments import HostDraftAdjustments


def draft_form(first: Adjustments, device: torch.device) -> DraftAdjustments | HostDraftAdjustments:
    """first's form for a draft whose rows are processed on `device` (the same methods): on the
    host, compiled loops (host_draft_adjustments.py); elsewhere tensor operations (draft_adjustments.py)."""
    if device.type != "cpu":
        return DraftAdjustments.of(first).to(device)
    # Imported here: numba takes ~0.4 s to import, which only a process drafting with adjusted
    # rows on the host pays.
    try:
        from ssd.core.host_draft_adjustments import HostDraftAdjustments
    except RuntimeError as e:  # numba's, where it finds no writable place for its cache
        if "cannot cache" not in str(e):
            raise
        raise RuntimeError(
            f"{e}. The draft's compiled loops need a writable cache: set NUMBA_CACHE_DIR to a "
            "writable directory (numba tries __pycache__ beside the module, then ~/.cache/numba)"
        ) from e
    return HostDraftAdjustments.of(first)
