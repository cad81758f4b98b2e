"""The acceptance-matched pair (ssd/bench/matched_pair.py) at small shapes: its knob sets the
engine's acceptance as documented, and its target, saved as an ordinary checkpoint and run by the
engine, decodes greedily exactly as Hugging Face's `generate` does."""

from __future__ import annotations

import pytest
import torch
from refimpl import hf_greedy

from ssd import LLM, SamplingParams
from ssd.bench.matched_bench import acceptance_by_position
from ssd.bench.matched_pair import PairSpec, build_matched_pair, perturbation_rms, shared_map, successor_path
from ssd.model.demo_models import VOCAB_SIZE, build_tokenizer, heldout_prompts

TARGET = dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
DRAFT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
# At these shapes (rank 64, the demo's 258 tokens) greedy SD at K = 4 accepted 0.76, 0.54 and 0.15
# of the offered tokens along the target's path (teacher forcing): far enough apart that the
# ordering cannot flip, and every run is deterministic (seeded weights, greedy decoding).
SCALES = (0.2, 0.6, 1.3)
K, MAX_TOKENS = 4, 48


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return heldout_prompts(6, prompt_bytes=64)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, prompts) -> dict[float, dict]:
    """Per scale: the saved pair, and the engine's greedy sd outputs and metrics over the prompts."""
    out = {}
    for scale in SCALES:
        root = tmp_path_factory.mktemp(f"matched_{scale}")
        target, draft = build_matched_pair(TARGET, DRAFT, PairSpec(scale=scale), vocab_size=VOCAB_SIZE)
        paths = []
        for name, model in (("target", target), ("draft", draft)):
            model.save_pretrained(root / name)
            build_tokenizer().save_pretrained(root / name)
            paths.append(str(root / name))
        with LLM(*paths, mode="sd", k=K, max_num_seqs=6) as llm:
            outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
            out[scale] = {"paths": paths, "tokens": [o.token_ids for o in outputs], "metrics": llm.metrics()}
    return out


def test_acceptance_falls_as_the_scale_grows(runs):
    rates = [runs[s]["metrics"]["acceptance_rate"] for s in SCALES]
    per_round = [runs[s]["metrics"]["tokens_per_round"] for s in SCALES]
    assert rates[0] > rates[1] + 0.1 > rates[2] + 0.2, rates
    assert per_round[0] > per_round[1] + 0.3 > per_round[2] + 0.6, per_round


def test_greedy_output_equals_hugging_face_generate(runs, prompts):
    """The engine runs the built target unchanged: sd's greedy output is the target's own, at
    every scale, through accepted and rejected drafts alike."""
    for scale in SCALES:
        run = runs[scale]
        assert run["tokens"] == hf_greedy(run["paths"][0], prompts, MAX_TOKENS), scale
        assert 0 < run["metrics"]["accepted_tokens"] < run["metrics"]["draft_tokens"]


def test_the_layers_write_what_the_scale_asks():
    """The calibrated perturbation of the residual stream, against the embedding, is the scale."""
    _, previous = shared_map(VOCAB_SIZE, 1, seed=0)
    probe = successor_path(previous[0], torch.tensor([3, 40, 97]), 48)
    for scale in (0.0, 0.5):
        target, draft = build_matched_pair(TARGET, DRAFT, PairSpec(scale=scale), vocab_size=VOCAB_SIZE)
        for model in (target, draft):
            assert perturbation_rms(model, probe) == pytest.approx(scale, abs=0.1 * scale + 1e-6)
        assert not target.config.tie_word_embeddings and not draft.config.tie_word_embeddings


def test_acceptance_by_position_counts_rounds_as_greedy_sd_runs_them():
    # K = 2 over 5 tokens: a round accepts [T, T] (+ bonus: 3 tokens), then [F] (1), then [T, F] (2).
    matches = [[True, True, False, False, True, False, False, False]]
    got = acceptance_by_position(matches, n=5, k=2)
    assert got["rate_at_position"] == [pytest.approx(2 / 3, abs=1e-4), 0.5]
    assert got["share_of_rounds_beyond"] == [pytest.approx(2 / 3, abs=1e-4), pytest.approx(1 / 3, abs=1e-4)]
    assert got["tokens_per_round"] == pytest.approx(5 / 3, abs=1e-4)
