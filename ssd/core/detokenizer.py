"""Incremental detokenization: a sequence's output text, decoded as tokens arrive (as vLLM's and
TGI's detokenizers do): a few recent tokens per step, never the whole output, so stop strings and
streaming cost the same per token at any length."""

from __future__ import annotations


class IncrementalDetokenizer:
    """One sequence's output text, kept up to date from a window of recent tokens.

    Invariant: text + tail == tokenizer.decode(output_ids, skip_special_tokens=True) (checked at
    every round for byte-level and SentencePiece-style byte-fallback tokenizers in
    tests/test_stopping.py), where text (final, only ever appended to) is ids[:read_offset]
    decoded and tail (which the next token may still change) is the rest. A step decodes
    ids[prefix_offset:], i.e. the tokens of the last committed piece plus the new ones: that
    leading context gives the new tokens the text they have in the full decode (decoders such as
    SentencePiece's drop the first token's leading space), and prefix_text, the same window up
    to read_offset, is what to cut off. The new text is committed only when it grew, does not
    end in U+FFFD (the mark of a token that ends inside a multi-byte UTF-8 character) and the
    last token is not a byte-fallback piece ("<0xE2>"): a byte-fallback decoder turns a whole
    run of such pieces into U+FFFDs once one of them is invalid, so a run is committed only
    after a token that ends it. Thus read_offset sits where no later token can change the text
    before it. The window spans a few tokens, more only while a character or a run of byte
    pieces is incomplete.
    """

    def __init__(self, tokenizer, special_ids: frozenset[int], byte_piece_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.special_ids = special_ids
        self.byte_piece_ids = byte_piece_ids
        self.ids: list[int] = []  # the output ids but the special ones (which decode to nothing)
        self.seen = 0  # how many output ids, special ones included, were taken in
        self.text = ""
        self.tail = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text = ""  # ids[prefix_offset:read_offset] decoded

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, output_ids: list[int]) -> int:
        """Take in output_ids[seen:]; -> the position in text + tail from which it may differ
        from before (everything earlier is final and unchanged)."""
        changed_from = len(self.text)
        new = [t for t in output_ids[self.seen :] if t not in self.special_ids]
        self.seen = len(output_ids)
        if not new:
            return changed_from
        self.ids.extend(new)
        decoded = self._decode(self.ids[self.prefix_offset :])
        if (
            len(decoded) > len(self.prefix_text)
            and not decoded.endswith("\ufffd")
            and new[-1] not in self.byte_piece_ids
        ):
            self.text += decoded[len(self.prefix_text) :]
            self.tail = ""
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        else:
            self.tail = decoded[len(self.prefix_text) :]
        return changed_from

    def full_text(self) -> str:
        return self.text + self.tail if self.tail else self.text

    def settled_len(self) -> int:
        """How much of full_text() no later token can change: all of it but an open run of
        byte-fallback pieces (a trailing U+FFFD aside, which streaming holds back anyway)."""
        if self.tail and self.ids[-1] in self.byte_piece_ids:
            return len(self.text)
        return len(self.text) + len(self.tail)
