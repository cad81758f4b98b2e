"""The hand-off between a proposer (whatever drafts) and the target's verification."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ssd.core.sampling import no_mass


class Source(enum.IntEnum):
    """Where a row's speculation came from."""

    JUST_IN_TIME = 0  # ordinary SD: the draft, just in time
    CACHE = 1  # SSD: a speculation-cache hit (no drafting latency)
    NEURAL = 2  # SSD's neural backup (a miss): the draft, just in time
    FAST = 3  # SSD's fast backup (a miss): n-gram lookup / random tokens


@dataclass(frozen=True)
class Speculation:
    """K proposed tokens per running sequence and the distributions they were drawn from."""

    # [b, K] long (entries past num_draft are padding); a proposer on an accelerator leaves its
    # tokens and probs there, and marks a token drawn from a distribution without mass -1
    tokens: torch.Tensor
    # [b, K, V] float32, V = the target's vocabulary size; None where every row's target is
    # greedy, whose verification reads no draft probability (ssd/engine/verify.py)
    probs: torch.Tensor | None
    num_draft: torch.Tensor  # [b] long, real proposals per row (<= K)
    source: torch.Tensor | None = field(default=None)  # [b] long Source; None = all JUST_IN_TIME

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    def host_tokens(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens [b, K] on the host. Raises where a real draft token of `rows` [b] bool
        (default: all) is -1, as the host's sampler raises where it would have been drawn."""
        tokens = self.tokens.cpu()
        real = torch.arange(self.k).unsqueeze(0) < self.num_draft.unsqueeze(1)
        if rows is not None:
            real &= rows.unsqueeze(1)
        if bool(((tokens < 0) & real).any()):
            raise no_mass("draft", "draft_dtype")
        return tokens

    def on_host(self, rows: torch.Tensor | None = None) -> "Speculation":
        """The same speculation with its tokens (host_tokens) and probs on the host; num_draft
        and source are host tensors wherever the drafts are."""
        probs = None if self.probs is None else self.probs.cpu()
        return Speculation(self.host_tokens(rows), probs, self.num_draft, self.source)

    @staticmethod
    def empty(batch: int, vocab: int) -> "Speculation":
        return Speculation(
            torch.zeros(batch, 0, dtype=torch.long),
            torch.zeros(batch, 0, vocab),
            torch.zeros(batch, dtype=torch.long),
        )


@dataclass(frozen=True)
class RoundOutcome:
    """What verification decided, per row of the batch that was verified."""

    num_accepted: torch.Tensor  # [b] long, 0..num_draft
    bonus_tokens: torch.Tensor  # [b] long
    tokens_before: torch.Tensor  # [b] long, committed length of each row before this round


@dataclass
class SpecMetrics:
    """Speculation counters of one sequence (or, summed, of the engine)."""

    rounds: int = 0
    draft_tokens: int = 0  # speculated tokens offered to the target
    accepted_tokens: int = 0  # of which accepted
    emitted_tokens: int = 0  # accepted + bonus, before stop truncation
    # SSD only: rows served from the speculation cache, and by each backup.
    cache_hits: int = 0
    backup_neural: int = 0
    backup_fast: int = 0
    accepted_on_hit: int = 0
    # Rounds by the mode they ran in (mode auto mixes them; any other mode has one).
    ar_rounds: int = 0
    sd_rounds: int = 0
    ssd_rounds: int = 0

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per round (0..K)."""
        return self.accepted_tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted_tokens / self.rounds if self.rounds else 0.0

    def record(self, drafted: int, accepted: int, emitted: int, source: Source, mode: str = "sd") -> None:
        """One round of one sequence, run in `mode` (ar, sd, ssd), whose speculation came from
        `source`."""
        self.rounds += 1
        setattr(self, f"{mode}_rounds", getattr(self, f"{mode}_rounds") + 1)
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted
        if source == Source.CACHE:
            self.cache_hits += 1
            self.accepted_on_hit += accepted
        elif source == Source.NEURAL:
            self.backup_neural += 1
        elif source == Source.FAST:
            self.backup_fast += 1

    def add(self, other: "SpecMetrics") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        out = {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_per_round": round(self.mean_accepted, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_round": round(self.tokens_per_round, 4),
            "rounds_by_mode": {m: n for m in ("ssd", "sd", "ar") if (n := getattr(self, f"{m}_rounds"))},
        }
        ssd_rounds = self.cache_hits + self.backup_neural + self.backup_fast
        if ssd_rounds:
            misses = ssd_rounds - self.cache_hits
            out.update(
                cache_hits=self.cache_hits,
                cache_hit_rate=round(self.cache_hits / ssd_rounds, 4),
                mean_accepted_on_hit=round(self.accepted_on_hit / max(self.cache_hits, 1), 4),
                mean_accepted_on_miss=round((self.accepted_tokens - self.accepted_on_hit) / max(misses, 1), 4),
                backup_neural_rounds=self.backup_neural,
                backup_fast_rounds=self.backup_fast,
            )
        return out
