"""ssd: Speculative Speculative Decoding engine (core algorithm; no Ray import).

The public names load lazily, so `ssd --help` and other light uses do not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "ssd.llm",
    "SamplingParams": "ssd.core.sampling_params",
    "EngineArgs": "ssd.core.config",
    "CompletionOutput": "ssd.core.sequence",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ssd' has no attribute {name!r}")
