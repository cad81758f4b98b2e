"""Tiny random Llama models for the statistical tests: peaked ones, and noisy copies as drafts."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ssd.model.demo_models import DemoTrainingConfig, ModelShape, build_tokenizer, make_model


def peaked_model(seed: int, shape: ModelShape, scale: float):
    """A random model whose weight matrices are scaled up: a few tokens hold most of the mass."""
    torch.manual_seed(seed)
    model = make_model(shape, DemoTrainingConfig())
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return model.eval()


def noisy_copy(model, seed: int, relative: float):
    """A copy with Gaussian noise of `relative` times each weight matrix's spread: a close draft."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * relative)
    return out


def save_models(root: Path, models: dict) -> dict[str, str]:
    """Save each model with the demo tokenizer under root/name; -> {name: path}."""
    tokenizer = build_tokenizer()
    paths = {}
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths
