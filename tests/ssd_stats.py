"""Statistical exactness checks of SSD shared by the in-process and process-transport tests.

One fixed prompt is sampled many times with distinct seeds; every emitted token is tagged with
the source of the round that emitted it (cache, neural backup, fast backup) and grouped by the
context it followed; each group's counts are tested by chi-square against the target's exact
next-token distribution (Hugging Face forward plus an independent numpy statement of
temperature / top-k / top-p), and the statistics of a subset are combined into one p-value.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import torch
from refimpl import adjusted_logits, chi_square_bins, min_p_filter, reference_probs
from scipy.stats import chi2
from tiny_models import noisy_copy, peaked_model, save_models

from ssd import LLM, SamplingParams
from ssd.model.demo_models import ModelShape

N_SAMPLES = 3000
STAT_K = 2
STAT_PROMPT = "def f(x):"
STAT_MAX_TOKENS = 6  # rounds emit at most K+1 = 3 tokens: tokens 4 to 6 always come from round 2+


def save_peaked_pair(root) -> tuple[str, str]:
    """A tiny target with scaled-up weights, so that a few continuations of STAT_PROMPT hold most
    of the mass (the most likely 3-token prefix has probability ~0.7) while the next tokens still
    vary; and a noisy copy as the draft (acceptance ~0.7 at K = 2)."""
    target = peaked_model(2, ModelShape(64, 2, 2, 128), scale=60.0)
    paths = save_models(root, {"target": target, "draft": noisy_copy(target, seed=5, relative=0.05)})
    return paths["target"], paths["draft"]


@torch.no_grad()
def exact_next(
    model, contexts: list[tuple[int, ...]], params: SamplingParams, prompt_len: int
) -> dict[tuple[int, ...], np.ndarray]:
    """Exact next-token distribution of the target after every context (HF forward, by length),
    with the request's penalties, bias and min_p (refimpl.adjusted_logits: the output is the
    context past prompt_len; samples ignore EOS)."""
    out = {}
    by_len = defaultdict(list)
    for c in contexts:
        by_len[len(c)].append(c)
    for group in by_len.values():
        logits = model(input_ids=torch.tensor(group)).logits[:, -1].double().numpy()
        for c, row in zip(group, logits):
            row = adjusted_logits(row, params, list(c[:prompt_len]), list(c[prompt_len:]), None)
            out[c] = reference_probs(row, params.temperature, params.top_k, params.top_p)
            if params.min_p:  # after temperature, before top-k and top-p (here: off)
                assert params.top_k == 0 and params.top_p == 1, "min_p with top-k or top-p is not stated here"
                out[c] = min_p_filter(out[c], params.min_p)
    return out


def chi_square_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom) of counts against probs, over refimpl's bins."""
    obs, exp = chi_square_bins(counts, probs)
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def sample_with_sources(
    llm: LLM,
    prompt_ids: list[int],
    params: SamplingParams,
    seed_base: int,
    n: int = N_SAMPLES,
    max_tokens: int = STAT_MAX_TOKENS,
):
    """Stream n seeded samples; return, per request, (token, source of the round that emitted it,
    round number). The source comes from the per-round change of the request's own counters."""
    plist = [
        params.model_copy(update={"seed": seed_base + i, "max_tokens": max_tokens, "ignore_eos": True})
        for i in range(n)
    ]
    tokens: dict[str, list[tuple[int, str, int]]] = defaultdict(list)
    last: dict[str, tuple[int, int, int]] = {}
    for out in llm.generate_stream([prompt_ids] * n, plist):
        m = out.metrics
        now = (m["rounds"], m.get("backup_neural_rounds", 0), m.get("backup_fast_rounds", 0))  # none: no ssd round yet
        before = last.get(out.request_id, (0, 0, 0))
        assert now[0] == before[0] + 1, (before, now)
        source = "neural" if now[1] > before[1] else "fast" if now[2] > before[2] else "cache"
        last[out.request_id] = now
        tokens[out.request_id].extend((t, source, now[0]) for t in out.delta_token_ids)
    assert len(tokens) == n and all(len(v) == max_tokens for v in tokens.values())
    return list(tokens.values())


def check_conditionals(target, prompt_ids, samples, params: SamplingParams, min_count: int = 20) -> dict:
    """For each subset of emitted tokens (by source of their round, later rounds only, and all),
    group by the context they were emitted after and combine the chi-square tests of every
    context with enough samples into one. -> {subset: (p value, tokens tested, df)}"""
    groups: dict[str, dict[tuple[int, ...], Counter]] = defaultdict(lambda: defaultdict(Counter))
    for sample in samples:
        context = tuple(prompt_ids)
        for tok, source, rnd in sample:
            groups["all"][context][tok] += 1
            if rnd >= 2:
                groups[f"{source}_later"][context][tok] += 1
            context = context + (tok,)
    contexts = {c for g in groups.values() for c, counts in g.items() if sum(counts.values()) >= min_count}
    exact = exact_next(target, sorted(contexts), params, len(prompt_ids))
    vocab = target.config.vocab_size
    result = {}
    for name, g in groups.items():
        stat, df, tested = 0.0, 0, 0
        for context, counts in g.items():
            total = sum(counts.values())
            if total < min_count:
                continue
            arr = np.zeros(vocab)
            for t, c in counts.items():
                arr[t] = c
            s, d = chi_square_stat(arr, exact[context])
            stat, df, tested = stat + s, df + d, tested + total
        result[name] = (float(chi2.sf(stat, df)) if df > 0 else 1.0, tested, df)
    return result
