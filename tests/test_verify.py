"""The verification rule (ssd/engine/verify.py) and the sampling primitives it rests on (ssd/engine/sampling.py).

1. `verify` (vectorized) equals `verify_reference` (row by row) on many random batches.
2. Hand-built cases whose outcome is known exactly.
3. Statistical losslessness, modelled on vLLM's rejection-sampler test: with draft tokens drawn from
   draft_probs, the emitted tokens follow target_probs (chi-square, fixed seeds).
process_logits and sample_from have their own tests in test_sampling_primitives.py.
"""

from __future__ import annotations

import pytest
import torch
from refimpl import chi_square_p

from ssd.core.sampling import sample_from
from ssd.engine.verify import verify, verify_greedy, verify_on_device, verify_reference

P_MIN = 1e-3  # chi-square p-value threshold (seeds are fixed, so a pass is reproducible)
ONE_MINUS = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))  # largest float32 < 1


# ---- helpers -------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Small tensors: intra-op threads only add synchronization on a busy machine. One thread for
    this module; the previous setting comes back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_dists(gen: torch.Generator, shape, kinds: torch.Tensor | None = None) -> torch.Tensor:
    """Random distributions [..., V]: per row dense, sparse (random zeros) or one-hot."""
    *lead, vocab = shape
    logits = torch.randn(shape, generator=gen) * 2.0
    probs = logits.softmax(-1)
    if kinds is None:
        kinds = torch.randint(0, 3, tuple(lead), generator=gen)
    sparse_mask = torch.rand(shape, generator=gen) < 0.5
    sparse_mask.scatter_(-1, logits.argmax(-1, keepdim=True), False)  # keep at least one entry
    sparse = probs.masked_fill(sparse_mask, 0.0)
    sparse = sparse / sparse.sum(-1, keepdim=True)
    one_hot = torch.zeros(shape).scatter_(-1, torch.randint(0, vocab, (*lead, 1), generator=gen), 1.0)
    out = torch.where((kinds == 0).unsqueeze(-1), probs, sparse)
    return torch.where((kinds == 2).unsqueeze(-1), one_hot, out)


def run_both(*args):
    fast = verify(*args)
    ref = verify_reference(*args)
    return fast, ref


def uniforms_grid(n: int) -> torch.Tensor:
    """n evenly spread uniforms in [0, 1): (i + 0.5) / n."""
    return (torch.arange(n, dtype=torch.float64) + 0.5).div(n).float()


# ---- 1. vectorized == reference ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_verify_matches_reference_on_random_batches(seed):
    gen = torch.Generator().manual_seed(seed)
    for K, vocab in [(1, 5), (3, 8), (4, 17), (6, 3), (2, 50)]:
        b = 48
        target_probs = random_dists(gen, (b, K + 1, vocab))  # [b, K+1, V]
        draft_probs = random_dists(gen, (b, K, vocab))  # [b, K, V]
        # Some rows draft with exactly the target's distribution.
        same = torch.rand(b, generator=gen) < 0.2
        draft_probs = torch.where(same.view(b, 1, 1), target_probs[:, :K], draft_probs)
        # Draft tokens mostly sampled from draft_probs, sometimes arbitrary (possibly zero-probability
        # under the draft, the target or both, as a deterministic proposer might produce).
        sampled = sample_from(draft_probs, torch.rand(b, K, generator=gen))
        arbitrary = torch.randint(0, vocab, (b, K), generator=gen)
        draft_tokens = torch.where(torch.rand(b, K, generator=gen) < 0.75, sampled, arbitrary)
        num_draft = torch.randint(0, K + 1, (b,), generator=gen)
        num_draft[:3] = torch.tensor([0, K, 0]) if K > 0 else 0
        accept_uniforms = torch.rand(b, K, generator=gen)
        bonus_uniforms = torch.rand(b, generator=gen)
        # Extreme uniforms on a few rows.
        accept_uniforms[3] = 0.0
        accept_uniforms[4] = ONE_MINUS
        bonus_uniforms[5] = 0.0
        bonus_uniforms[6] = ONE_MINUS
        fast, ref = run_both(draft_tokens, draft_probs, target_probs, num_draft, accept_uniforms, bonus_uniforms)
        assert torch.equal(fast.num_accepted, ref.num_accepted), (K, vocab)
        assert torch.equal(fast.bonus_tokens, ref.bonus_tokens), (K, vocab)
        assert bool((fast.num_accepted <= num_draft).all())
        assert bool((fast.num_accepted >= 0).all())
        # The bonus token always has positive mass in the distribution it is drawn from.
        rows = torch.arange(b)
        assert bool((target_probs[rows, fast.num_accepted, fast.bonus_tokens] > 0).all())


