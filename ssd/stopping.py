"""Appending a round's tokens to a sequence under its stop rules, and streaming text safely."""

from __future__ import annotations

from ssd.sequence import FinishReason, Sequence


class StopChecker:
    """Applies EOS, stop token ids, stop strings, max_tokens and the context length.

    Tokens of a round are appended one at a time, so a sequence ends exactly where plain
    autoregressive decoding would have ended it; later tokens of the round are dropped.
    """

    def __init__(self, tokenizer, eos_token_id: int | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def append(self, seq: Sequence, tokens: list[int]) -> int:
        """Append tokens to seq until it finishes; returns how many were appended."""
        params = seq.params
        appended = 0
        for tok in tokens:
            seq.output_ids.append(tok)
            appended += 1
            if (tok == self.eos_token_id and not params.ignore_eos) or tok in params.stop_token_ids:
                seq.finish_reason = FinishReason.STOP
            elif params.stop and self._hit_stop_string(seq):
                seq.finish_reason = FinishReason.STOP
            elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = FinishReason.LENGTH
            if seq.finished:
                break
        return appended

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self.decode(seq.output_ids)
        longest = max(len(s) for s in seq.params.stop)
        # Only the end can hold a new match: the previous token's text was already checked.
        window_start = max(0, len(text) - len(self.decode(seq.output_ids[-1:])) - longest)
        hits = [(text.find(s, window_start), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.stop_text = stop
        seq.truncated_text = text[:index]
        return True

    def text(self, seq: Sequence) -> str:
        if seq.truncated_text is not None:
            return seq.truncated_text
        return self.decode(seq.output_ids)

    def streamable_text(self, seq: Sequence, text: str) -> str:
        """The part of text that can be sent now: while running, hold back an incomplete UTF-8
        character and any tail that may still become a stop string."""
        if seq.finished:
            return text
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        for stop in seq.params.stop:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if text[end - n : end] == stop[:n]:
                    end -= n
                    break
        return text[:end]
