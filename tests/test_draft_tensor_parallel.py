"""A draft split over tensor-parallel ranks (draft_tensor_parallel_size, gloo on CPU): its forwards,
the tree decode's scratch forwards included, give the whole draft's logits; SD and SSD over a
split draft keep the output equal to Hugging Face `generate`; a worker's split draft runs its
ranks as the worker's children; bad sizes fail before anything starts, and no rank outlives the
engine."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from refimpl import hf_greedy

from ssd import LLM, SamplingParams
from ssd.core.config import EngineArgs
from ssd.model.kv_cache import additive_mask
from ssd.model.loader import load_draft, load_pair
from ssd.model.runner import draft_runner
from ssd.model.tensor_parallel import TensorParallelFailed, TensorParallelRunner

MAX_TOKENS = 32
RANK_NAME = "ssd-tp-rank"  # what a forked rank calls itself (ssd/model/tp_launch.py)


def _parent(pid: int) -> int:
    return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])


def _name(pid: int) -> str:
    text = (Path("/proc") / str(pid) / "stat").read_text()
    return text[text.index("(") + 1 : text.rindex(")")]


def _descendants() -> dict[int, str]:
    """pid -> name of every process below this one."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = _parent(int(entry.name))
            except OSError:  # it exited meanwhile
                continue
    found, frontier = {}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                try:
                    found[child] = _name(child)
                except OSError:
                    continue
                frontier.append(child)
    return found


def _ranks_below() -> set[int]:
    return {pid for pid, cmd in _descendants().items() if cmd == RANK_NAME}


@torch.inference_mode()
def test_a_split_drafts_forwards_equal_the_whole_drafts(demo_pair):
    """The draft's step kinds, through two ranks and through one: a prefill into a window of new
    rows, default forwards, a scratch forward at chosen columns and positions under a tree mask,
    and the rollbacks between them."""
    config = EngineArgs(mode="sd", draft_tensor_parallel_size=2).to_config()
    split = load_draft(config)
    try:
        whole = draft_runner(load_draft(EngineArgs(mode="sd").to_config()), "cpu", lean=True)
        assert isinstance(split, TensorParallelRunner) and split.attention_dtype == whole.attention_dtype
        caches = [runner.new_cache() for runner in (split, whole)]
        prompt = torch.tensor([[5, 9, 33, 70, 101], [7, 8, 12, 0, 0]])
        valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])

        def both(step):
            out = [step(runner, cache) for runner, cache in zip((split, whole), caches)]
            if out[0] is not None:
                torch.testing.assert_close(out[0], out[1], atol=1e-4, rtol=1e-4)
            return out[1]

        both(lambda r, c: r.forward(c.add_rows(2), prompt, valid))
        both(lambda r, c: r.forward(c, torch.tensor([[3, 4], [6, 0]]), torch.tensor([[True, True], [True, False]])))
        lengths = caches[1].lengths()
        assert caches[0].lengths().tolist() == lengths.tolist() == [7, 4]
        # A tree of 3 branches per row past each row's length, each seeing the committed columns
        # and its own, at positions of its own choosing.
        width = int(lengths.max()) + 3
        seen = torch.arange(width).view(1, 1, -1) < lengths.view(2, 1, 1)
        own = torch.zeros(2, 3, width, dtype=torch.bool)
        own[:, torch.arange(3), int(lengths.max()) + torch.arange(3)] = True
        mask = additive_mask(seen | own, whole.attention_dtype).unsqueeze(1)  # [b, 1, N, width]
        columns = (int(lengths.max()) + torch.arange(3)).expand(2, 3)
        positions = lengths.view(2, 1) + torch.tensor([[0, 1, 1]])
        feed = torch.tensor([[11, 12, 13], [14, 15, 16]])
        both(lambda r, c: r.forward(c, feed, positions=positions, attn_mask=mask, columns=columns))
        assert caches[0].lengths().tolist() == [7, 4]  # a scratch forward commits nothing
        both(lambda r, c: c.drop_last(torch.tensor([2, 1])))
        both(lambda r, c: c.keep(torch.tensor([1])))
        both(lambda r, c: r.forward(c, torch.tensor([[21, 22, 23]])))
    finally:
        split.close()
    assert not _ranks_below()


def test_sd_over_a_split_target_and_a_split_draft_matches_hf_generate(demo_pair):
    prompts = ["The quick brown fox", "x", "Once upon a time there was"]
    expected = hf_greedy(demo_pair[0], prompts, MAX_TOKENS)
    before = _ranks_below()
    llm = LLM(*demo_pair, mode="sd", k=4, max_num_seqs=3, tensor_parallel_size=2, draft_tensor_parallel_size=2)
    try:
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        assert [o.token_ids for o in out] == expected
        assert llm.metrics()["accepted_tokens"] > 0
        draft = llm.engine.proposers["sd"].runner
        assert isinstance(draft, TensorParallelRunner) and len(_ranks_below()) == 2  # one target, one draft rank
        # A draft rank that dies is seen while the engine is idle (a serving health check asks),
        # and fails the next round at once, naming the draft.
        assert llm.engine.broken() is None
        os.kill(draft.ranks.processes[1].pid, signal.SIGKILL)
        draft.ranks.processes[1].wait(10)
        assert "tensor-parallel draft: rank 1 exited with code -9" in llm.engine.broken()
        with pytest.raises(TensorParallelFailed, match="tensor-parallel draft failed .*rank 1 exited with code -9"):
            llm.generate("Once more", SamplingParams(temperature=0.0, max_tokens=8))
    finally:
        llm.close()
    assert _ranks_below() == before


def test_ssd_with_a_workers_split_draft_matches_hf_generate(demo_pair):
    """The worker process loads its draft over two ranks, forked by its own fork server; the
    engine, which runs no draft itself in ssd mode with workers, starts none."""
    prompts = ["The quick brown fox", "x", "Once upon a time there was"]
    expected = hf_greedy(demo_pair[0], prompts, MAX_TOKENS)
    with LLM(*demo_pair, mode="ssd", k=4, max_num_seqs=3, draft_tensor_parallel_size=2) as llm:
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        metrics = llm.metrics()
        (rank,) = _ranks_below()
        assert _name(_parent(_parent(rank))) == "ssd-draft-worke"  # the worker's server's child, not the engine's
    assert [o.token_ids for o in out] == expected
    assert metrics["cache_hits"] > 0, metrics
    assert not _ranks_below()


def test_an_ssd_engine_with_workers_loads_no_draft_of_its_own(demo_pair):
    pair = load_pair(EngineArgs(mode="ssd").to_config())
    assert pair.draft is None and pair.max_model_len == 2048  # the draft's config still limits the context
    assert load_pair(EngineArgs(mode="ssd", draft_transport="inprocess").to_config()).draft is not None


def test_draft_sizes_that_do_not_fit_fail_before_anything_starts(demo_pair):
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size=3 does not divide .* in \[1, 2, 4\]"):
        LLM(*demo_pair, mode="sd", draft_tensor_parallel_size=3)
    with pytest.raises(ValueError, match="reserve num_gpus >= 2 per worker"):
        EngineArgs(mode="ssd", draft_tensor_parallel_size=2, draft_worker_resources={"num_gpus": 1}).to_config()
    assert not _ranks_below()