def test_verify_padding_past_num_draft_is_ignored():
    """Columns past num_draft (padding, garbage probabilities) never change the outcome."""
    gen = torch.Generator().manual_seed(11)
    b, K, vocab = 64, 4, 9
    target_probs = random_dists(gen, (b, K + 1, vocab))
    draft_probs = random_dists(gen, (b, K, vocab))
    draft_tokens = sample_from(draft_probs, torch.rand(b, K, generator=gen))
    num_draft = torch.randint(0, K + 1, (b,), generator=gen)
    acc_u, bonus_u = torch.rand(b, K, generator=gen), torch.rand(b, generator=gen)
    base = verify(draft_tokens, draft_probs, target_probs, num_draft, acc_u, bonus_u)
    pad = torch.arange(K).unsqueeze(0) >= num_draft.unsqueeze(1)  # [b, K]
    garbage_tokens = torch.where(pad, torch.randint(0, vocab, (b, K), generator=gen), draft_tokens)
    garbage_probs = torch.where(pad.unsqueeze(-1), torch.zeros_like(draft_probs), draft_probs)
    garbage_u = torch.where(pad, torch.zeros_like(acc_u), acc_u)
    other = verify(garbage_tokens, garbage_probs, target_probs, num_draft, garbage_u, bonus_u)
    assert torch.equal(base.num_accepted, other.num_accepted)
    assert torch.equal(base.bonus_tokens, other.bonus_tokens)


# ---- 2. hand-built cases -------------------------------------------------------------------


def _single_position(target_row, draft_row, token, accept_u, bonus_u):
    """One row per uniform pair, K = 1, the same distributions on every row."""
    n = len(accept_u)
    target = torch.tensor(target_row, dtype=torch.float32)
    draft = torch.tensor(draft_row, dtype=torch.float32)
    target_probs = target.expand(n, 2, -1).clone()  # [n, 2, V]
    draft_probs = draft.expand(n, 1, -1).clone()  # [n, 1, V]
    draft_tokens = torch.full((n, 1), token, dtype=torch.long)
    args = (draft_tokens, draft_probs, target_probs, torch.ones(n, dtype=torch.long), accept_u.view(n, 1), bonus_u)
    fast, ref = run_both(*args)
    assert torch.equal(fast.num_accepted, ref.num_accepted)
    assert torch.equal(fast.bonus_tokens, ref.bonus_tokens)
    return fast


def test_one_hot_draft_on_unlikely_token():
    """Accepted with probability target[t]; after a rejection the bonus follows target with t removed."""
    target = [0.4, 0.1, 0.3, 0.2]
    n = 1000
    # Accept uniforms on a grid: exactly those below target[1] = 0.1 accept.
    u = uniforms_grid(n)
    out = _single_position(target, [0.0, 1.0, 0.0, 0.0], 1, u, u)
    assert torch.equal(out.num_accepted, (u < 0.1).long())
    accepted = out.num_accepted == 1
    # Accepted rows: bonus from target_probs[:, 1] (the same target row here) by inverse CDF.
    expected_all = sample_from(torch.tensor(target).expand(n, -1), u)
    assert torch.equal(out.bonus_tokens[accepted], expected_all[accepted])
    # Rejected rows: residual = [0.4, 0, 0.3, 0.2] / 0.9, inverse CDF of the bonus uniform.
    residual = torch.tensor([0.4, 0.0, 0.3, 0.2]) / 0.9
    expected_rej = sample_from(residual.expand(n, -1), u)
    assert torch.equal(out.bonus_tokens[~accepted], expected_rej[~accepted])
    assert not bool((out.bonus_tokens[~accepted] == 1).any())
    # Separate the two uniforms: with a rejection forced, the bonus spans the residual's quantiles.
    rejected = _single_position(target, [0.0, 1.0, 0.0, 0.0], 1, torch.full((n,), 0.5), u)
    assert not bool(rejected.num_accepted.any())
    counts = torch.bincount(rejected.bonus_tokens, minlength=4).float() / n
    assert torch.allclose(counts, residual, atol=2.0 / n)


def test_draft_zero_where_target_positive_always_accepts():
    u = torch.tensor([0.0, 0.3, 0.999, ONE_MINUS])
    out = _single_position([0.5, 0.5, 0.0], [1.0, 0.0, 0.0], 1, u, u)
    assert out.num_accepted.tolist() == [1, 1, 1, 1]


