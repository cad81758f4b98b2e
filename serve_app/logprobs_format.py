"""Log-probabilities in OpenAI's two response shapes.

completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
              "text_offset": [...]}, one entry per token, None for the prompt's first (echo);
chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
              "bytes"}]}]}.
A token's string is the token decoded on its own; `bytes` its UTF-8 bytes (a token that is part
of a multi-byte character decodes to U+FFFD, as in vLLM).
"""

from __future__ import annotations

from ssd.core.logprobs import Logprob, TokenLogprobs

# JSON has no -Infinity: a token the processed distribution excludes (logprobs_mode processed)
# is reported at this floor, as vLLM does.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(entries: list[TokenLogprobs | None], offset: int, first: str = "") -> tuple[dict, int]:
    """-> (the completions logprobs object, the text offset after these tokens). offset: where
    the first token's text starts in the choice's text; first: the text of the prompt's first
    token, whose entry is None (echo: nothing predicts it, but it has its string and offset)."""
    tokens, chosen, top, offsets = [], [], [], []
    for entry in entries:
        offsets.append(offset)
        text = first if entry is None else entry.chosen.text
        tokens.append(text)
        chosen.append(None if entry is None else _finite(entry.chosen.logprob))
        top.append(None if entry is None else {t.text: _finite(t.logprob) for t in entry.top})
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": top, "text_offset": offsets}, offset


def _chat_one(logprob: Logprob) -> dict:
    return {"token": logprob.text, "logprob": _finite(logprob.logprob), "bytes": list(logprob.text.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprobs]) -> dict:
    return {"content": [{**_chat_one(e.chosen), "top_logprobs": [_chat_one(t) for t in e.top]} for e in entries]}
