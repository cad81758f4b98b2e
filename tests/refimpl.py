"""Independent reference implementations the tests compare the engine against."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import chisquare
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
    """Temperature, then top_k (every token at least as large as the k-th largest), then the
    smallest sorted prefix whose mass reaches top_p.
    Written independently of ssd.core.sampling on purpose."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-z, kind="stable")
    k = min(top_k, len(z)) if top_k > 0 else len(z)
    keep = z >= z[order[k - 1]]  # ties with the k-th largest kept, as Hugging Face does
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


def chi_square_bins(counts, expected_probs, min_expected: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """(observed, expected) bins of counts against probabilities; categories with expected count
    below min_expected are merged into one bin (folded into the smallest big bin when even the
    merged bin is too small). A positive count where the probability is exactly zero fails at
    once: that token must never be emitted."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    impossible = (probs == 0) & (counts > 0)
    assert not impossible.any(), f"emitted categories of zero probability: {np.nonzero(impossible)[0].tolist()}"
    expected = probs / probs.sum() * counts.sum()
    big = expected >= min_expected
    obs, exp = list(counts[big]), list(expected[big])
    if (~big).any():
        small_obs, small_exp = counts[~big].sum(), expected[~big].sum()
        if small_exp >= min_expected or not obs:
            obs.append(small_obs)
            exp.append(small_exp)
        else:
            i = int(np.argmin(exp))
            obs[i] += small_obs
            exp[i] += small_exp
    return np.array(obs), np.array(exp)


def chi_square_p(counts, expected_probs, min_expected: float = 5.0) -> float:
    """p-value of counts against probabilities, over chi_square_bins (1.0 with a single bin)."""
    obs, exp = chi_square_bins(counts, expected_probs, min_expected)
    if len(obs) < 2:
        return 1.0
    return float(chisquare(obs, exp).pvalue)


def adjusted_logits(logits, params, prompt: list[int], output: list[int], eos: int | None) -> np.ndarray:
    """A request's penalties, logit bias, allowed tokens and min_tokens applied to one position's
    logits [V], given the tokens before it, in the order ssd/processing/adjustments.py documents.
    Written independently of it on purpose (token by token, in float64)."""
    z = np.asarray(logits, dtype=np.float64).copy()
    for t in set(prompt) | set(output):
        z[t] = z[t] / params.repetition_penalty if z[t] > 0 else z[t] * params.repetition_penalty
    for t in set(output):
        z[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    for t, bias in params.logit_bias.items():
        z[t] += bias
    if params.allowed_token_ids is not None:
        keep = np.zeros(len(z), dtype=bool)
        keep[list(params.allowed_token_ids)] = True
        z[~keep] = -np.inf
    if len(output) < params.min_tokens:
        for t in list(params.stop_token_ids) + ([eos] if eos is not None and not params.ignore_eos else []):
            z[t] = -np.inf
    return z


def min_p_filter(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens below min_p times the largest probability; renormalize."""
    probs = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


class ReferenceAdjustments:
    """adjusted_logits as a Hugging Face logits processor, for `generate(logits_processor=...)`."""

    def __init__(self, params, prompt_len: int, eos: int | None) -> None:
        self.params, self.prompt_len, self.eos = params, prompt_len, eos

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for row in range(scores.shape[0]):
            ids = input_ids[row].tolist()
            prompt, output = ids[: self.prompt_len], ids[self.prompt_len :]
            z = adjusted_logits(scores[row].double().numpy(), self.params, prompt, output, self.eos)
            out[row] = torch.from_numpy(z).to(scores.dtype)
        return out