def test_draft_and_target_both_zero_rejects():
    u = torch.tensor([0.0, 0.5, ONE_MINUS])
    out = _single_position([0.5, 0.5, 0.0], [0.7, 0.3, 0.0], 2, u, u)
    assert out.num_accepted.tolist() == [0, 0, 0]
    # residual = max(0, target - draft) = [0, 0.2, 0] -> the bonus is token 1
    assert out.bonus_tokens.tolist() == [1, 1, 1]


def test_draft_equal_to_target_always_accepts():
    gen = torch.Generator().manual_seed(3)
    b, K, vocab = 200, 3, 12
    target_probs = random_dists(gen, (b, K + 1, vocab))
    draft_probs = target_probs[:, :K].clone()
    draft_tokens = sample_from(draft_probs, torch.rand(b, K, generator=gen))
    acc_u = torch.rand(b, K, generator=gen)
    acc_u[:20] = ONE_MINUS
    bonus_u = torch.rand(b, generator=gen)
    out = verify(draft_tokens, draft_probs, target_probs, torch.full((b,), K), acc_u, bonus_u)
    assert bool((out.num_accepted == K).all())
    assert torch.equal(out.bonus_tokens, sample_from(target_probs[:, K], bonus_u))


def test_greedy_one_hot_rows():
    """One-hot target and draft rows: accept while the draft equals the target's argmax; the bonus
    is the target's argmax at the first mismatch (or after the last draft token)."""
    gen = torch.Generator().manual_seed(4)
    b, K, vocab = 300, 4, 6
    argmax = torch.randint(0, vocab, (b, K + 1), generator=gen)
    target_probs = torch.zeros(b, K + 1, vocab).scatter_(-1, argmax.unsqueeze(-1), 1.0)
    agree = torch.rand(b, K, generator=gen) < 0.7
    draft_tokens = torch.where(
        agree, argmax[:, :K], (argmax[:, :K] + 1 + torch.randint(0, vocab - 1, (b, K), generator=gen)) % vocab
    )
    draft_probs = torch.zeros(b, K, vocab).scatter_(-1, draft_tokens.unsqueeze(-1), 1.0)
    num_draft = torch.randint(0, K + 1, (b,), generator=gen)
    args = (
        draft_tokens,
        draft_probs,
        target_probs,
        num_draft,
        torch.rand(b, K, generator=gen),
        torch.rand(b, generator=gen),
    )
    fast, ref = run_both(*args)
    assert torch.equal(fast.num_accepted, ref.num_accepted)
    assert torch.equal(fast.bonus_tokens, ref.bonus_tokens)
    for r in range(b):
        accepted = 0
        while accepted < int(num_draft[r]) and int(draft_tokens[r, accepted]) == int(argmax[r, accepted]):
            accepted += 1
        assert int(fast.num_accepted[r]) == accepted
        assert int(fast.bonus_tokens[r]) == int(argmax[r, accepted])


@pytest.mark.parametrize("seed", range(4))
def test_a_greedy_target_reads_no_draft_probability(seed):
    """Where every row's target is greedy, a speculation may leave its draft probabilities out
    (None): verification then decides exactly what it decides with any draft distribution, here
    one-hot (a greedy draft's) and random ones, in the vectorized rule, the reference and the
    device version."""
    gen = torch.Generator().manual_seed(seed)
    b, K, vocab = 64, 4, 7
    argmax = torch.randint(0, vocab, (b, K + 1), generator=gen)
    target_probs = torch.zeros(b, K + 1, vocab).scatter_(-1, argmax.unsqueeze(-1), 1.0)
    agree = torch.rand(b, K, generator=gen) < 0.7
    draft_tokens = torch.where(agree, argmax[:, :K], torch.randint(0, vocab, (b, K), generator=gen))
    one_hot = torch.zeros(b, K, vocab).scatter_(-1, draft_tokens.unsqueeze(-1), 1.0)
    rest = (target_probs, torch.randint(0, K + 1, (b,), generator=gen), torch.rand(b, K, generator=gen),
            torch.rand(b, generator=gen))  # fmt: skip
    left_out = verify(draft_tokens, None, *rest)
    for draft_probs in (one_hot, random_dists(gen, (b, K, vocab))):
        for rule in (verify, verify_reference, verify_on_device):
            with_probs = rule(draft_tokens, draft_probs, *rest)
            assert torch.equal(left_out.num_accepted, with_probs.num_accepted)
            assert torch.equal(left_out.bonus_tokens, with_probs.bonus_tokens)
    ref = verify_reference(draft_tokens, None, *rest)
    assert torch.equal(ref.num_accepted, left_out.num_accepted) and torch.equal(ref.bonus_tokens, left_out.bonus_tokens)
    # The engine's shortcut for such a batch reads the logits alone (their argmaxes: the one-hot rows')
    fast = verify_greedy(draft_tokens, target_probs + torch.rand(b, K + 1, vocab, generator=gen) * 0.5, rest[1])
    assert torch.equal(fast.num_accepted, left_out.num_accepted) and torch.equal(
        fast.bonus_tokens, left_out.bonus_tokens
    )


