"""Turning logits into the distributions that drafting and verification use.

Glossary (shapes per round, b = batch, n = positions scored, V = vocab):
    logits          # [b, n, V] raw model outputs (float32)
    probs           # [b, n, V] processed distribution: the rows' adjustments (penalties, bias,
                    #   masks: ssd/processing/), then the shaping: temperature, min_p, top-k, top-p.
                    #   Greedy rows (temperature 0) are one-hot on the argmax, so the general
                    #   acceptance rule reduces to "accept while equal to the argmax".
    uniforms        # [b, n] in [0, 1): every random choice is an inverse-CDF lookup of a
                    #   uniform drawn from the sequence's own generator, so runs are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ssd.core.transfer import to_device
from ssd.processing.adjustments import Adjustments
from ssd.processing.draft_adjustments import DraftAdjustments
from ssd.processing.request import Processing

if TYPE_CHECKING:
    from ssd.processing.host_draft_adjustments import HostDraftAdjustments


@dataclass(frozen=True)
class SequenceSampling:
    """One sequence's sampling settings, as every role that samples for it needs them (the
    engine, the SD proposer, the SSD drafter; the draft protocol carries them to workers)."""

    temperature: float  # 0 = greedy
    top_k: int  # 0 = disabled
    top_p: float  # 1 = disabled
    # The request's grammar as llguidance's text ("" = none), for a drafter that masks its
    # speculations with it (tree_drafter.py): it governs the output (the tokens from index
    # output_from on) and ends with token grammar_eos (-1 = none). Verification never reads it:
    # the target's masks are the engine's own (grammar.py).
    grammar: str = ""
    output_from: int = 0
    grammar_eos: int = -1
    # Penalties, bias, allowed tokens, min_tokens, min_p and bad words, for a drafter that
    # processes its speculations as verification will (ssd/drafting/tree_adjustments.py).
    processing: Processing = field(default_factory=Processing)

    @classmethod
    def of(cls, params) -> "SequenceSampling":
        """From a request's SamplingParams."""
        return cls(params.temperature, params.top_k, params.top_p)

    @property
    def greedy(self) -> bool:
        """As SamplingParams.greedy (a temperature below its epsilon is stored as 0)."""
        return self.temperature == 0


@dataclass(frozen=True)
class BatchSampling:
    """Per-row sampling settings of one batch, as tensors."""

    temperature: torch.Tensor  # [b] float, 0 = greedy
    top_k: torch.Tensor  # [b] long, 0 = disabled
    top_p: torch.Tensor  # [b] float, 1 = disabled
    # The rows' adjustments (ssd/processing/): the exact form for verification, the draft form
    # for a draft's position (HostDraftAdjustments on the host); None when no row has any (the
    # common case costs nothing).
    adjust: Adjustments | DraftAdjustments | HostDraftAdjustments | None = None

    @classmethod
    def of(cls, rows: list[SequenceSampling]) -> "BatchSampling":
        return cls(
            torch.tensor([r.temperature for r in rows], dtype=torch.float32),
            torch.tensor([r.top_k for r in rows], dtype=torch.long),
            torch.tensor([r.top_p for r in rows], dtype=torch.float32),
        )

    def to(self, device: torch.device) -> "BatchSampling":
        adjust = self.adjust.to(device) if self.adjust is not None else None
        return BatchSampling(*(to_device(t, device) for t in (self.temperature, self.top_k, self.top_p)), adjust)

    def adjusted(self, adjust: Adjustments | DraftAdjustments | HostDraftAdjustments | None) -> "BatchSampling":
        return replace(self, adjust=adjust)

    @property
    def greedy(self) -> torch.Tensor:  # [b] bool
        return self.temperature == 0


