"""Stop strings, stop tokens, EOS, max_tokens, context length, and streaming deltas; the
incremental output text against the former path that decoded the whole output at every token."""

from __future__ import annotations

import random

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.core.sequence import Sequence
from ssd.engine.stopping import StopChecker
from ssd.model.demo_models import EOS_ID, PAD_ID, build_tokenizer


@pytest.fixture(scope="module")
def llm(tiny_pair):
    return LLM(*tiny_pair, mode="sd", k=4)


def test_stop_string_truncates_text_at_first_occurrence(llm):
    free = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    stop = free.text[10:12]
    assert stop and free.text.find(stop) >= 0
    out = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[: free.text.find(stop)]
    # The tokens stop with the one that completed the stop string: a prefix of the free run.
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert llm.tokenizer.decode(out.token_ids).endswith(stop) or stop in llm.tokenizer.decode(out.token_ids)
    kept = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    with_stop = llm.generate("def f(x):", kept)[0]
    assert with_stop.token_ids == out.token_ids and with_stop.text == out.text + stop
    streamed = "".join(c.delta_text for c in llm.generate_stream("def f(x):", kept))
    assert streamed == with_stop.text


def test_stop_token_id_and_max_tokens(llm):
    free = llm.generate("import", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    target = free.token_ids[7]
    out = llm.generate(
        "import", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[target])
    )[0]
    first = free.token_ids.index(target)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"


def test_eos_ends_unless_ignored(tiny_pair):
    # The test edits the loaded weights in place; packed copies (made at load) would not see that.
    llm = LLM(*tiny_pair, mode="ar", pack_target_weights=False)
    eos = llm.engine.stopper.eos_token_id
    # Make EOS the greedy choice after any input by biasing the target's output layer.
    with torch.no_grad():
        llm.engine.target.model.lm_head.weight[eos].fill_(0.0)
        llm.engine.target.model.lm_head.bias = None
        llm.engine.target.model.lm_head.weight[eos] += 50 * llm.engine.target.model.model.norm.weight.sign()
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=10))[0]
    assert out.token_ids[-1] == eos and out.finish_reason == "stop" and len(out.token_ids) < 10
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_context_length_is_never_exceeded(tiny_pair):
    llm = LLM(*tiny_pair, mode="sd", k=6, max_model_len=24)
    prompt = "0123456789"
    out = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True, seed=3))[0]
    assert len(out.token_ids) == 14


def test_stream_deltas_add_up_to_final_output(llm):
    params = SamplingParams(temperature=0.8, max_tokens=40, seed=11, stop=["\n\n"])
    final = llm.generate("class A:", params)[0]
    chunks = list(llm.generate_stream("class A:", params))
    assert chunks[-1].finished and all(not c.finished for c in chunks[:-1])
    assert "".join(c.delta_text for c in chunks) == final.text
    assert sum((c.delta_token_ids for c in chunks), []) == final.token_ids


