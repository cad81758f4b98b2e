"""Penalties, logit bias, allowed tokens, min_tokens and min_p under speculation: still exact.

Each draft position is verified against the target's distribution processed with that
position's own history (the committed output plus the earlier drafts of the same speculation).
Checked against an independent reference (tests/refimpl.py, token by token in float64):
1. greedy output equals Hugging Face `generate` with the same processing as a logits processor,
   in ar, sd and ssd (a 2-worker pool, whose drafters process too), rows with different
   settings batched together;
2. sampled output follows the processed distribution (chi-square of the first two tokens, where
   the second token's penalties depend on the first);
3. the device versions of the processing equal the host versions;
4. bad values are refused naming the field.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from refimpl import ReferenceAdjustments, adjusted_logits, chi_square_p, min_p_filter
from test_sampling_exactness import P_MIN, model_dirs, sample_first_two, single_thread  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from ssd import LLM, SamplingParams
from ssd.core.sampling import BatchSampling, SequenceSampling, process_logits, process_logits_on_device
from ssd.processing.adjustments import build
from ssd.processing.request import Processing
from ssd.processing.tracked import TrackedHistory

PROMPTS = ["def add(a, b):\n    return", "x", "import os\nimport sys\n"]
MAX_TOKENS = 24
SETTINGS = [
    dict(repetition_penalty=1.3, frequency_penalty=0.5),
    dict(presence_penalty=1.5, logit_bias={32: -5.0, 10: 3.0}, min_tokens=20, stop_token_ids=[41]),
    dict(allowed_token_ids=list(range(32, 127)), frequency_penalty=2.0),
]
ENGINES = {
    "ar": dict(mode="ar"),
    "sd": dict(mode="sd", k=4),
    "ssd": dict(mode="ssd", k=4, draft_workers=2, ssd_autobudget=False),  # a 2-worker shm pool
}
# The chi-squares sample 3000 rows in one batch: through the pool that took 10-12 s longer per
# test, so they run the same drafter in-process (the pool's chi-square under penalties is
# tests/test_ssd_process_sampling.py's two_workers_penalties).
SAMPLED = dict(ENGINES, ssd=dict(mode="ssd", k=4, draft_transport="inprocess", ssd_autobudget=False))


def hf_adjusted_greedy(path: str, prompt: str, params: SamplingParams) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    eos = model.generation_config.eos_token_id
    processor = LogitsProcessorList([ReferenceAdjustments(params, ids.shape[1], eos)])
    gen = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=params.max_tokens,
        logits_processor=processor,
        eos_token_id=[eos, *params.stop_token_ids],
    )
    return gen[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("mode", list(ENGINES))
def test_greedy_with_penalties_equals_hf_generate(tiny_pair, mode):
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **s) for s in SETTINGS]
    want = [hf_adjusted_greedy(tiny_pair[0], p, sp) for p, sp in zip(PROMPTS, params)]
    plain = hf_adjusted_greedy(tiny_pair[0], PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert want[0] != plain  # the penalties change the output (else this test shows nothing)
    with LLM(*tiny_pair, max_num_seqs=2, **ENGINES[mode]) as llm:
        got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == want
    assert len(got[1].token_ids) >= 20  # min_tokens held EOS and the stop id back
    assert set(got[2].token_ids) <= set(range(32, 127))


# ---- sampled: the first two tokens -------------------------------------------------------------

CASES = {
    "penalties_bias": SamplingParams(
        temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.2, logit_bias={101: 2.0}
    ),
    "min_p_t0.8": SamplingParams(temperature=0.8, min_p=0.05, frequency_penalty=1.0),
    # Sixteen printable tokens held back as stop ids for both sampled positions (ignore_eos as the
    # samples are drawn, so EOS is not one of them).
    "min_tokens": SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=list(range(32, 48)), ignore_eos=True),
}


def processed(row: np.ndarray, params: SamplingParams, prompt, output, eos) -> np.ndarray:
    z = adjusted_logits(row, params, prompt, output, eos) / params.temperature
    probs = np.exp(z - z.max())
    return min_p_filter(probs / probs.sum(), params.min_p)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
@pytest.mark.parametrize("case", list(CASES))
def test_sampled_output_follows_the_processed_distribution(model_dirs, mode, case):  # noqa: F811
    params = CASES[case]
    engine = dict(SAMPLED[mode], k=3)
    with LLM(model_dirs["target"], model_dirs["close"], max_num_seqs=4096, **engine) as llm:
        prompt, outs = sample_first_two(llm, params, seed_base=500_000 + 1000 * list(CASES).index(case), n=3000)
        eos = llm.engine.stopper.eos_token_id
    target = AutoModelForCausalLM.from_pretrained(model_dirs["target"], local_files_only=True).eval()
    first = np.array([o.token_ids[0] for o in outs])
    second = np.array([o.token_ids[1] for o in outs])
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1].double().numpy()
    p1 = processed(logits, params, prompt, [], eos)
    assert chi_square_p(np.bincount(first, minlength=len(p1)), p1) > P_MIN
    # The second token given the most common first one: its penalties count that first token.
    top = Counter(first.tolist()).most_common(1)[0][0]
    with torch.no_grad():
        logits2 = target(input_ids=torch.tensor([prompt + [top]])).logits[0, -1].double().numpy()
    p2 = processed(logits2, params, prompt, [top], eos)
    assert chi_square_p(np.bincount(second[first == top], minlength=len(p2)), p2) > P_MIN


# ---- the device versions -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_processing_on_device_equals_the_host_version(seed):
    gen = torch.Generator().manual_seed(seed)
    b, k, vocab = 4, 3, 50
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.7, min_tokens=3),
        SamplingParams(temperature=0.9, top_k=7, min_p=0.1, logit_bias={3: 5.0, 4: -100.0}),
        SamplingParams(temperature=1.2, top_p=0.8, presence_penalty=-1.0, allowed_token_ids=[1, 2, 3, 9, 30]),
        SamplingParams(temperature=0.7),
    ]
    rows = [(p, torch.randint(0, vocab, (5,), generator=gen).tolist(), [7, 7, 3]) for p in params]
    drafted = torch.randint(0, vocab, (b, k), generator=gen)
    table = [(Processing.of(p, 0), prompt, out) for p, prompt, out in rows]
    sampling = BatchSampling.of([SequenceSampling.of(p) for p in params]).adjusted(build(table, drafted, vocab))
    logits = torch.randn(b, k + 1, vocab, generator=gen) * 3
    assert torch.equal(process_logits_on_device(logits, sampling), process_logits(logits, sampling))


def test_min_p_filters_only_the_rows_that_have_it_and_costs_nothing_without():
    """A batch where no row has min_p keeps no min_p tensor (no [b, n, V] pass); where one row
    has it, that row drops what the reference drops and the other row keeps everything."""
    vocab, none = 30, torch.zeros(2, 0, dtype=torch.long)
    plain = Processing(repetition_penalty=1.3)
    assert build([(plain, [1], []), (plain, [2], [])], none, vocab).min_p is None
    scaled = torch.randn(2, 1, vocab, generator=torch.Generator().manual_seed(0))
    scaled = scaled - scaled.amax(-1, keepdim=True)
    assert build([(plain, [1], []), (plain, [2], [])], none, vocab).min_p_filtered(scaled) is scaled
    adjust = build([(Processing(min_p=0.3), [1], []), (plain, [2], [])], none, vocab)
    filtered = adjust.min_p_filtered(scaled)
    probs = scaled[0, 0].double().softmax(-1).numpy()
    assert np.array_equal(torch.isfinite(filtered[0, 0]).numpy(), min_p_filter(probs, 0.3) > 0)
    assert torch.equal(filtered[1], scaled[1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"logit_bias": {5: 101.0}}, r"logit_bias values must be in \[-100, 100\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids >= 0"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "at most 300"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"min_tokens": 10, "max_tokens": 5}, r"min_tokens must be in \[0, max_tokens\]"),
        ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ],
)
def test_bad_values_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_token_ids_beyond_the_vocabulary_are_refused(tiny_pair):
    with LLM(*tiny_pair, mode="ar") as llm:
        for kwargs, name in (({"logit_bias": {10**6: 1.0}}, "logit_bias"), ({"allowed_token_ids": [10**6]}, "allowed")):
            with pytest.raises(ValueError, match=name):
                llm.generate("x", SamplingParams(**kwargs))


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_penalties_count_the_earlier_drafts_of_the_same_speculation(demo_pair, mode):
    """The demo pair's greedy output repeats a token the draft keeps proposing; a frequency
    penalty must count the copies accepted earlier in the same round, or the target accepts
    one copy too many."""
    params = SamplingParams(temperature=0.0, max_tokens=32, frequency_penalty=0.3)
    want = hf_adjusted_greedy(demo_pair[0], "def add(a, b):", params)
    with LLM(*demo_pair, **dict(ENGINES[mode], k=6)) as llm:
        got = llm.generate("def add(a, b):", params)[0]
    assert got.token_ids == want
    assert got.metrics["mean_accepted_per_round"] > 1  # several drafts accepted per round


def test_min_tokens_holds_a_stop_token_back_exactly_until_the_minimum(tiny_pair):
    with LLM(*tiny_pair, **ENGINES["sd"]) as llm:
        free = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].token_ids
        at = 6
        stop = free[at]
        first = free.index(stop)  # the stop id's first place (at or before `at`)
        ends = llm.generate(
            PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], min_tokens=first)
        )
        held = llm.generate(
            PROMPTS[0],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], min_tokens=first + 1),
        )
    assert ends[0].token_ids == free[: first + 1]  # allowed at the minimum
    assert len(held[0].token_ids) > first + 1  # one short of it: held back


def test_the_sd_draft_applies_the_penalties_too(demo_pair):
    """Exactness does not need it; acceptance does. Measured on the demo pair (8 held-out
    prompts, 64 tokens, K=6, frequency and presence penalty 0.5): acceptance 0.47 with an
    unprocessed draft, 0.63 with the draft processed position by position (0.77 without
    penalties)."""
    from ssd.model.demo_models import heldout_prompts

    params = SamplingParams(temperature=0.0, max_tokens=64, frequency_penalty=0.5, presence_penalty=0.5)
    with LLM(*demo_pair, mode="sd", k=6) as llm:
        outs = llm.generate(heldout_prompts(8, prompt_bytes=80), params)
    acceptance = sum(o.metrics["accepted_tokens"] for o in outs) / sum(o.metrics["draft_tokens"] for o in outs)
    assert acceptance > 0.58, acceptance


def test_advancing_the_adjustments_equals_building_them_with_the_token_in_the_history():
    """What the SD draft does after each draft token (Adjustments.advanced), for tokens the row
    tracked already and tokens it did not."""
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=5, stop_token_ids=[11]),
        SamplingParams(presence_penalty=1.0, logit_bias={7: 2.0}),
        SamplingParams(),
    ]
    rows = [(Processing.of(p, 0), [1, 2, 3], [4, 4, 9][: 3 - i]) for i, p in enumerate(params)]
    none = torch.zeros(3, 0, dtype=torch.long)
    logits = torch.randn(3, 1, 20, generator=torch.Generator().manual_seed(0))
    for tokens in (torch.tensor([4, 7, 2]), torch.tensor([15, 16, 17])):
        stepped = build(rows, none, 20).advanced(tokens)
        rebuilt = build([(p, prompt, out + [int(t)]) for (p, prompt, out), t in zip(rows, tokens)], none, 20)
        assert torch.equal(stepped.apply(logits), rebuilt.apply(logits))
        assert torch.equal(stepped.advanced(tokens).apply(logits), rebuilt.advanced(tokens).apply(logits))


def _random_rows(gen: torch.Generator, vocab: int) -> list[tuple[Processing, list[int], list[int]]]:
    """Rows of every kind the adjustments distinguish: penalties, bias and stop ids with
    min_tokens, none at all (an inactive row among active ones), allowed tokens."""
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=9, stop_token_ids=[11]),
        SamplingParams(presence_penalty=1.0, logit_bias={7: 2.0, 3: -1.0}),
        SamplingParams(),
        SamplingParams(frequency_penalty=-0.5, allowed_token_ids=list(range(0, vocab, 2))),
    ]
    return [
        (Processing.of(p, 0), torch.randint(vocab, (5,), generator=gen).tolist(),
         torch.randint(vocab, (r,), generator=gen).tolist())
        for r, p in enumerate(params)
    ]  # fmt: skip


@pytest.mark.parametrize("seed", range(6))
def test_extending_the_first_position_equals_building_with_the_speculation(seed):
    """Verification extends the round's first position's adjustments with the drafts
    (Adjustments.speculated) instead of building them again: the same logits, for drafts that
    repeat each other, repeat tracked tokens and bring new ones."""
    gen = torch.Generator().manual_seed(seed)
    vocab, k = 20, 5
    rows = _random_rows(gen, vocab)
    drafted = torch.randint(vocab, (len(rows), k), generator=gen)
    logits = torch.randn(len(rows), k + 1, vocab, generator=gen) * 3
    masks = torch.rand(len(rows), k + 1, vocab, generator=gen) > 0.2
    first = build(rows, drafted[:, :0], vocab)
    for m in (None, masks):
        assert torch.equal(first.speculated(drafted, m).apply(logits), build(rows, drafted, vocab, m).apply(logits))


def test_applied_in_place_the_adjustments_write_into_the_logits_given_and_only_then():
    """in_place=True (the caller gives its logits up: a draft forward's, a verification whose rows
    read no raw logprobs) adjusts them where they are, to what the default's copy holds; the
    default leaves them as they were, as raw logprobs need. A bf16 input is converted either way."""
    gen = torch.Generator().manual_seed(0)
    vocab, k = 20, 3
    rows = _random_rows(gen, vocab)
    drafted = torch.randint(vocab, (len(rows), k), generator=gen)
    logits = torch.randn(len(rows), k + 1, vocab, generator=gen) * 3
    masks = torch.rand(len(rows), k + 1, vocab, generator=gen) > 0.2
    for adjust in (build(rows, drafted, vocab), build(rows, drafted, vocab, masks)):
        given = logits.clone()
        copied = adjust.apply(given)
        assert torch.equal(given, logits) and not torch.equal(copied, logits)
        adjusted = adjust.apply(given, in_place=True)
        assert adjusted.data_ptr() == given.data_ptr() and torch.equal(adjusted, copied)
        half = logits.bfloat16()
        assert torch.equal(adjust.apply(half, in_place=True), adjust.apply(half.clone())) and torch.equal(
            half, logits.bfloat16()
        )


def test_a_kept_history_equals_reading_the_whole_history_every_round():
    """The engine keeps each sequence's tracked tokens between rounds (TrackedHistory) and folds
    in only the output's new tokens: round after round, the adjustments equal a build that reads
    every row's whole history, whether a history is kept from the start or from a later round."""
    gen = torch.Generator().manual_seed(0)
    vocab = 20
    rows = _random_rows(gen, vocab)
    kept = [TrackedHistory() for _ in rows]
    none = torch.zeros(len(rows), 0, dtype=torch.long)
    logits = torch.randn(len(rows), 1, vocab, generator=gen) * 3
    for step in range(6):
        histories = kept if step else [None, kept[1], kept[2], None]  # rows 0 and 3 start later
        fresh = build(rows, none, vocab)
        assert torch.equal(build(rows, none, vocab, histories=histories).apply(logits), fresh.apply(logits))
        for _, _, out in rows:
            out.extend(torch.randint(vocab, (step % 3,), generator=gen).tolist())
