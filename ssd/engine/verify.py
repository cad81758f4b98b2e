"""Verification of a speculation by the target: the lossless rejection-sampling rule.

Glossary (b = batch, K = speculation length this round, V = vocab):
    draft_tokens      # [b, K]      the speculation
    draft_probs       # [b, K, V]   the distribution each draft token was sampled from (after
                      #             temperature/top-k/top-p and, for Saguaro, the C-scaling);
                      #             a deterministic proposer (n-gram, random) passes one-hot rows;
                      #             None where every row's target is greedy (see below)
    target_probs      # [b, K+1, V] processed target distributions at the K+1 positions
    num_draft         # [b]         how many of the K tokens are real for each row (<= K)
    accept_uniforms   # [b, K]      u_i in [0, 1)
    bonus_uniforms    # [b]         u in [0, 1)
Returns num_accepted [b] (0..num_draft) and bonus_tokens [b].

Token i is accepted iff u_i * draft_prob < target_prob (that is u_i < target/draft, and always
when draft_prob is 0 but target_prob is not). At the first rejection, after j accepted tokens, the
bonus token comes from norm(max(0, target_probs[j] - draft_probs[j])); after num_draft acceptances it comes from
target_probs[num_draft]. This makes every emitted token exactly target-distributed.

A greedy target (one-hot target_probs) reads no draft probability: a token is accepted iff it is
the target's argmax, and the bonus token is the argmax, whatever the draft's distribution. So
draft_probs may be None when every row is greedy, read as all zeros: a speculation then carries
no [b, K, V] tensor to the target (at V = 128k and b = 8, 24 MB a round).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd.core.sampling import BatchSampling, process_logits_on_device, sample_from, sample_on_device


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: torch.Tensor  # [b] long
    bonus_tokens: torch.Tensor  # [b] long


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    num_draft: torch.Tensor,
    accept_uniforms: torch.Tensor,
    bonus_uniforms: torch.Tensor,
    sample=sample_from,
) -> VerifyResult:
    """The rule, vectorized. `sample` draws the bonus tokens: the host's sampler by default (it
    repairs a rounding miss only where one happened); verify_on_device passes the device's."""
    b, k_max = draft_tokens.shape
    assert target_probs.shape[:2] == (b, k_max + 1), (target_probs.shape, draft_tokens.shape)
    if k_max == 0:
        zero = torch.zeros(b, dtype=torch.long, device=target_probs.device)
        return VerifyResult(zero, sample(target_probs[:, 0], bonus_uniforms))
    index = draft_tokens.unsqueeze(-1)
    target_tok = target_probs[:, :k_max].gather(-1, index).squeeze(-1)  # [b, K]
    if draft_probs is None:  # every row's target is greedy (module doc): read as zeros
        draft_probs = target_probs.new_zeros(()).expand(b, k_max, target_probs.shape[-1])
    draft_tok = draft_probs.gather(-1, index).squeeze(-1)  # [b, K]
    in_spec = torch.arange(k_max, device=num_draft.device).unsqueeze(0) < num_draft.unsqueeze(1)  # [b, K]
    accepted = (accept_uniforms * draft_tok < target_tok) & in_spec
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [b]

    rows = torch.arange(b, device=num_accepted.device)
    at_k = target_probs[rows, num_accepted]  # [b, V]
    rejected = num_accepted < num_draft
    draft_at_k = draft_probs[rows, num_accepted.clamp(max=k_max - 1)]  # [b, V]
    residual = (at_k - draft_at_k).clamp_(min=0)
    # A residual with no mass can only come from rounding when target == draft; the rejection
    # it follows has probability ~0, and the target distribution is then the right fallback.
    has_mass = residual.sum(-1, keepdim=True) > 0
    residual = torch.where(has_mass, residual, at_k)
    bonus_dist = torch.where(rejected.unsqueeze(-1), residual, at_k)
    return VerifyResult(num_accepted, sample(bonus_dist, bonus_uniforms))


