"""What structured output costs per round, and how the grammar engines compare on this CPU.

    python -m benchmarks.grammar_cost [--large-vocab 128256] [--out bench_results/grammar_cost.json]

Two tokenizers: the demo pair's (258 byte tokens) and a byte-level BPE of 128256 tokens trained
here on synthetic text (no hub download; Llama 3's vocabulary size, not its merges). For each:
- `round_ms`: ssd/processing/grammar.py's `grammar_masks` for a verification of K = 6 draft tokens
  (7 masks a row, walked and rolled back, unpacked to [b, 7, V] bool) at batch 1 and 8, mid-way
  through a JSON document;
- `tree_ms`: an SSD drafter's grammar work for one round at batch 1 and 8 (ssd/drafting/
  draft_grammars.py): the fork's masks, a matcher per branch (12 a row), K depths of branch
  masks and of applying them to the draft logits;
- `engines`: per-token mask time of each candidate grammar engine that is installed (llguidance
  always; xgrammar and outlines-core when a user installs them), its compile time, and whether
  a matcher state forks (deep copy) or rolls back, which SSD's tree of outcomes needs.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time

import torch

from ssd.bench.report import write_json
from ssd.core.sampling import SequenceSampling
from ssd.drafting.draft_grammars import DraftGrammars, masked
from ssd.processing.grammar import GrammarCompiler, grammar_masks
from ssd.processing.structured import StructuredOutputs

logger = logging.getLogger(__name__)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], "ok": True})
K = 6


def large_tokenizer(vocab: int = 128256):
    """A byte-level BPE of `vocab` tokens, trained on random words and JSON snippets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rnd = random.Random(0)
    words = [
        "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 12))) for _ in range(400_000)
    ]
    corpus = [" ".join(words[i : i + 50]) + " " + DOCUMENT for i in range(0, len(words), 50)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def round_ms(tokenizer, batch: int, repeats: int = 20) -> dict:
    """Mean ms of one verification's masks for `batch` rows, each mid-way through DOCUMENT
    (`masks`), and of applying them to [b, K + 1, V] logits (`apply`)."""
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_id)
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    half = len(ids) // 2
    matchers = []
    for _ in range(batch):
        matcher = compiler.matcher(StructuredOutputs(json=SCHEMA))
        assert matcher.consume_tokens(ids[:half])
        matchers.append(matcher)
    drafted = torch.tensor([ids[half : half + K]] * batch)
    masks = grammar_masks(matchers, drafted, vocab)  # warm
    started = time.perf_counter()
    for _ in range(repeats):
        grammar_masks(matchers, drafted, vocab)
    masks_ms = 1e3 * (time.perf_counter() - started) / repeats
    logits = torch.randn(batch, K + 1, vocab)
    started = time.perf_counter()
    for _ in range(repeats):
        logits.masked_fill(~masks, float("-inf"))  # what Adjustments.apply does with them
    return {"masks": masks_ms, "apply": 1e3 * (time.perf_counter() - started) / repeats}


def tree_ms(tokenizer, batch: int, fanout: tuple[int, ...] = (4, 2, 2, 2, 2), repeats: int = 5) -> dict:
    """Mean ms of an SSD drafter's grammar work for one round of `batch` rows mid-way through
    DOCUMENT: the walk along s_T and the fork's masks (`fork`), a matcher per branch copied from
    that walk (`branches`), K depths of branch masks and advances (`depths`) and of
    applying those masks to the [b, N, V] draft logits on the host (`apply`), with up to
    sum(fanout) branches a row (candidates the grammar allows)."""
    vocab = len(tokenizer)
    grammars = DraftGrammars(lambda: tokenizer, vocab)
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    half = len(ids) // 2
    text = StructuredOutputs(json=SCHEMA).grammar_text()
    for seq in range(batch):
        grammars.admit(seq, SequenceSampling(1.0, 0, 1.0, text, 0, tokenizer.eos_token_id), ids[:half])
    seqs, spec = list(range(batch)), [ids[half : half + K]] * batch
    grammars.fork_masks(grammars.spines(seqs, spec), K + 1)  # warm: the first masks build the grammar's lexer
    totals = {"fork": 0.0, "branches": 0.0, "depths": 0.0, "apply": 0.0}
    for _ in range(repeats):
        started = time.perf_counter()
        spines = grammars.spines(seqs, spec)
        allowed = grammars.fork_masks(spines, K + 1)
        forked = time.perf_counter()
        grid = [(k, int(t)) for k, f in enumerate(fanout) for t in allowed[0, k].nonzero().flatten()[:f]]
        cand = torch.tensor([[t for _, t in grid]] * batch)
        outcome = torch.tensor([[k for k, _ in grid]] * batch)
        branches = grammars.branches(spines, cand, outcome, allowed)
        built = time.perf_counter()
        logits = torch.randn(*cand.shape, vocab)
        for _ in range(K):
            mark = time.perf_counter()
            masks = branches.masks()
            totals["depths"] += time.perf_counter() - mark
            mark = time.perf_counter()
            masked(logits, masks)  # what the tree does to each depth's draft logits
            totals["apply"] += time.perf_counter() - mark
            first = masks.view(-1, vocab).to(torch.uint8).argmax(-1).view(batch, -1)  # a token each may take
            mark = time.perf_counter()
            branches.advance(first)
            totals["depths"] += time.perf_counter() - mark
        for part, seconds in (("fork", forked - started), ("branches", built - forked)):
            totals[part] += seconds
    return {part: 1e3 * seconds / repeats for part, seconds in totals.items()}