def test_k_zero_samples_bonus_from_first_target_distribution():
    gen = torch.Generator().manual_seed(5)
    b, vocab = 100, 7
    target_probs = random_dists(gen, (b, 1, vocab))
    bonus_u = torch.rand(b, generator=gen)
    args = (
        torch.zeros(b, 0, dtype=torch.long),
        torch.zeros(b, 0, vocab),
        target_probs,
        torch.zeros(b, dtype=torch.long),
        torch.zeros(b, 0),
        bonus_u,
    )
    fast, ref = run_both(*args)
    assert fast.num_accepted.tolist() == [0] * b
    assert torch.equal(fast.bonus_tokens, sample_from(target_probs[:, 0], bonus_u))
    assert torch.equal(fast.bonus_tokens, ref.bonus_tokens)


def test_num_draft_zero_rows_in_a_k_batch_use_first_target_distribution():
    gen = torch.Generator().manual_seed(6)
    b, K, vocab = 50, 3, 7
    target_probs = random_dists(gen, (b, K + 1, vocab))
    draft_probs = target_probs[:, :K].clone()  # would always accept if counted
    draft_tokens = sample_from(draft_probs, torch.rand(b, K, generator=gen))
    bonus_u = torch.rand(b, generator=gen)
    out = verify(
        draft_tokens,
        draft_probs,
        target_probs,
        torch.zeros(b, dtype=torch.long),
        torch.rand(b, K, generator=gen),
        bonus_u,
    )
    assert out.num_accepted.tolist() == [0] * b
    assert torch.equal(out.bonus_tokens, sample_from(target_probs[:, 0], bonus_u))


# ---- 3. statistical losslessness ---------------------------------------------------------

VOCAB = 8


def _fixed_pair(seed: int, vocab: int = VOCAB):
    """A target and a draft distribution that differ a lot, with zeros on both sides."""
    gen = torch.Generator().manual_seed(seed)
    target = (torch.randn(vocab, generator=gen) * 1.2).softmax(-1)
    draft = (torch.randn(vocab, generator=gen) * 1.2).softmax(-1)
    target[int(torch.randint(0, vocab, (1,), generator=gen))] = 0.0  # some token only the draft proposes
    draft[int(target.argmax())] = 0.0  # the target's favourite never drafted (accepted if proposed)
    return target / target.sum(), draft / draft.sum()


def _residual(target, draft):
    r = (target - draft).clamp(min=0)
    return r / r.sum()


@pytest.mark.parametrize("K", [1, 2, 3])
def test_acceptance_law_and_bonus_distributions(K):
    """Position-wise independent target_probs[i] / draft_probs[i]: the number accepted follows
    P(j) = prod_{i<j} a_i * (1 - a_j) with a_i = sum(min(target_i, draft_i)); after a rejection at j
    the bonus follows the residual norm(max(0, target_j - draft_j)) (j = 0 is the all-rejected
    path); after K acceptances it follows target_K; the first emitted token follows target_0."""
    n = 20000
    pairs = [_fixed_pair(10 * K + j) for j in range(K + 1)]
    target = torch.stack([t for t, _ in pairs])  # [K+1, V]
    draft = torch.stack([d for _, d in pairs[:K]])  # [K, V]
    gen = torch.Generator().manual_seed(100 + K)
    target_probs = target.expand(n, -1, -1).contiguous()  # [n, K+1, V]
    draft_probs = draft.expand(n, -1, -1).contiguous()  # [n, K, V]
    draft_tokens = sample_from(draft_probs, torch.rand(n, K, generator=gen))
    out = verify(
        draft_tokens,
        draft_probs,
        target_probs,
        torch.full((n,), K),
        torch.rand(n, K, generator=gen),
        torch.rand(n, generator=gen),
    )

    alpha = torch.minimum(target[:K], draft).sum(-1).double()  # [K]
    law = [float(alpha[:j].prod() * (1 - alpha[j])) for j in range(K)] + [float(alpha.prod())]
    counts = torch.bincount(out.num_accepted, minlength=K + 1)
    assert chi_square_p(counts, law) > P_MIN, (counts.tolist(), law)

    for accepted in range(K + 1):
        rows = out.num_accepted == accepted
        assert int(rows.sum()) > 200  # enough samples on every path for the test to mean something
        expected = _residual(target[accepted], draft[accepted]) if accepted < K else target[K]
        got = torch.bincount(out.bonus_tokens[rows], minlength=VOCAB)
        assert chi_square_p(got, expected) > P_MIN, (accepted, got.tolist(), expected.tolist())

    first = torch.where(out.num_accepted > 0, draft_tokens[:, 0], out.bonus_tokens)
    assert chi_square_p(torch.bincount(first, minlength=VOCAB), target[0]) > P_MIN
    # Power check: the draft's own distribution is clearly rejected by the same test.
    assert chi_square_p(torch.bincount(draft_tokens[:, 0], minlength=VOCAB), target[0] + 1e-9) < 1e-6


