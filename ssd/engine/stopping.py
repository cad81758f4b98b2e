"""Appending a round's tokens to a sequence under its stop rules, and streaming text safely
(the text is decoded incrementally: ssd/core/detokenizer.py): a round's output per sequence."""

from __future__ import annotations

from ssd.core.detokenizer import IncrementalDetokenizer
from ssd.core.sequence import CompletionOutput, FinishReason, Sequence
from ssd.engine.logprob_recorder import output_logprobs


class StopChecker:
    """Applies EOS, stop token ids, stop strings, max_tokens and the context length.

    Tokens of a round are appended one at a time, so a sequence ends exactly where plain
    autoregressive decoding would have ended it; later tokens of the round are dropped.
    """

    def __init__(self, tokenizer, eos_token_id: int | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        # Ids the detokenizer may drop before decoding: the special tokens that decode to nothing
        # with skip_special_tokens (a tokenizer may list one, e.g. an unknown token, that does not).
        self.special_ids = frozenset(
            i for i in tokenizer.all_special_ids if tokenizer.decode([i], skip_special_tokens=True) == ""
        )
        # Byte-fallback pieces ("<0x00>".."<0xFF>"), if the vocabulary has them (absent ones map
        # to the unknown token, or to None).
        pieces = (tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256))
        self.byte_piece_ids = frozenset(i for i in pieces if i is not None and i != tokenizer.unk_token_id)

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

    def finish_at_length(self, seq: Sequence) -> None:
        """A request with max_tokens 0 ends at its prompt (it was only scored)."""
        assert seq.params.max_tokens == 0 and not seq.output_ids
        seq.finish_reason = FinishReason.LENGTH

    def detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, self.special_ids, self.byte_piece_ids)
        return seq.detokenizer

    def _hit_stop_string(self, seq: Sequence) -> bool:
        detok = self.detokenizer(seq)
        changed_from = detok.update(seq.output_ids)
        # Text before changed_from was checked when it was decoded: a new match ends past it.
        start = max(0, changed_from - max(len(s) for s in seq.params.stop) + 1)
        window = detok.text[start:] + detok.tail
        hits = [(window.find(s), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.stop_text = stop
        end = start + index + (len(stop) if seq.params.include_stop_str_in_output else 0)
        seq.truncated_text = detok.full_text()[:end]
        return True

    def text(self, seq: Sequence) -> str:
        """The output text so far: tokenizer.decode(output_ids, skip_special_tokens=True), cut
        before the stop string that ended the sequence, if one did."""
        if seq.truncated_text is not None:
            return seq.truncated_text
        detok = self.detokenizer(seq)
        detok.update(seq.output_ids)
        return detok.full_text()

    def streamable_end(self, seq: Sequence, text: str) -> int:
        """How much of text (the output text so far) can be sent now: while running, hold back
        an incomplete UTF-8 character and any tail that may still become a stop string."""
        if seq.finished:
            return len(text)
        end = min(len(text), self.detokenizer(seq).settled_len())
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        for stop in seq.params.stop:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if text[end - n : end] == stop[:n]:
                    end -= n
                    break
        return end

    def output(self, seq: Sequence) -> CompletionOutput:
        """What a round sends for a sequence that progressed: its text and tokens so far, and what is
        new since the last output (text held back as streamable_end says)."""
        text = self.text(seq)  # incremental: no full decode per round
        sendable_end = self.streamable_end(seq, text)
        delta_text = text[seq.sent_text : sendable_end] if sendable_end > seq.sent_text else ""
        delta_tokens = seq.output_ids[seq.sent_tokens :]
        logprobs, delta_logprobs = output_logprobs(seq, seq.sent_tokens)
        seq.sent_text = max(seq.sent_text, sendable_end)
        seq.sent_tokens = len(seq.output_ids)
        return CompletionOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_ids,
            token_ids=list(seq.output_ids),
            text=text,
            finish_reason=seq.finish_reason.value if seq.finished else None,
            metrics=seq.metrics.as_dict(),
            delta_token_ids=delta_tokens,
            delta_text=delta_text,
            logprobs=logprobs,
            delta_logprobs=delta_logprobs,
            prompt_logprobs=seq.prompt_logprobs,
        )