def _timed_masks(fill, advance, ids) -> float:
    """Mean ms per token of fill() along ids (advance(t) after each)."""
    total = 0.0
    for token in ids:
        started = time.perf_counter()
        fill()
        total += time.perf_counter() - started
        advance(token)
    return 1e3 * total / len(ids)


def llguidance_engine(tokenizer, ids) -> dict:
    import llguidance.hf
    import llguidance.torch as llt

    lltok = llguidance.hf.from_tokenizer(tokenizer)
    started = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compile_ms = 1e3 * (time.perf_counter() - started)
    bits = llt.allocate_token_bitmask(1, lltok.vocab_size)
    mask_ms = _timed_masks(lambda: llt.fill_next_token_bitmask(matcher, bits, 0), matcher.consume_token, ids)
    return {"compile_ms": compile_ms, "mask_ms_per_token": mask_ms, "fork": True, "rollback": True}


def xgrammar_engine(tokenizer, ids) -> dict:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    started = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=16)
    compile_ms = 1e3 * (time.perf_counter() - started)
    bits = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    mask_ms = _timed_masks(lambda: matcher.fill_next_token_bitmask(bits, 0), matcher.accept_token, ids)
    return {"compile_ms": compile_ms, "mask_ms_per_token": mask_ms, "fork": False, "rollback": True}


def outlines_core_engine(tokenizer, ids) -> dict:
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    words: dict[str, list[int]] = {}
    for piece, token in tokenizer.get_vocab().items():
        if token != tokenizer.eos_token_id:
            words.setdefault(tokenizer.convert_tokens_to_string([piece]), []).append(token)
    started = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(tokenizer.eos_token_id, words))
    compile_ms = 1e3 * (time.perf_counter() - started)
    state = [index.get_initial_state()]

    def advance(token: int) -> None:
        state[0] = index.get_next_state(state[0], token)

    mask_ms = _timed_masks(lambda: index.get_allowed_tokens(state[0]), advance, ids)
    # A state is an integer: forking is copying it, but there is no recursion (a regex index).
    return {"compile_ms": compile_ms, "mask_ms_per_token": mask_ms, "fork": True, "rollback": True}


ENGINES = {"llguidance": llguidance_engine, "xgrammar": xgrammar_engine, "outlines-core": outlines_core_engine}


def measure(name: str, tokenizer) -> dict:
    ids = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    row: dict = {"tokenizer": name, "vocab": len(tokenizer), "document_tokens": len(ids)}
    row["round_ms"] = {f"b{b}": round_ms(tokenizer, b) for b in (1, 8)}
    row["tree_ms"] = {f"b{b}": tree_ms(tokenizer, b) for b in (1, 8)}
    row["engines"] = {}
    for engine, run in ENGINES.items():
        try:
            row["engines"][engine] = run(tokenizer, ids)
        except ImportError:
            row["engines"][engine] = "not installed"
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--large-vocab", type=int, default=128256, help="the trained BPE's vocabulary size; 0 measures the demo's only"
    )
    parser.add_argument("--out", default="bench_results/grammar_cost.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from ssd.model.demo_models import build_tokenizer

    torch.set_num_threads(1)
    rows = [measure("demo", build_tokenizer())]
    if args.large_vocab:
        logger.info("training a %d-token BPE (a minute or two at 128k)", args.large_vocab)
        rows.append(measure(f"bpe-{args.large_vocab}", large_tokenizer(args.large_vocab)))
    for row in rows:
        logger.info(
            "%s (V=%d), ms per verification (K=%d): %s",
            row["tokenizer"],
            row["vocab"],
            K,
            {b: {part: round(ms, 3) for part, ms in parts.items()} for b, parts in row["round_ms"].items()},
        )
        logger.info(
            "  an SSD drafter's grammar work per round (%d branches a row, K=%d): %s",
            12,
            K,
            {b: {part: round(ms, 3) for part, ms in parts.items()} for b, parts in row["tree_ms"].items()},
        )
        for engine, result in row["engines"].items():
            logger.info(
                "  %-14s %s",
                engine,
                result
                if isinstance(result, str)
                else {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()},
            )
    write_json(args.out, rows)


if __name__ == "__main__":
    main()