def _markov_pair(seed: int, vocab: int = VOCAB):
    """Transition matrices [V, V] for a target and a (quite different) draft 'language model'."""
    gen = torch.Generator().manual_seed(seed)
    target = (torch.randn(vocab, vocab, generator=gen) * 1.5).softmax(-1)
    draft = (0.5 * target.log() + torch.randn(vocab, vocab, generator=gen) * 1.5).softmax(-1)
    # Zeros: each target row forbids one token; each draft row never proposes the target's favourite.
    target.scatter_(-1, torch.randint(0, vocab, (vocab, 1), generator=gen), 0.0)
    draft.scatter_(-1, target.argmax(-1, keepdim=True), 0.0)
    return target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)


def _generate_markov(target_T, draft_T, start: int, n: int, K: int, length: int, seed: int):
    """Speculative decoding of a Markov chain, rounds of K drafts, vectorized over n sequences.
    Returns emitted tokens [n, length] and how many rounds accepted nothing."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((n, length), -1, dtype=torch.long)
    filled = torch.zeros(n, dtype=torch.long)
    context = torch.full((n,), start, dtype=torch.long)
    all_rejected_rounds = 0
    while bool((filled < length).any()):
        rows = torch.nonzero(filled < length).squeeze(1)
        m = len(rows)
        prev = context[rows]
        tokens, dprobs, tprobs = [], [], []
        for _ in range(K):
            q = draft_T[prev]  # [m, V]
            tok = sample_from(q, torch.rand(m, generator=gen))
            tprobs.append(target_T[prev])
            dprobs.append(q)
            tokens.append(tok)
            prev = tok
        tprobs.append(target_T[prev])
        draft_tokens = torch.stack(tokens, 1)  # [m, K]
        res = verify(
            draft_tokens,
            torch.stack(dprobs, 1),
            torch.stack(tprobs, 1),
            torch.full((m,), K),
            torch.rand(m, K, generator=gen),
            torch.rand(m, generator=gen),
        )
        all_rejected_rounds += int((res.num_accepted == 0).sum())
        emitted = torch.cat([draft_tokens, torch.zeros(m, 1, dtype=torch.long)], 1)
        emitted[torch.arange(m), res.num_accepted] = res.bonus_tokens
        for i in range(K + 1):  # copy emitted[:, :num_accepted + 1] into the free slots
            take = (i <= res.num_accepted) & (filled[rows] < length)
            r = rows[take]
            out[r, filled[r]] = emitted[take, i]
            filled[r] += 1
        context[rows] = res.bonus_tokens
    return out, all_rejected_rounds


@pytest.mark.parametrize("K", [1, 2, 3])
def test_emitted_sequence_follows_target_chain(K):
    """Draft tokens drawn from the draft's chain, verified by the target's chain, emitted over
    several rounds: the first token follows target[start] and the pair (first, second) follows
    target[start][t1] * target[t1][t2], whichever rounds and paths produced them."""
    target_T, draft_T = _markov_pair(7)
    n, start = 20000, 0
    out, all_rejected = _generate_markov(target_T, draft_T, start, n, K, 2, seed=200 + K)
    assert all_rejected > n // 10  # the all-rejected path is exercised often
    first, second = out[:, 0], out[:, 1]
    assert chi_square_p(torch.bincount(first, minlength=VOCAB), target_T[start]) > P_MIN
    joint = target_T[start].unsqueeze(1) * target_T  # [V, V]: P(t1) * P(t2 | t1)
    pair_counts = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB)
    assert chi_square_p(pair_counts, joint) > P_MIN
    # Second token conditional on the most common first token.
    top = int(torch.bincount(first, minlength=VOCAB).argmax())
    cond = torch.bincount(second[first == top], minlength=VOCAB)
    assert chi_square_p(cond, target_T[top]) > P_MIN
