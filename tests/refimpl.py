"""Independent reference implementations the tests compare the engine against."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def hf_greedy(path: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    outs = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p, add_special_tokens=False)])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens)
        outs.append(gen[0, ids.shape[1] :].tolist())
    return outs


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Temperature, then top_k, then the smallest sorted prefix whose mass reaches top_p.
    Written independently of ssd.sampling on purpose."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(len(z), dtype=bool)
    keep[order[: top_k if top_k > 0 else len(z)]] = True
    probs = np.where(keep, probs, 0.0)
    probs /= probs.sum()
    if top_p < 1:
        cum = np.cumsum(probs[order])
        n_keep = int(np.searchsorted(cum, top_p - 1e-12) + 1)
        nucleus = np.zeros(len(z), dtype=bool)
        nucleus[order[:n_keep]] = True
        probs = np.where(nucleus, probs, 0.0)
        probs /= probs.sum()
    return probs
