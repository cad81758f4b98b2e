"""What only the engine can check about a request (it knows the vocabulary and the context
length): each check raises a ValueError naming the field to change."""

from __future__ import annotations

from ssd.core.sampling_params import SamplingParams


def prompt_ids(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    """A prompt (text, or token ids) -> its token ids, none outside the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            raise ValueError("prompt must not be empty (it tokenized to no tokens)")
        return ids
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("prompt must not be empty (got an empty list of token ids)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_fits(ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> None:
    """The prompt and max_tokens within the context length; every token id params name within
    the vocabulary (SamplingParams already refused negative ones)."""
    if len(ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length "
            f"{max_model_len}: lower max_tokens to at most {max_model_len - len(ids)} or shorten the prompt"
        )
    named = (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias),
        ("allowed_token_ids", params.allowed_token_ids or []),
    )
    for name, listed in named:
        beyond = [t for t in listed if t >= vocab_size]
        if beyond:
            raise ValueError(f"{name}: token id {beyond[0]} is outside the vocabulary [0, {vocab_size})")
