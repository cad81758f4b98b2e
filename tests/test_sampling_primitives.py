"""The sampling primitives verification rests on (ssd/engine/sampling.py): process_logits
(temperature, top-k, top-p, greedy; per-row settings) against an independent numpy statement of
the same rules, and sample_from as an inverse CDF that never picks a zero-probability token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssd.core.sampling import BatchSampling, process_logits, sample_from

ONE_MINUS = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))  # largest float32 < 1


# ---- process_logits and sample_from ---------------------------------------------------


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent statement: temperature, then keep every token at least as large as the top_k-th
    largest (ties with it kept, as Hugging Face does), then (renormalized) the smallest prefix of
    the sorted distribution whose mass reaches top_p; greedy = one-hot argmax."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        out = np.zeros_like(logits)
        out[np.argmax(logits)] = 1.0
        return out
    z = logits / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-z, kind="stable")
    k = min(top_k, len(z)) if top_k > 0 else len(z)
    keep = z >= z[order[k - 1]]
    p = np.where(keep, probs, 0.0)
    p /= p.sum()
    if top_p < 1:
        cum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(cum, top_p - 1e-12) + 1)  # first prefix with mass >= top_p
        nucleus = np.zeros(len(z), dtype=bool)
        nucleus[order[:n_keep]] = True
        p = np.where(nucleus, p, 0.0)
        p /= p.sum()
    return p


def _sampling(temps, top_ks, top_ps) -> BatchSampling:
    return BatchSampling(
        torch.tensor(temps, dtype=torch.float32),
        torch.tensor(top_ks, dtype=torch.long),
        torch.tensor(top_ps, dtype=torch.float32),
    )


def test_process_logits_greedy_rows_are_one_hot_at_argmax():
    gen = torch.Generator().manual_seed(20)
    logits = torch.randn(3, 4, 30, generator=gen) * 3
    probs = process_logits(logits, _sampling([0.0, 0.0, 0.0], [0, 5, 3], [1.0, 0.9, 0.2]))
    expected = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    assert torch.equal(probs, expected)


def test_process_logits_all_greedy_batch_matches_greedy_rows_of_a_mixed_batch():
    """An all-greedy batch takes a shortcut (no softmax); its rows are those the general path
    gives greedy rows."""
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(3, 4, 30, generator=gen) * 3
    fast = process_logits(logits, _sampling([0.0, 0.0, 0.0], [0, 0, 0], [1.0, 1.0, 1.0]))
    mixed = process_logits(
        torch.cat([logits, logits[:1]]), _sampling([0.0, 0.0, 0.0, 1.0], [0, 0, 0, 0], [1.0, 1.0, 1.0, 1.0])
    )
    assert torch.equal(fast, mixed[:3])


def test_process_logits_temperature_only():
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(3, 2, 40, generator=gen) * 3
    temps = [1.0, 0.5, 2.0]
    probs = process_logits(logits, _sampling(temps, [0, 0, 0], [1.0, 1.0, 1.0]))
    for r, t in enumerate(temps):
        assert torch.allclose(probs[r], (logits[r] / t).softmax(-1), atol=1e-6)
    assert bool((probs > 0).all())


@pytest.mark.parametrize("k", [1, 2, 5, 39, 40, 100])
def test_process_logits_top_k_keeps_exactly_k(k):
    gen = torch.Generator().manual_seed(22 + k)
    vocab = 40
    logits = torch.randn(4, 3, vocab, generator=gen) * 2
    probs = process_logits(logits, _sampling([1.0, 0.7, 1.3, 1.0], [k] * 4, [1.0] * 4))
    kept = (probs > 0).sum(-1)
    assert bool((kept == min(k, vocab)).all()), kept
    # The kept tokens are the k largest logits, renormalized.
    top = logits.topk(min(k, vocab), dim=-1).indices
    assert bool(probs.gather(-1, top).gt(0).all())
    assert torch.allclose(probs.sum(-1), torch.ones(4, 3), atol=1e-5)
    for r, t in enumerate([1.0, 0.7, 1.3, 1.0]):
        for j in range(3):
            ref = reference_probs(logits[r, j].numpy(), t, k, 1.0)
            assert np.allclose(probs[r, j].numpy(), ref, atol=1e-6)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.8, 0.95, 0.999])
def test_process_logits_top_p_keeps_smallest_prefix_reaching_top_p(top_p):
    gen = torch.Generator().manual_seed(int(top_p * 1000))
    vocab = 50
    logits = torch.randn(6, 2, vocab, generator=gen) * 2.5
    probs = process_logits(logits, _sampling([1.0] * 6, [0] * 6, [top_p] * 6))
    full = logits.softmax(-1)
    for r in range(6):
        for j in range(2):
            keep = probs[r, j] > 0
            order = full[r, j].argsort(descending=True)
            n_keep = int(keep.sum())
            # A prefix of the sorted order ...
            assert bool(keep[order[:n_keep]].all())
            # ... whose mass reaches top_p, and that is the smallest such prefix.
            mass = full[r, j][order].double().cumsum(0)
            assert float(mass[n_keep - 1]) >= top_p - 1e-6
            if n_keep > 1:
                assert float(mass[n_keep - 2]) < top_p + 1e-6
            ref = reference_probs(logits[r, j].numpy(), 1.0, 0, top_p)
            assert np.allclose(probs[r, j].numpy(), ref, atol=1e-6)


def test_process_logits_top_k_then_top_p():
    """top-p applies to the distribution renormalized after top-k."""
    logits = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]]))
    probs = process_logits(logits, _sampling([1.0], [2], [0.6]))
    # After top-2: [4/7, 3/7, 0, 0]; 4/7 = 0.571 < 0.6, so both stay.
    assert torch.allclose(probs[0, 0], torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]), atol=1e-6)
    probs = process_logits(logits, _sampling([1.0], [3], [0.5]))
    # After top-3: [4/9, 3/9, 2/9]; 4/9 < 0.5, 7/9 >= 0.5 -> two stay.
    assert torch.allclose(probs[0, 0], torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]), atol=1e-6)


def test_process_logits_rows_with_different_settings_are_independent():
    gen = torch.Generator().manual_seed(23)
    vocab = 64
    settings = [
        (1.0, 0, 1.0),
        (0.0, 0, 1.0),
        (0.8, 5, 1.0),
        (1.2, 0, 0.7),
        (0.5, 10, 0.9),
        (1.0, 1, 1.0),
        (2.0, 0, 0.3),
        (0.0, 3, 0.5),
    ]
    b = len(settings)
    logits = torch.randn(b, 3, vocab, generator=gen) * 2
    temps, ks, ps = zip(*settings)
    batched = process_logits(logits, _sampling(list(temps), list(ks), list(ps)))
    for r, (t, k, p) in enumerate(settings):
        alone = process_logits(logits[r : r + 1], _sampling([t], [k], [p]))[0]
        assert torch.equal(batched[r] > 0, alone > 0)
        assert torch.allclose(batched[r], alone, atol=1e-6)
        for j in range(3):
            assert np.allclose(batched[r, j].numpy(), reference_probs(logits[r, j].numpy(), t, k, p), atol=1e-6)


def test_process_logits_at_a_large_vocabulary_with_mixed_rows():
    """At V = 32768, rows that all have a top_k are ranked by topk over max(top_k) instead of a
    sort of the vocabulary; a row that filters nothing keeps every token, and a top-p row
    without top_k takes the full sort. Each row equals the numpy statement of the rules."""
    torch.manual_seed(3)
    vocab = 32768
    logits = torch.randn(4, 2, vocab) * 3
    rows = [(1.0, 50, 1.0), (0.8, 5, 0.9), (1.0, 0, 1.0), (0.0, 0, 1.0)]
    for picked in (rows, rows + [(1.0, 0, 0.95)]):  # without, then with, a row lacking top_k
        batch = logits[torch.arange(len(picked)) % 4]
        probs = process_logits(batch, _sampling(*[list(col) for col in zip(*picked)]))
        for r, (t, k, p) in enumerate(picked):
            for j in range(2):
                expected = reference_probs(batch[r, j].numpy(), t, k, p)
                assert np.abs(probs[r, j].numpy() - expected).max() < 1e-5, (picked[r], j)
                assert (probs[r, j].numpy() > 0).sum() == (expected > 0).sum()


def test_top_k_keeps_ties_with_the_kth_and_ignores_batch_mates():
    """A row whose k-th largest logit is tied keeps every tied token, and its distribution is the
    same alone, beside a row with a larger top_k (the topk path ranks max(top_k) values), and
    beside a top-p row (the sort path): before, which tied tokens survived depended on the
    batch mates' settings, against ssd_reproducible's promise."""
    row = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.5] + [0.0] * 26)
    alone = process_logits(row.view(1, 1, -1), _sampling([1.0], [2], [1.0]))[0, 0]
    assert (alone > 0).tolist()[:6] == [True, True, True, True, False, False]
    mates = torch.stack([row, torch.randn(32)]).view(2, 1, -1)
    for other in ((1.0, 7, 1.0), (1.0, 0, 0.8), (0.0, 0, 1.0)):
        batched = process_logits(mates, _sampling([1.0, other[0]], [2, other[1]], [1.0, other[2]]))[0, 0]
        assert torch.equal(batched, alone), other
    expected = reference_probs(row.numpy(), 1.0, 2, 1.0)
    assert np.abs(alone.numpy() - expected).max() < 1e-6


def test_sample_from_never_returns_zero_probability_token():
    gen = torch.Generator().manual_seed(24)
    for vocab in [2, 7, 258, 32000]:
        b = 512
        probs = torch.rand(b, vocab, generator=gen)
        probs = probs.masked_fill(torch.rand(b, vocab, generator=gen) < 0.7, 0.0)
        probs[:, 0] = 0.0  # leading zero
        probs[:, -1] = 0.0  # trailing zero
        probs[
            torch.arange(b),
            torch.randint(1, vocab - 1, (b,), generator=gen) if vocab > 2 else torch.zeros(b, dtype=torch.long),
        ] = 0.3
        probs[:16] = 0.0
        probs[:16, 1 if vocab > 2 else 0] = 1.0  # single-token rows
        probs[16:32] *= 1000.0  # unnormalized
        probs[32:48] *= 1e-20  # tiny total mass
        u = torch.rand(b, generator=gen)
        u[::4] = 0.0
        u[1::4] = ONE_MINUS
        ids = sample_from(probs, u)
        assert bool((probs[torch.arange(b), ids] > 0).all()), vocab


def test_sample_from_is_inverse_cdf():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0]]).expand(7, -1)
    u = torch.tensor([0.0, 0.2, 0.25, 0.5, 0.74, 0.75, ONE_MINUS])
    assert sample_from(probs, u).tolist() == [1, 1, 3, 3, 3, 4, 4]
    # Unnormalized: the same answer.
    assert sample_from(probs * 8, u).tolist() == [1, 1, 3, 3, 3, 4, 4]
    # Batched leading dims.
    many = torch.rand(3, 5, 9, generator=torch.Generator().manual_seed(1))
    uu = torch.rand(3, 5, generator=torch.Generator().manual_seed(2))
    ids = sample_from(many, uu)
    assert ids.shape == (3, 5)
    assert torch.equal(ids.view(-1), sample_from(many.view(15, 9), uu.view(15)))


def test_sample_from_one_hot_rows_is_the_inverse_cdf():
    """sample_from(..., one_hot=True), the greedy shortcut, returns what the inverse CDF returns
    for one-hot rows, whatever the uniform."""
    gen = torch.Generator().manual_seed(3)
    hot = torch.randint(0, 50, (64,), generator=gen)
    probs = torch.zeros(64, 50).scatter_(-1, hot.unsqueeze(-1), 1.0)
    u = torch.rand(64, generator=gen)
    u[:2] = torch.tensor([0.0, ONE_MINUS])
    assert torch.equal(sample_from(probs, u, one_hot=True), sample_from(probs, u))
    assert torch.equal(sample_from(probs, u, one_hot=True), hot)


@pytest.mark.parametrize("temperature", [1e-5, 1e-30, 1e-40, 1e-45])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.9)])
def test_process_logits_tiny_temperature_is_the_one_hot_limit(temperature, top_k, top_p):
    """Dividing raw logits by a tiny temperature overflows to inf and the softmax to nan; the
    limit T -> 0 is one-hot on the argmax, and any accepted temperature must reach it finitely."""
    gen = torch.Generator().manual_seed(25)
    logits = torch.randn(4, 3, 40, generator=gen) * torch.tensor([1.0, 10.0, 1e4, 1e30]).view(4, 1, 1)
    probs = process_logits(logits, _sampling([temperature] * 4, [top_k] * 4, [top_p] * 4))
    assert bool(torch.isfinite(probs).all())
    expected = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    assert torch.equal(probs, expected)
    u = torch.rand(4, 3, generator=gen)
    u[0] = ONE_MINUS
    assert torch.equal(sample_from(probs, u), logits.argmax(-1))


def test_process_logits_huge_logits_stay_finite():
    """Logits near float32's range at an ordinary temperature: still a distribution."""
    logits = torch.tensor([[[3e38, 2.9e38, -3e38, 0.0]]])
    probs = process_logits(logits, _sampling([0.5], [0], [1.0]))
    assert bool(torch.isfinite(probs).all()) and probs[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sample_from_at_the_rounding_edge_steps_back_to_positive_mass():
    """u * total can round up to the total (or a blocked cumsum can overshoot it): the search then
    lands past the last positive-mass token, here on trailing zeros; u = 1.0 forces that edge."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0, 0.0, 0.5]])
    assert sample_from(probs, torch.tensor([1.0, 1.0])).tolist() == [3, 5]
    assert sample_from(probs, torch.tensor([ONE_MINUS, ONE_MINUS])).tolist() == [3, 5]


@pytest.mark.parametrize("bad", [float("nan"), 0.0])
def test_sample_from_refuses_a_row_without_mass(bad):
    probs = torch.tensor([[0.2, 0.8, 0.0], [bad, bad, bad]])
    with pytest.raises(RuntimeError, match="no positive mass"):
        sample_from(probs, torch.tensor([0.5, 0.5]))