def verify_on_device(*args: torch.Tensor) -> VerifyResult:
    """verify without host reads (static shapes, every tensor on one device): what a round on an
    accelerator runs before its one copy of the counts and tokens to the host. A bonus token of -1
    means a distribution without positive mass (see sample_on_device)."""
    return verify(*args, sample=sample_on_device)


def verify_reference(
    draft_tokens, draft_probs, target_probs, num_draft, accept_uniforms, bonus_uniforms
) -> VerifyResult:
    """Row-by-row, position-by-position statement of the same rule, for tests."""
    b = draft_tokens.shape[0]
    if draft_probs is None:
        draft_probs = torch.zeros(b, draft_tokens.shape[1], target_probs.shape[-1])
    num_accepted, bonus = [], []
    for r in range(b):
        accepted = 0
        dist = None
        while accepted < int(num_draft[r]):
            tok = int(draft_tokens[r, accepted])
            p = float(target_probs[r, accepted, tok])
            q = float(draft_probs[r, accepted, tok])
            if q == 0.0 and p > 0.0 or q > 0.0 and float(accept_uniforms[r, accepted]) < p / q:
                accepted += 1
                continue
            resid = (target_probs[r, accepted] - draft_probs[r, accepted]).clamp(min=0)
            dist = resid if float(resid.sum()) > 0 else target_probs[r, accepted]
            break
        if dist is None:
            dist = target_probs[r, accepted]
        cdf = torch.cumsum(dist, 0)
        u = float(bonus_uniforms[r]) * float(cdf[-1])
        tok = next(i for i in range(len(cdf)) if float(cdf[i]) > u)
        num_accepted.append(accepted)
        bonus.append(tok)
    return VerifyResult(torch.tensor(num_accepted), torch.tensor(bonus))


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor, num_draft: torch.Tensor):
    """verify for a batch whose rows are all greedy and unprocessed, from the target's logits [b,
    K+1, V] on any device: its one-hot target_probs accept a token iff it is the argmax and draw
    the argmax as the bonus token, whatever draft_probs are. Same result, a handful of
    operations instead of process_logits' one-hot rows and the rule's two dozen (on a device, two
    kernels instead of a vocabulary sort and softmaxes; on a CPU at batch 1, where each operation
    costs microseconds, about 0.1 ms a round)."""
    k_max = draft_tokens.shape[1]
    best = target_logits.argmax(-1)  # [b, K+1]: the index process_logits' one-hot rows put their mass at
    in_spec = torch.arange(k_max, device=num_draft.device).unsqueeze(0) < num_draft.unsqueeze(1)  # [b, K]
    num_accepted = ((draft_tokens == best[:, :k_max]) & in_spec).long().cumprod(-1).sum(-1)  # [b]
    return VerifyResult(num_accepted, best.gather(1, num_accepted.unsqueeze(1)).squeeze(1))


def verify_step(how: str, target, drafted, num_draft, uniforms, draft_probs, temperature=None, top_k=None, top_p=None):
    """A device round's verification after the target's forward, as one capturable step
    (ssd/model/step_graphs.py). how: "greedy" (target: the logits [b, K+1, V] of a batch whose
    rows are all greedy), "logits" (target: logits, processed here with the rows' temperature,
    top_k and top_p [b] and nothing else) or "probs" (target: processed probs [b, K+1, V]).
    drafted [b, K] (-1: a draft from a distribution without mass), num_draft [b], uniforms
    [b, K+1], draft_probs [b, K, V] or None.
    -> ([b, 3] long: accepted count, bonus token (-1: no mass), 1 where a draft was -1,)."""
    in_spec = torch.arange(drafted.shape[1], device=drafted.device).unsqueeze(0) < num_draft.unsqueeze(1)
    broken = ((drafted < 0) & in_spec).any(1)
    drafted = drafted.clamp(min=0)
    if how == "greedy":
        result = verify_greedy(drafted, target, num_draft)
    else:
        if how == "logits":
            target = process_logits_on_device(target, BatchSampling(temperature, top_k, top_p))
        result = verify_on_device(drafted, draft_probs, target, num_draft, uniforms[:, :-1], uniforms[:, -1])
    return (torch.stack([result.num_accepted, result.bonus_tokens, broken.long()], 1),)
