"""bad_words under speculation: each position refuses the tokens that would complete a word after
that position's own history (the output so far plus the earlier drafts of the speculation).

1. greedy output equals Hugging Face `generate` with its NoBadWordsLogitsProcessor, in ar, sd and
   ssd (a 2-worker pool, whose drafters mask the words too: ssd/drafting/tree_adjustments.py);
2. sampled output follows the masked distribution (chi-square of the first two tokens, a
   two-token word making the second token's mask depend on the first), and the check fails on a
   version whose masks ignore the speculation's earlier drafts;
3. bad values are refused naming the field.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from refimpl import chi_square_p
from test_penalties import ENGINES, SAMPLED
from test_sampling_exactness import P_MIN, PROMPT, model_dirs, sample_first_two  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, NoBadWordsLogitsProcessor

import ssd.processing.token_masks
from ssd import LLM, SamplingParams
from ssd.processing.bad_words import word_tokens

GREEDY_PROMPT = "def add(a, b):\n    return"
WORDS = ["self", "(", " de"]


def hf_greedy_without(path: str, prompt: str, words: list[str], max_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    eos = model.generation_config.eos_token_id
    processors = []
    if words:
        processors.append(NoBadWordsLogitsProcessor([list(w) for w in word_tokens(tok, words)], eos))
    gen = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_tokens,
        logits_processor=LogitsProcessorList(processors),
    )
    return gen[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("mode", list(ENGINES))
def test_greedy_without_the_words_equals_hf_generate(demo_pair, mode):
    # Hugging Face looks for a word across the prompt too, vLLM (and this engine) in the output
    # only; this prompt ends with no word's beginning, so both agree here.
    want = hf_greedy_without(demo_pair[0], GREEDY_PROMPT, WORDS, 40)
    plain = hf_greedy_without(demo_pair[0], GREEDY_PROMPT, [], 40)
    assert want != plain  # the words change the output (else this test shows nothing)
    params = SamplingParams(temperature=0.0, max_tokens=40, bad_words=WORDS)
    with LLM(*demo_pair, **ENGINES[mode]) as llm:
        out = llm.generate(GREEDY_PROMPT, params)[0]
    assert out.token_ids == want
    assert "self" not in out.text and "(" not in out.text
    if mode != "ar":  # speculation stays on
        assert out.metrics["tokens_per_round"] > 1.5


def masked(probs: np.ndarray, words: tuple[tuple[int, ...], ...], output: list[int]) -> np.ndarray:
    """The reference: probabilities with every word-completing token removed, renormalized.
    Written apart from ssd/processing/bad_words.py on purpose."""
    probs = probs.copy()
    for word in words:
        *head, last = word
        if not head or (len(output) >= len(head) and output[len(output) - len(head) :] == head):
            probs[last] = 0.0
    return probs / probs.sum()


def target_probs(target, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([ids])).logits[0, -1].double()
    return torch.softmax(logits, -1).numpy()


def chosen_words(target, prompt: list[int]) -> list[str]:
    """A one-byte word (the second likeliest printable first byte: refused everywhere) and a
    two-byte word (the likeliest first byte, then its likeliest printable follower: refused
    only at the second position, and only after that first byte)."""
    printable = np.zeros(258, dtype=bool)
    printable[33:127] = True
    p1 = np.where(printable, target_probs(target, prompt), 0.0)
    first, single = np.argsort(-p1)[:2]
    follower = int(np.argmax(np.where(printable, target_probs(target, prompt + [int(first)]), 0.0)))
    return [chr(single), chr(first) + chr(follower)]


def run_and_check(model_dirs, mode: str) -> None:  # noqa: F811
    target = AutoModelForCausalLM.from_pretrained(model_dirs["target"], local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["target"], local_files_only=True)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    words = chosen_words(target, prompt)
    params = SamplingParams(temperature=1.0, bad_words=words)
    with LLM(model_dirs["target"], model_dirs["close"], max_num_seqs=4096, **dict(SAMPLED[mode], k=3)) as llm:
        prompt, outs = sample_first_two(llm, params, seed_base=700_000, n=3000)
    ids = word_tokens(tokenizer, words)
    first = np.array([o.token_ids[0] for o in outs])
    second = np.array([o.token_ids[1] for o in outs])
    p1 = masked(target_probs(target, prompt), ids, [])
    assert chi_square_p(np.bincount(first, minlength=len(p1)), p1) > P_MIN
    top = ord(words[1][0])  # the two-byte word's first byte: its second byte is refused next
    assert (first == top).sum() >= 300, Counter(first.tolist()).most_common(3)
    p2 = masked(target_probs(target, prompt + [top]), ids, [top])
    assert chi_square_p(np.bincount(second[first == top], minlength=len(p2)), p2) > P_MIN


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sampled_output_follows_the_masked_distribution(model_dirs, mode):  # noqa: F811
    run_and_check(model_dirs, mode)


def test_the_check_fails_when_masks_ignore_the_earlier_drafts(model_dirs, monkeypatch):  # noqa: F811
    real = ssd.processing.token_masks.token_masks

    def round_start_only(seqs, drafted, vocab, last_only=False):
        # Every position masked with the history of the round's start (the drafts left out).
        at_start = real(seqs, drafted[:, :0], vocab, True)
        return at_start if last_only else at_start.expand(-1, drafted.shape[1] + 1, -1)

    monkeypatch.setattr("ssd.processing.round_adjustments.token_masks", round_start_only)
    monkeypatch.setattr("ssd.drafting.sd_proposer.token_masks", round_start_only)
    with pytest.raises(AssertionError, match="zero probability"):  # the refused byte after the word's first
        run_and_check(model_dirs, "sd")


@pytest.mark.parametrize(
    "words,match",
    [([""], "non-blank"), (["  "], "non-blank"), (["x" * 257], "at most 256"), (["w"] * 65, "at most 64")],
)
def test_bad_values_are_refused(words, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(bad_words=words)
