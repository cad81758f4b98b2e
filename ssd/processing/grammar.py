"""Grammar matchers and the token masks they give, for structured output (structured.py).

The grammar engine is llguidance (docs/structured-output.md says why): a matcher follows one
sequence's committed output; `grammar_masks` walks it along a speculation, one mask per position,
and rolls it back, so every draft position is masked with that position's own history, as
verification needs for the masked target distribution to be the one sampled from.

Glossary (b = batch, n = positions, V = the target's vocabulary):
    matcher   # llguidance.LLMatcher, one per constrained sequence, at its committed output
    allowed   # [b, n, V] bool: position i's tokens the grammar permits after drafted[:, :i]
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from ssd.processing.structured import StructuredOutputs

# Compiled grammars kept per process (a template matcher each, copied per request): a schema
# a client sends with every request compiles once.
GRAMMAR_CACHE_SIZE = 128


class GrammarCompiler:
    """Turns a request's StructuredOutputs into a matcher for one tokenizer. Grammars are
    validated and compiled once (llguidance's parser limits bound the work) and cached; an invalid
    one raises ValueError naming the field and llguidance's reason."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._tokenizer = None  # llguidance's view of the tokenizer: ~1 s at 128k, built on first use
        self._templates: OrderedDict[str, object] = OrderedDict()
        # A served engine checks requests on the caller's thread and adds them on its loop's.
        self._lock = threading.Lock()

    def _lltokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id
                )
            except ValueError as exc:  # a slow (Python) tokenizer: llguidance reads fast ones only
                raise ValueError(f"structured_outputs needs a fast Hugging Face tokenizer: {exc}") from exc
        return self._tokenizer

    def matcher(self, constraint: StructuredOutputs):
        """A fresh matcher (at the start of the output) for the constraint."""
        try:
            text = constraint.grammar_text()
        except ValueError as exc:
            raise ValueError(f"structured_outputs.{constraint.kind}: {exc}") from exc
        return self.from_text(text, constraint.kind)

    def from_text(self, text: str, kind: str = "grammar"):
        """A fresh matcher for a grammar already in llguidance's text (a drafter's, as the draft
        protocol carries it)."""
        with self._lock:
            return self._compiled(text, kind).deep_copy()

    def _compiled(self, text: str, kind: str):
        from llguidance import LLMatcher, LLParserLimits

        template = self._templates.get(text)
        if template is None:
            limits = LLParserLimits(verbose_errors=False)
            is_error, messages = LLMatcher.validate_grammar_with_warnings(text, self._lltokenizer(), limits=limits)
            if is_error:
                raise ValueError(f"structured_outputs.{kind} is not a grammar we can follow: {messages[0]}")
            template = LLMatcher(self._lltokenizer(), text, log_level=0, limits=limits)
            if template.is_error():
                raise ValueError(f"structured_outputs.{kind}: {template.get_error()}")
            self._templates[text] = template
            while len(self._templates) > GRAMMAR_CACHE_SIZE:
                self._templates.popitem(last=False)
        self._templates.move_to_end(text)
        return template


def consume(matcher, tokens: list[int]) -> None:
    """Advance a sequence's matcher over tokens committed to its output (each was drawn from a
    masked distribution, so the grammar permits it)."""
    for token in tokens:  # one at a time: llguidance's consume_tokens refuses the EOS that ends a grammar
        if not matcher.consume_token(token):
            raise AssertionError(f"committed token {token} broke the grammar: {matcher.get_error()}")


def grammar_masks(matchers: list, drafted: torch.Tensor, vocab: int, last_only: bool = False) -> torch.Tensor:
    """matchers: per row a matcher at the row's committed output, or None (unconstrained);
    drafted [b, j] -> allowed [b, j + 1, V] (or [b, 1, V], the last position's, with last_only).

    A position after a draft token the grammar refuses allows everything: verification rejects
    that token (its masked target probability is 0), so no later position is ever read. Each
    matcher is left where it was."""
    from llguidance.torch import fill_next_token_bitmask

    b, j = drafted.shape
    n = 1 if last_only else j + 1
    words = (vocab + 31) // 32
    bits = torch.full((b * n, words), -1, dtype=torch.int32)
    rows = drafted.tolist()
    for r, matcher in enumerate(matchers):
        if matcher is None:
            continue
        walked = 0
        for i in range(j + 1):
            if i > 0:
                if matcher.validate_tokens(rows[r][i - 1 : i]) != 1:
                    break
                matcher.consume_token(rows[r][i - 1])
                walked += 1
            if not last_only or i == j:
                fill_next_token_bitmask(matcher, bits, r * n + (0 if last_only else i))
        if walked:
            matcher.rollback(walked)
    # A position with nothing allowed (past a finished grammar's EOS, never committed) would make
    # a distribution of NaNs; allow everything there instead.
    bits[(bits == 0).all(-1)] = -1
    return unpack(bits, vocab).view(b, n, vocab)


def unpack(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """bits [r, ceil(V / 32)] int32 (llguidance's bitmask) -> [r, V] bool."""
    # Little-endian words: byte k holds tokens 8k .. 8k + 7, lowest bit first. numpy's unpackbits
    # is ~10x faster here than a torch lookup table (7 masks x 8 rows at V = 128k: 7 M tokens).
    flat = np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little")  # [r, 32 * words] of 0/1
    return torch.from_numpy(flat[:, :vocab]).view(torch.bool)
