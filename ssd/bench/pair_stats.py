"""Pair stats (one thread, inside a worker): single-token decode time of target and draft with a
KV cache of a ~128-token context, through the plain Hugging Face forward and through the
engine's own runners (the lean forward, the target's projections packed as the engine packs
them), their ratios, and the draft's greedy per-token acceptance along the target's greedy path
(teacher forcing) on held-out prompts, with the greedy SD rounds that path implies."""

from __future__ import annotations

import statistics
import time

PAIR_CONTEXT_TOKENS = 128  # context length of the decode-latency measurement


def _pair_stats(spec: dict) -> dict:
    """Decode times of the pair (Hugging Face's forward and the engine's) and the draft's greedy
    acceptance along the target's greedy path on the held-out prompts."""
    import torch

    from ssd.model.loader import load_model, load_tokenizer

    device = torch.device(spec["device"])
    tokenizer = load_tokenizer(spec["target"])
    target = load_model(spec["target"], spec["dtype"], spec["device"])
    draft = load_model(spec["draft"], spec["draft_dtype"], spec["device"])
    encoded = [tokenizer(p, add_special_tokens=False).input_ids for p in spec["prompts"]]
    # A ~128-token context from the prompts themselves.
    context: list[int] = []
    while len(context) < PAIR_CONTEXT_TOKENS:
        for ids in encoded:
            context.extend(ids)
    context_ids = torch.tensor([context[:PAIR_CONTEXT_TOKENS]], device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    target_ms, draft_ms = (_hf_decode_ms(m, context_ids, spec["pair_reps"], sync) for m in (target, draft))
    target_lean_ms = _engine_decode_ms(target, "target", context_ids, spec, sync)
    draft_lean_ms = _engine_decode_ms(draft, "draft", context_ids, spec, sync)
    n, k = spec["max_tokens"], spec["k"]
    # K extra path tokens: the engine drafts a full K even in the last round.
    matches = [_greedy_matches(target, draft, ids, n + k, device) for ids in encoded]  # [prompts][n + k]
    all_matches = [m for row in matches for m in row[:n]]
    accept = sum(all_matches) / len(all_matches)
    rounds, accepted = _greedy_sd(matches, n, k)
    iid = (1 - accept ** (k + 1)) / (1 - accept) if accept < 1 else float(k + 1)
    return {
        "threads": 1,
        "context_tokens": PAIR_CONTEXT_TOKENS,
        "reps": spec["pair_reps"],
        "target_decode_ms": round(target_ms, 4),
        "draft_decode_ms": round(draft_ms, 4),
        "draft_to_target_ratio": round(draft_ms / target_ms, 4),
        "target_to_draft_ratio": round(target_ms / draft_ms, 3),
        "target_decode_ms_engine": round(target_lean_ms, 4),
        "draft_decode_ms_engine": round(draft_lean_ms, 4),
        "target_to_draft_ratio_engine": round(target_lean_ms / draft_lean_ms, 3),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "greedy_acceptance": round(accept, 4),
        "greedy_acceptance_per_prompt": [round(sum(row[:n]) / n, 4) for row in matches],
        "acceptance_positions": len(all_matches),
        "k": k,
        "greedy_sd_mean_accepted_per_round": round(accepted / rounds, 4),
        "greedy_sd_tokens_per_round": round(n * len(encoded) / rounds, 4),
        "iid_tokens_per_round": round(iid, 4),
    }


def _hf_decode_ms(model, context_ids, reps: int, sync) -> float:
    """Median single-token decode time through Hugging Face's forward, over a cached context."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=context_ids, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        times = []
        for rep in range(reps + 5):
            sync()
            t0 = time.perf_counter()
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
            sync()
            if rep >= 5:  # the first few are warm-up
                times.append(time.perf_counter() - t0)
            _crop(cache, PAIR_CONTEXT_TOKENS)
    return 1000 * statistics.median(times)


def _greedy_matches(target, draft, ids: list[int], length: int, device) -> list[bool]:
    """Along the target's greedy continuation of `ids` (`length` tokens), whether the draft's
    greedy choice equals the target's at each position (teacher forcing)."""
    import torch

    with torch.inference_mode():
        out = target(input_ids=torch.tensor([ids], device=device), use_cache=True)
        path = []
        for _ in range(length):
            nxt = out.logits[:, -1:].argmax(-1)
            path.append(int(nxt))
            out = target(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
        full = torch.tensor([ids + path], device=device)
        start = len(ids) - 1  # logits at positions start.. predict the continuation
        t_arg = target(input_ids=full[:, :-1]).logits[0, start:].argmax(-1)
        d_arg = draft(input_ids=full[:, :-1]).logits[0, start:].argmax(-1)
    return (t_arg == d_arg).tolist()


def _greedy_sd(matches: list[list[bool]], n: int, k: int) -> tuple[int, int]:
    """Greedy SD simulated along each path: a round starting at p accepts the run of matches from
    p (at most K) and adds the bonus token, until n tokens are out -> (rounds, accepted tokens)."""
    rounds = accepted = 0
    for row in matches:
        p = 0
        while p < n:
            m = 0
            while m < k and row[p + m]:
                m += 1
            rounds += 1
            accepted += m
            p += m + 1
    return rounds, accepted


def _engine_decode_ms(model, role: str, context_ids, spec: dict, sync) -> float:
    """Single-token decode time through the engine's runner for this role (the lean forward
    where the model allows it; the target's projections packed as the engine packs them)."""
    import torch

    from ssd.model.runner import draft_runner, target_runner

    runner = (
        target_runner(model, spec["device"], True, True)
        if role == "target"
        else draft_runner(model, spec["device"], True)
    )
    cache = runner.new_cache()
    with torch.inference_mode():
        logits = runner.forward(cache, context_ids.cpu())
        nxt = logits[:, -1:].argmax(-1)
        times = []
        for rep in range(spec["pair_reps"] + 5):
            sync()
            t0 = time.perf_counter()
            runner.forward(cache, nxt)
            sync()
            if rep >= 5:
                times.append(time.perf_counter() - t0)
            cache.drop_last(torch.ones(1, dtype=torch.long))
    return 1000 * statistics.median(times)


def _crop(cache, length: int) -> None:
    """Cut a Hugging Face cache back to `length` tokens (a negative count to remove works in
    transformers 4 and 5; a positive length to keep only in 4)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