def test_stream_holds_back_partial_stop_string(llm):
    free = llm.generate("x = ", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    stop = free.text[5:9]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    sent = ""
    for chunk in llm.generate_stream("x = ", params):
        sent += chunk.delta_text
        assert stop not in sent
    assert sent == free.text[: free.text.find(stop)]


def test_generate_returns_only_its_own_requests(llm):
    """Regression: requests added to the engine directly used to count toward generate()'s
    completion, which then failed looking up its own unfinished outputs."""
    llm.engine.add_request("other", SamplingParams(max_tokens=2, temperature=0))
    outs = llm.generate("mine", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert len(outs) == 1 and outs[0].prompt_token_ids == list(b"mine") and len(outs[0].token_ids) == 20
    while llm.engine.has_unfinished():
        llm.engine.step()


# ---- incremental decoding: exact against decoding the whole output at every token ----------


class RefStopChecker(StopChecker):
    """The former checker, kept as the reference: the whole output decoded at every token."""

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self.decode(seq.output_ids)
        longest = max(len(s) for s in seq.params.stop)
        window_start = max(0, len(text) - len(self.decode(seq.output_ids[-1:])) - longest)
        hits = [(text.find(s, window_start), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.stop_text = stop
        seq.truncated_text = text[:index]
        return True

    def text(self, seq: Sequence) -> str:
        return seq.truncated_text if seq.truncated_text is not None else self.decode(seq.output_ids)

    def streamable_end(self, seq: Sequence, text: str) -> int:
        if seq.finished:
            return len(text)
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        for stop in seq.params.stop:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if text[end - n : end] == stop[:n]:
                    end -= n
                    break
        return end


def _sentencepiece_like_tokenizer():
    """Llama-style decoding: byte fallback, and the first token's leading space dropped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for word in ["▁", "▁a", "▁the", "b", "ing", ".", "é"]:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _byte_pieces() -> list[list[int]]:
    """Tokens of the byte-level tokenizer: ASCII, characters of 2-4 bytes (one token per byte,
    so they arrive split), bytes that never complete a character, EOS and PAD."""
    chars = [list(c.encode()) for c in "ab \n.é€😀中"]
    return chars + [[0x80], [0xFF], [0xE2, 0x82], [EOS_ID], [PAD_ID]]


def _sentencepiece_pieces(tok) -> list[list[int]]:
    vocab = tok.get_vocab()
    words = [[vocab[w]] for w in ["▁", "▁a", "▁the", "b", "ing", ".", "é"]]
    fallback = [[vocab[f"<0x{b:02X}>"] for b in c.encode()] for c in "€😀ñ"] + [[vocab["<0xFF>"]], [vocab["<0xE2>"]]]
    return words + fallback + [[0], [1], [2]]


def _old_output(checker: RefStopChecker, seq: Sequence) -> tuple:
    """What the engine's output carried, computed the former way."""
    text = checker.text(seq)
    end = checker.streamable_end(seq, text)
    delta = text[seq.sent_text : end] if end > seq.sent_text else ""
    seq.sent_text = max(seq.sent_text, end)
    return text, delta, seq.finish_reason, list(seq.output_ids)


def _new_output(checker: StopChecker, seq: Sequence) -> tuple:
    out = checker.output(seq)
    return out.text, out.delta_text, seq.finish_reason, out.token_ids


def _run(checker, output, tokens: list[int], rounds: list[int], params: SamplingParams) -> list[tuple]:
    seq = Sequence(0, "r", [1], params, torch.Generator())
    outs, pos = [], 0
    for size in rounds:
        checker.append(seq, tokens[pos : pos + size])
        pos += size
        outs.append(output(checker, seq))
        if seq.finished:
            break
    return outs


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like"])
def test_incremental_text_equals_decoding_everything(kind):
    """Random outputs, rounds of random size, with and without stop strings (stop strings drawn
    from the text itself, so they are hit, also inside multi-byte characters and U+FFFD)."""
    tok = build_tokenizer() if kind == "byte_level" else _sentencepiece_like_tokenizer()
    pieces = _byte_pieces() if kind == "byte_level" else _sentencepiece_pieces(tok)
    rng = random.Random(0)
    stopped = 0
    for case in range(300):
        tokens = [t for _ in range(rng.randint(1, 60)) for t in rng.choice(pieces)]
        rounds = [rng.randint(1, 7) for _ in range(len(tokens))]
        full = tok.decode(tokens, skip_special_tokens=True)
        stop = []
        if case % 3 and len(full) > 2:
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(len(full))
                stop.append(full[at : at + rng.randint(1, 4)])
        params = SamplingParams(ignore_eos=True, max_tokens=len(tokens), stop=stop)
        expected = _run(RefStopChecker(tok, EOS_ID, 10**6), _old_output, tokens, rounds, params)
        got = _run(StopChecker(tok, EOS_ID, 10**6), _new_output, tokens, rounds, params)
        if kind == "byte_level":
            assert got == expected, (tokens, stop)
        else:
            # Streaming now holds back an open run of byte-fallback pieces, which the decoder
            # may still turn into U+FFFDs: the former deltas did not always add up to the text.
            assert [(o[0], o[2], o[3]) for o in got] == [(o[0], o[2], o[3]) for o in expected], (tokens, stop)
        assert "".join(o[1] for o in got) == got[-1][0]  # deltas add up to the final text
        stopped += got[-1][2] is not None and len(got[-1][3]) < len(tokens)
        if not stop:
            assert got[-1][0] == full
    assert stopped > 100


def test_greedy_output_with_stop_strings_unchanged(tiny_pair, llm):
    """Through ssd.LLM, sd and ssd with the fast backup: tokens, text and streamed deltas are what
    the former whole-output decoding gives on the free run."""
    base = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    free = llm.generate(["def f(x):", "import os\n"], base)
    reference = RefStopChecker(llm.tokenizer, llm.engine.stopper.eos_token_id, 10**6)
    with LLM(*tiny_pair, mode="ssd", k=4, ssd_backup="fast", draft_transport="inprocess") as ssd:
        for prompt, out in zip(["def f(x):", "import os\n"], free):
            for at in (3, 17, 40):
                params = base.model_copy(update={"stop": [out.text[at : at + 2], out.text[at + 5 : at + 8]]})
                expected = _run(reference, _old_output, out.token_ids, [1] * len(out.token_ids), params)[-1]
                for engine in (llm, ssd):
                    got = engine.generate(prompt, params)[0]
                    assert (got.text, got.token_ids, got.finish_reason) == (expected[0], expected[3], "stop")
                    # The same stream, replayed round by round (delta_token_ids) the former way.
                    seq = Sequence(0, "r", [1], params, torch.Generator())
                    for chunk in engine.generate_stream(prompt, params):
                        reference.append(seq, chunk.delta_token_ids)
                        assert chunk.delta_text == _old_output(reference, seq)[1]
        assert ssd.metrics()["backup_fast_rounds"] > 0
