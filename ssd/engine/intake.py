"""A request in: its prompt tokenized and checked (request_checks.py, and its grammar compiled),
then made a Sequence with its own generator, grammar matcher and logits processing, ready for
the scheduler's queue."""

from __future__ import annotations

import itertools

import torch

from ssd.core.sampling_params import SamplingParams
from ssd.core.sequence import Sequence
from ssd.engine.request_checks import check_fits, prompt_ids
from ssd.processing.bad_words import word_tokens
from ssd.processing.grammar import GrammarCompiler
from ssd.processing.request import Processing


class Intake:
    """eos: the target's end-of-sequence token (or None), which grammars end with and processing
    may suppress; seed: the engine's, which seeds the rows that bring none."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos: int | None, seed: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos = eos
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos)
        self._ids = itertools.count()
        self._seed_source = torch.Generator().manual_seed(seed)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return prompt_ids(self.tokenizer, prompt, self.vocab_size)

    def check(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Everything about a request that only the engine can check; -> the prompt's token ids."""
        ids = self.tokenize(prompt)
        check_fits(ids, params, self.max_model_len, self.vocab_size)
        if params.structured_outputs is not None:
            self.grammars.matcher(params.structured_outputs)  # compiles (and caches) the grammar, or says why not
        return ids

    def sequence(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None, k: int | None
    ) -> Sequence:
        """The request checked, as a sequence; k caps the draft tokens its rounds verify."""
        ids = self.check(prompt, params)
        if k is not None and k < 0:
            raise ValueError(f"k must be >= 0 (0 = no speculation for this request), got {k}")
        seq_id = next(self._ids)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_source))
        seq = Sequence(seq_id, request_id or str(seq_id), ids, params, torch.Generator().manual_seed(seed), k=k)
        if params.structured_outputs is not None:
            seq.matcher = self.grammars.matcher(params.structured_outputs)
            seq.grammar = params.structured_outputs.grammar_text()
            seq.grammar_eos = -1 if self.eos is None else self.eos
        words = word_tokens(self.tokenizer, params.bad_words) if params.bad_words else ()
        seq.processing = Processing.of(params, self.eos, words)
        return seq


def eos_token_id(target_model, tokenizer) -> int | None:
    """The target's end-of-sequence token: its generation config's (the first, if it lists
    several), else the tokenizer's."""
    eos = getattr(target_model.generation_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return tokenizer.eos_token_id if eos is None else eos
