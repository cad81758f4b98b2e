"""A drafter's grammars: its speculations follow each constrained sequence's grammar, as the
target's verification does, so that they are accepted (structured output, forced tool calls).

The target bonus token after j accepted ones is drawn from the *masked* target distribution,
so only tokens the grammar allows after s_T[:j] can be bonuses: the fork ranks its candidates
among those (`fork_masks`). Each branch of the tree then drafts from its own matcher, a copy
walked along s_T[:j] and the branch's candidate, advanced by each token the branch draws
(`Branches`). The neural backup drafts a miss's speculation under the grammar too
(draft_processing.first_position). Exactness never depends on any of this: verification uses the draft
probabilities the drafter reports, masked or not, and the engine's own masks.

A drafter compiles a grammar from llguidance's text (SequenceSampling.grammar) with the
target's tokenizer, loaded on first use. Where that tokenizer cannot be loaded the drafter says
so in its log once and drafts unmasked (still exact, accepted less often).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ssd.core.sampling import SequenceSampling
from ssd.processing.grammar import GrammarCompiler, unpack

logger = logging.getLogger(__name__)


class DraftGrammars:
    """Per constrained sequence, a matcher at the end of its committed tokens."""

    def __init__(self, tokenizer: Callable[[], object] | None, vocab: int) -> None:
        self._tokenizer, self.vocab = tokenizer, vocab
        self._compilers: dict[int, GrammarCompiler] = {}  # by EOS id
        self._loaded = None  # the tokenizer once loaded; False when it could not be
        self.matchers: dict[int, object] = {}

    def _compiler(self, eos: int) -> GrammarCompiler | None:
        if self._loaded is None:
            try:
                self._loaded = self._tokenizer() if self._tokenizer is not None else False
            except (OSError, ValueError) as err:
                logger.warning("no tokenizer for grammars (%s): speculations of constrained requests are unmasked", err)
                self._loaded = False
        if self._loaded is False:
            return None
        if eos not in self._compilers:
            self._compilers[eos] = GrammarCompiler(self._loaded, self.vocab, None if eos < 0 else eos)
        return self._compilers[eos]

    def admit(self, seq_id: int, sampling: SequenceSampling, tokens: list[int]) -> None:
        """tokens: the sequence's committed tokens (its output from sampling.output_from on)."""
        if not sampling.grammar:
            return
        compiler = self._compiler(sampling.grammar_eos)
        if compiler is None:
            return
        try:
            matcher = compiler.from_text(sampling.grammar)
        except ValueError as err:  # the engine compiled it; a tokenizer here that cannot is ours to log
            logger.warning("the drafter cannot follow a request's grammar (%s): its speculations are unmasked", err)
            return
        self.matchers[seq_id] = matcher
        self.commit(seq_id, tokens[sampling.output_from :])

    def commit(self, seq_id: int, tokens: list[int]) -> None:
        """The sequence committed tokens (each one the engine's masked target allowed)."""
        matcher = self.matchers.get(seq_id)
        if matcher is None:
            return
        for token in tokens:
            if matcher.is_stopped():  # past the grammar's EOS: the sequence ends (its output stops there)
                return
            if not matcher.consume_token(token):  # the engine's grammar differs from ours: stop masking
                logger.warning("a committed token broke the drafter's grammar: %s", matcher.get_error())
                del self.matchers[seq_id]
                return

    def release(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def any(self, seq_ids: list[int]) -> bool:
        return any(s in self.matchers for s in seq_ids)

    def spines(self, seq_ids: list[int], spec: list[list[int]]) -> list[list]:
        """Per row, its matcher after s_T[:j] for j = 0, 1, ... as far as the grammar allows s_T
        ([] for an unconstrained row). Walked once a round: the fork's masks and every branch's
        matcher start from these (a consume is the costly step)."""
        out = []
        for s, tokens in zip(seq_ids, spec):
            base = self.matchers.get(s)
            spine, matcher = ([base], base.deep_copy()) if base is not None else ([], None)
            for token in tokens if base is not None else []:
                if matcher.is_stopped() or not matcher.consume_token(token):  # refused, or past EOS
                    break
                spine.append(matcher.deep_copy())
            out.append(spine)
        return out

    def fork_masks(self, spines: list[list], positions: int) -> torch.Tensor:
        """-> [b, positions, V] bool: the tokens allowed after s_T[:j]; everything where the row
        is unconstrained or past what its grammar allows of s_T (never forked: verification
        stops at the refused token)."""
        from llguidance.torch import fill_next_token_bitmask

        bits = torch.full((len(spines) * positions, (self.vocab + 31) // 32), -1, dtype=torch.int32)
        for r, spine in enumerate(spines):
            for accepted, matcher in enumerate(spine[:positions]):
                fill_next_token_bitmask(matcher, bits, r * positions + accepted)
        bits[(bits == 0).all(-1)] = -1  # a finished grammar (past EOS): nothing to follow
        return unpack(bits, self.vocab).view(len(spines), positions, self.vocab)

    def branches(self, spines: list[list], cand, outcome, allowed: torch.Tensor) -> "Branches":
        """The tree's branch matchers: cand, outcome [b, N] (this shard's); allowed: fork_masks'."""
        return Branches(self.vocab, spines, cand, outcome, allowed)


class Branches:
    """One matcher per tree branch of each constrained row, at the branch's end."""

    def __init__(
        self,
        vocab: int,
        spines: list[list],
        cand: torch.Tensor,
        outcome: torch.Tensor,
        allowed: torch.Tensor,
    ) -> None:
        """spines: DraftGrammars.spines; cand, outcome [b, N]: each branch's candidate and the
        accepted count it follows; allowed [b, K + 1, V]: the fork's masks."""
        self.vocab = vocab
        self.shape = tuple(cand.shape)  # (b, N)
        self.matchers: list[object | None] = []  # row-major [b * N]; None: unconstrained, or off the grammar
        cands, outcomes = cand.tolist(), outcome.tolist()
        for r, spine in enumerate(spines):
            for c, accepted in zip(cands[r], outcomes[r]):
                # A candidate the grammar refuses (fewer tokens allowed than the fan-out) can
                # never be the bonus: its branch stays unmasked, and no consume fails on it
                # (a failing consume is llguidance's slow path).
                ok = accepted < len(spine) and bool(allowed[r, accepted, c])
                self.matchers.append(_walked(spine[accepted], [c]) if ok else None)

    def masks(self) -> torch.Tensor:
        """[b, N, V] bool: what each branch's next token may be (all True where unconstrained)."""
        from llguidance.torch import fill_next_token_bitmask

        bits = torch.full((len(self.matchers), (self.vocab + 31) // 32), -1, dtype=torch.int32)
        for i, matcher in enumerate(self.matchers):
            if matcher is not None:
                fill_next_token_bitmask(matcher, bits, i)
        bits[(bits == 0).all(-1)] = -1  # a finished grammar (past EOS): nothing to follow
        return unpack(bits, self.vocab).view(*self.shape, self.vocab)

    def advance(self, tokens: torch.Tensor) -> None:
        """tokens [b, N]: each branch's drawn token."""
        for i, token in enumerate(tokens.flatten().tolist()):
            matcher = self.matchers[i]
            if matcher is not None and not matcher.consume_token(token):
                self.matchers[i] = None


def masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Draft logits [..., V_draft] with what `allowed` [..., V_target] refuses at -inf (columns
    past the target's vocabulary are dropped later, by draft_probs)."""
    if logits.shape[-1] == allowed.shape[-1]:  # one vocabulary (the common case): one pass, no copy
        return logits.masked_fill(~allowed, float("-inf"))
    v = min(logits.shape[-1], allowed.shape[-1])
    head = logits[..., :v].masked_fill(~allowed[..., :v], float("-inf"))
    return torch.cat([head, logits[..., v:]], -1)


def _walked(base, tokens: list[int]):
    """A copy of `base` after `tokens`, or None when the grammar refuses one of them (a
    candidate or a draft the target can never accept: the branch drafts unmasked)."""
    matcher = base.deep_copy()
    for token in tokens:
        if not matcher.consume_token(token):
            return None
    return matcher
