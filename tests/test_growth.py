"""Per-token work that must not grow with the sequence: the fast backup's n-gram lookup and the
output text (stop strings, streaming). Exactness against the former whole-history code, kept
here as the reference, and a timing check at 256 vs 4096 tokens of history, batch 32."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from ssd.core.config import EngineArgs
from ssd.core.sampling_params import SamplingParams
from ssd.core.sequence import Sequence
from ssd.drafting.ngram import NgramIndex
from ssd.drafting.ssd_proposer import SSDProposer
from ssd.engine.stopping import StopChecker
from ssd.model.demo_models import EOS_ID, VOCAB_SIZE, build_tokenizer

K = 6


def ref_ngram_lookup(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1, window: int = 2048) -> list[int]:
    """The former lookup: a scan of the last `window` tokens for each n."""
    start = max(0, len(tokens) - window)
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) - start <= n:
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, start - 1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def ref_fast_speculation(
    tokens: list[int], k: int, vocab: int, generator: torch.Generator
) -> tuple[list[int], torch.Tensor]:
    found = ref_ngram_lookup(tokens, k)
    if len(found) < k:
        found = found + torch.randint(vocab, (k - len(found),), generator=generator).tolist()
    probs = torch.zeros(k, vocab)  # [k, vocab]
    probs[torch.arange(k), torch.tensor(found)] = 1.0
    return found, probs


def test_ngram_index_matches_the_scan_on_random_sequences():
    """Small alphabets make matches of every n frequent, overlapping ones included."""
    rng = random.Random(0)
    checked = found = 0
    for _ in range(400):
        alphabet = rng.randint(1, 6)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 200))]
        index, pos = NgramIndex(), 0
        while pos <= len(tokens):
            for k in (1, 3, K, 9):
                expected = ref_ngram_lookup(tokens[:pos], k)
                assert index.lookup(k) == expected, (tokens[:pos], k)
                checked += 1
                found += bool(expected)
            step = rng.randint(1, 5)  # extended a round's worth at a time, like the proposer
            index.extend(tokens[pos : pos + step])
            pos += step
        assert len(index) == len(tokens)
    assert checked > 20000 and 0.5 * checked < found < checked  # both hits and misses were seen


def _seq(seq_id: int, prompt: list[int], params: SamplingParams | None = None) -> Sequence:
    return Sequence(
        seq_id,
        f"r{seq_id}",
        prompt,
        params or SamplingParams(ignore_eos=True, max_tokens=10**6),
        torch.Generator().manual_seed(seq_id),
    )


def _proposer() -> SSDProposer:
    """An SSD proposer whose drafter does nothing: only the fast backup is exercised."""
    client = SimpleNamespace(admit=lambda msg: None, release=lambda msg: None)
    config = EngineArgs(
        mode="ssd",
        k=K,
        ssd_budget=4,
        ssd_autobudget=False,
        ssd_fanout="uniform",
        ssd_backup="fast",
        draft_deadline_s=1.0,
    ).to_config()
    return SSDProposer(client, config, VOCAB_SIZE)


def test_proposer_fast_backup_matches_the_former_whole_history_speculation():
    rng = random.Random(1)
    proposer = _proposer()
    seqs = [_seq(i, [rng.randrange(5) for _ in range(rng.randint(1, 30))]) for i in range(4)]
    proposer.add(seqs)
    # The former _fast drew its random fill from the same per-sequence generator: a clone of it.
    ref_rng = {s.seq_id: torch.Generator().set_state(proposer.backup_rng[s.seq_id].get_state()) for s in seqs}
    for _ in range(60):
        for s in seqs:
            s.output_ids.extend(rng.randrange(5) for _ in range(rng.randint(1, K + 1)))
            got = proposer._fast(s)
            tokens, probs = ref_fast_speculation(s.prompt_ids + s.output_ids, K, VOCAB_SIZE, ref_rng[s.seq_id])
            assert got.tokens == tokens and torch.equal(got.probs, probs)
    proposer.keep(torch.tensor([1, 3]))
    assert set(proposer.ngram) == {seqs[1].seq_id, seqs[3].seq_id}


# ---- per-token cost at 256 vs 4096 tokens of history ----------------------------------------

BATCH, SHORT, LONG = 32, 256, 4096
STEPS, REPEATS = 8, 7  # tokens per sequence per timed block; blocks (the fastest one counts)
MAX_GROWTH = 3.0  # per-token cost at LONG / at SHORT; a scan or full decode per token gives ~8-20x


def _min_per_token_seconds(states: list, step) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            for state in states:
                step(state)
        best = min(best, (time.perf_counter() - t0) / (STEPS * len(states)))
    return best


def _random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]  # distinct n-grams: a scan finds little


def _ngram_cost(history: int) -> float:
    """The proposer's fast backup for every row of a batch, once per committed token."""
    rng = random.Random(history)
    proposer = _proposer()
    seqs = [_seq(i, _random_tokens(rng, 16)) for i in range(BATCH)]
    proposer.add(seqs)
    states = []
    for s in seqs:
        s.output_ids.extend(_random_tokens(rng, history - len(s.prompt_ids)))
        proposer._fast(s)  # the first use indexes the history (once per sequence)
        states.append((s, iter(_random_tokens(rng, STEPS * REPEATS))))

    def step(state) -> None:
        seq, upcoming = state
        seq.output_ids.append(next(upcoming))
        proposer._fast(seq)

    return _min_per_token_seconds(states, step)


def _text_tokens(rng: random.Random, n: int) -> list[int]:
    """Lowercase text with two- and three-byte characters, which arrive a byte at a time."""
    pieces = [b"e", b"t", b"a", b" ", b"\n", "é".encode(), "€".encode()]
    out: list[int] = []
    while len(out) < n:
        out.extend(rng.choice(pieces))
    return out[:n]


def _text_cost(history: int) -> float:
    """Stop strings checked at every token, and the engine's streaming output, per token."""
    rng = random.Random(history)
    stopper = StopChecker(build_tokenizer(), EOS_ID, max_model_len=10**6)
    params = SamplingParams(ignore_eos=True, max_tokens=10**6, stop=["QQQ", "Z\n"])  # never generated
    states = []
    for i in range(BATCH):
        seq = _seq(i, [1], params)
        seq.output_ids.extend(_text_tokens(rng, history))
        stopper.append(seq, _text_tokens(rng, 8))  # catches up with the history (once)
        stopper.output(seq)
        states.append((seq, iter(_text_tokens(rng, STEPS * REPEATS))))

    def step(state) -> None:
        seq, upcoming = state
        assert stopper.append(seq, [next(upcoming)]) == 1 and not seq.finished
        stopper.output(seq)

    return _min_per_token_seconds(states, step)


@pytest.mark.parametrize("cost", [_ngram_cost, _text_cost], ids=["ngram", "text"])
def test_per_token_cost_stays_flat_as_the_sequence_grows(cost):
    short, long = cost(SHORT), cost(LONG)
    assert long < MAX_GROWTH * short, (
        f"{cost.__name__}: {1e6 * short:.1f} us/token at {SHORT}, {1e6 * long:.1f} at {LONG}"
    )