def sampling_tensors(sampling: BatchSampling) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_k, top_p) [b]: what a captured device step (ssd/model/step_graphs.py)
    takes in place of a BatchSampling without adjustments."""
    assert sampling.adjust is None, "adjustments are not a captured step's input"
    return sampling.temperature, sampling.top_k, sampling.top_p


def process_logits(logits: torch.Tensor, sampling: BatchSampling, in_place: bool = False) -> torch.Tensor:
    """logits [b, n, V] -> probs [b, n, V] (float32), rows processed with their own settings.
    in_place: the caller gives the logits up, and the adjustments write into them
    (Adjustments.apply); otherwise they are left as they were."""
    logits = logits.float() if sampling.adjust is None else sampling.adjust.apply(logits, in_place)
    b, n, vocab = logits.shape
    greedy = sampling.greedy
    if bool(greedy.all()):  # the common greedy batch: skip the softmax whose rows would be replaced
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    temperature = torch.where(greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    # Shift each row's max to 0 before dividing: scaled logits are then <= 0 with the max at
    # exactly 0, so no temperature > 0 can overflow them to inf (whose softmax is nan); a tiny
    # one gives the one-hot limit. Softmax and top-k/top-p are shift-invariant.
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature.view(b, 1, 1)  # [b, n, V], <= 0
    if sampling.adjust is not None:
        scaled = sampling.adjust.min_p_filtered(scaled)

    needs_filter = (~greedy) & ((sampling.top_k > 0) | (sampling.top_p < 1))
    if bool(needs_filter.any()):
        top_k = torch.where(
            sampling.top_k > 0, sampling.top_k.clamp(max=vocab), torch.full_like(sampling.top_k, vocab)
        )  # [b]
        nucleus = needs_filter & (sampling.top_p < 1)  # [b]: rows that need the sorted prefix
        # Top-k keeps every token at least as large as the k-th largest (ties with it included,
        # as Hugging Face's top-k does): a rule of the row's own values, whatever its batch mates
        # ask for and however a sort orders equal values.
        if not bool(nucleus.any()):
            # Top-k alone needs only the k-th largest value: topk over max(k) finds it without
            # sorting the vocabulary, which at V = 128k was most of a drafter's time.
            width = int(top_k[needs_filter].max())
            values = scaled.topk(width, dim=-1).values  # [b, n, width], descending
            kth = values.gather(-1, (top_k.clamp(max=width) - 1).view(b, 1, 1).expand(b, n, 1))  # [b, n, 1]
            drop = scaled < kth
        else:
            sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [b, n, V]
            kth = sorted_logits.gather(-1, (top_k - 1).view(b, 1, 1).expand(b, n, 1))  # [b, n, 1]
            drop_sorted = sorted_logits < kth
            sorted_probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            drop_sorted |= (mass_before >= sampling.top_p.view(b, 1, 1)) & nucleus.view(b, 1, 1)
            drop_sorted[..., 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        drop &= needs_filter.view(b, 1, 1)  # rows that filter nothing keep every token
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = scaled.softmax(-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.view(b, 1, 1), one_hot, probs)
    return probs


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor, one_hot: bool = False) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V] (need not be normalized), uniforms [...] -> ids [...].
    one_hot=True promises every row is one-hot (a greedy batch): the draw is then its argmax,
    which is what the inverse CDF returns for any uniform, without the cumulative sum."""
    if one_hot:
        return probs.argmax(-1)
    vocab = probs.shape[-1]
    cdf = probs.cumsum(-1)
    threshold = (uniforms * cdf[..., -1]).unsqueeze(-1)
    # First index whose cumulative mass exceeds u * total: in exact arithmetic a token of
    # positive mass. Rounding can break that (u * total rounding up to the total, or a blocked
    # cumsum on an accelerator), and the search or the clamp then lands on a zero-mass token.
    ids = torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp_(max=vocab - 1)  # [...]
    picked = probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [...]
    if bool((picked > 0).all()):
        return ids
    # Invariant restored: step back to the last positive-mass token at or before the search's.
    positions = torch.arange(vocab, device=probs.device).expand_as(probs)
    last_positive = torch.where(probs > 0, positions, -1).cummax(-1).values  # [..., V], -1 = none yet
    ids = last_positive.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    if bool((ids < 0).any()):
        raise RuntimeError(
            "a sampling distribution has no positive mass (non-finite or all-zero probabilities), usually because "
            "the model produced non-finite logits: load it in a wider dtype (dtype='float32')"
        )
    return ids


def no_mass(role: str, option: str) -> RuntimeError:
    """The error of a device round whose `role` ("draft" or "target") drew from a distribution
    without positive mass (sample_on_device's -1), as the host's sampler raises it."""
    return RuntimeError(
        f"a {role} distribution has no positive mass (non-finite logits): load the {role} in a wider dtype "
        f"({option}='float32')"
    )


# ---- the same rules as device functions ---------------------------------------------------------
# process_logits and sample_from branch on the batch (a greedy batch skips the softmax, top-k alone
# skips the sort, a rounding miss is repaired only where it happened): each branch reads a device
# value on the host. The versions below compute every case and select with torch.where: static
# shapes, no host reads, so a round on an accelerator can run them without waiting for the device
# (and under a CUDA graph). They equal the host versions (tests/test_device_round.py); on
# CPU the host versions are faster (a vocabulary sort per call is what they skip).


def process_logits_on_device(logits: torch.Tensor, sampling: BatchSampling, in_place: bool = False) -> torch.Tensor:
    """process_logits without host reads: logits [b, n, V] -> probs [b, n, V] (float32).
    `sampling`'s tensors must be on the logits' device; in_place as in process_logits."""
    logits = logits.float() if sampling.adjust is None else sampling.adjust.apply(logits, in_place)
    b, n, vocab = logits.shape
    greedy = sampling.greedy.view(b, 1, 1)
    temperature = torch.where(sampling.temperature > 0, sampling.temperature, 1.0).view(b, 1, 1)
    scaled = (logits - logits.amax(-1, keepdim=True)) / temperature  # [b, n, V], <= 0 (see process_logits)
    if sampling.adjust is not None:
        scaled = sampling.adjust.min_p_filtered(scaled)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [b, n, V]
    top_k = torch.where(sampling.top_k > 0, sampling.top_k.clamp(max=vocab), vocab)  # [b]
    kth = sorted_logits.gather(-1, (top_k - 1).view(b, 1, 1).expand(b, n, 1))  # [b, n, 1]
    drop_sorted = sorted_logits < kth  # top-k, ties with the k-th kept; nothing when k = V
    sorted_probs = sorted_logits.masked_fill(drop_sorted, float("-inf")).softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    nucleus = (sampling.top_p < 1).view(b, 1, 1)
    drop_sorted = drop_sorted | ((mass_before >= sampling.top_p.view(b, 1, 1)) & nucleus)
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    probs = scaled.masked_fill(drop, float("-inf")).softmax(-1)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def sample_on_device(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """sample_from without host reads: probs [..., V], uniforms [...] -> ids [...]. A row with no
    positive mass gives -1 (sample_from raises there): whoever copies the ids to the host checks."""
    vocab = probs.shape[-1]
    cdf = probs.cumsum(-1)
    threshold = (uniforms * cdf[..., -1]).unsqueeze(-1)
    ids = torch.searchsorted(cdf, threshold, right=True).clamp_(max=vocab - 1)  # [..., 1]
    picked = probs.gather(-1, ids)
    positions = torch.arange(vocab, device=probs.device).expand_as(probs)
    last_positive = torch.where(probs > 0, positions, -1).cummax(-1).values  # [..., V], -1 = none yet
    return torch.where(picked > 0, ids, last_positive.gather(-1, ids)).squeeze(-1)
