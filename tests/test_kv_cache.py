"""The static KV cache: rollback, row selection, admission in place and scratch forwards are exact,
and its buffers are allocated once per size."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from ssd.model.kv_cache import additive_mask
from ssd.model.runner import ModelRunner


def _runner(path):
    return ModelRunner(AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval(), torch.device("cpu"))


def _fresh_logits(runner, ids: list[int]) -> torch.Tensor:
    """Logits of the last token of ids, computed from an empty cache."""
    cache = runner.new_cache()
    return runner.forward(cache, torch.tensor([ids]))[0, -1]


def test_rollback_with_holes_matches_fresh_forward(tiny_pair):
    runner = _runner(tiny_pair[0])
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 9, 2)]
    cache = runner.new_cache()
    width = max(map(len, rows))
    tokens = torch.zeros(3, width, dtype=torch.long)
    valid = torch.zeros(3, width, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
        valid[i, : len(r)] = True
    runner.forward(cache, tokens, valid)
    # Append 4 speculative tokens to every row, then keep 0, 2 and 4 of them.
    spec = torch.randint(0, 256, (3, 4), generator=gen)
    runner.forward(cache, spec)
    keep = torch.tensor([0, 2, 4])
    cache.drop_last(4 - keep)
    assert cache.lengths().tolist() == [len(r) + int(k) for r, k in zip(rows, keep)]
    histories = [r + spec[i, : int(keep[i])].tolist() for i, r in enumerate(rows)]
    nxt = torch.randint(0, 256, (3, 1), generator=gen)
    logits = runner.forward(cache, nxt)[:, -1]
    for i, h in enumerate(histories):
        torch.testing.assert_close(logits[i], _fresh_logits(runner, h + [int(nxt[i])]), atol=1e-4, rtol=1e-4)


def test_keep_and_add_rows_preserve_rows(tiny_pair):
    """Dropping rows moves the kept ones to the front; admitted rows are prefilled in place
    through a window; every row's next logits are those of a fresh forward of its history."""
    runner = _runner(tiny_pair[0])
    gen = torch.Generator().manual_seed(1)
    cache = runner.new_cache(4)
    rows_a = torch.randint(0, 256, (2, 6), generator=gen)
    runner.forward(cache, rows_a)
    cache.drop_last(torch.tensor([3, 1]))
    assert cache.lengths().tolist() == [3, 5]
    rows_b = torch.randint(0, 256, (1, 8), generator=gen)
    window = cache.add_rows(1)
    runner.forward(window, rows_b)
    assert cache.batch_size == 3 and cache.lengths().tolist() == [3, 5, 8]
    cache.keep(torch.tensor([2, 0]))
    assert cache.lengths().tolist() == [8, 3]
    histories = [rows_b[0].tolist(), rows_a[0, :3].tolist()]
    nxt = torch.randint(0, 256, (2, 1), generator=gen)
    logits = runner.forward(cache, nxt)[:, -1]
    for i, h in enumerate(histories):
        torch.testing.assert_close(logits[i], _fresh_logits(runner, h + [int(nxt[i])]), atol=1e-4, rtol=1e-4)


def _buffer(cache):
    return cache._storage.layers[0][0]


def test_writes_in_place_and_grows_keeping_every_column(tiny_pair):
    """Forwards and rollbacks write into the same buffers; a forward past their columns moves
    them to larger ones (doubling), keeping every row's columns."""
    runner = _runner(tiny_pair[0])
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (1, 12), generator=gen).tolist()[0]
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor([prompt]))
    start, capacity = _buffer(cache).data_ptr(), cache.capacity
    runner.forward(cache, torch.randint(0, 256, (1, 3), generator=gen))
    cache.drop_last(torch.tensor([3]))
    nxt = torch.randint(0, 256, (1, 2), generator=gen)
    out = runner.forward(cache, nxt)
    assert _buffer(cache).data_ptr() == start and cache.capacity == capacity
    torch.testing.assert_close(out[0, -1], _fresh_logits(runner, prompt + nxt[0].tolist()), atol=1e-5, rtol=0)
    long = torch.randint(0, 256, (1, capacity[1]), generator=gen)
    out = runner.forward(cache, long)
    assert cache.capacity[1] >= 2 * capacity[1] and cache.lengths().tolist() == [14 + capacity[1]]
    history = prompt + nxt[0].tolist() + long[0].tolist()
    torch.testing.assert_close(out[0, -1], _fresh_logits(runner, history), atol=1e-4, rtol=0)


def test_growing_mid_tree_keeps_the_trees_columns(tiny_pair):
    """A tree's later depth may need more columns than the buffers have: they grow keeping the
    earlier depths' scratch columns past every row's length, which the later depth attends to
    (they were dropped, so the depth attended to zeroed keys: exact still, but fewer hits)."""
    runner = _runner(tiny_pair[0])
    gen = torch.Generator().manual_seed(4)
    cache = runner.new_cache()
    runner.forward(cache, torch.randint(0, 256, (1, 5), generator=gen))
    top = cache.capacity[1]  # the tree's first depth writes the buffers' last two columns
    first = (top - 2 + torch.arange(2)).view(1, 2)
    mask = torch.zeros(1, 1, 2, top, dtype=runner.attention_dtype)
    runner.forward(cache, torch.randint(0, 256, (1, 2), generator=gen), positions=torch.tensor([[5, 5]]),
                   attn_mask=mask, columns=first)  # fmt: skip
    written = _buffer(cache)[:, :, top - 2 : top].clone()
    mask = torch.zeros(1, 1, 2, top + 2, dtype=runner.attention_dtype)
    runner.forward(cache, torch.randint(0, 256, (1, 2), generator=gen), positions=torch.tensor([[6, 6]]),
                   attn_mask=mask, columns=first + 2)  # fmt: skip
    assert cache.capacity[1] > top, "the second depth grew the buffers"
    assert torch.equal(_buffer(cache)[:, :, top - 2 : top], written)
    assert cache.lengths().tolist() == [5]


def test_scratch_forward_commits_nothing(tiny_pair):
    """A tree's forward writes past every row's length at explicit columns and keeps nothing:
    the next forward is that of a cache that never saw it."""
    runner = _runner(tiny_pair[0])
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (2, 5), generator=gen)
    a, b = runner.new_cache(), runner.new_cache()
    runner.forward(a, prompt)
    runner.forward(b, prompt)
    a.drop_last(torch.tensor([0, 2]))
    b.drop_last(torch.tensor([0, 2]))
    lengths = a.lengths()
    history = (torch.arange(5).view(1, 1, 5) < lengths.view(2, 1, 1)).expand(2, 3, 5)
    allowed = torch.cat([history, torch.ones(2, 3, 3, dtype=torch.bool).tril()], dim=-1)
    mask = additive_mask(allowed, runner.attention_dtype).unsqueeze(1)
    tree = torch.randint(0, 256, (2, 3), generator=gen)
    runner.forward(a, tree, positions=lengths.view(2, 1) + torch.arange(3), attn_mask=mask,
                   columns=(5 + torch.arange(3)).expand(2, 3))  # fmt: skip
    assert torch.equal(a.lengths(), lengths)
    nxt = torch.randint(0, 256, (2, 2), generator=gen)
    assert torch.equal(runner.forward(a, nxt), runner.forward(b, nxt))


def test_buffers_stay_put_through_many_rounds(tiny_pair):
    """Memory flat by construction: after the first rounds, admissions, rollbacks and dropped
    rows of every length reuse the same buffers."""
    runner = _runner(tiny_pair[0])
    gen = torch.Generator().manual_seed(4)
    cache = runner.new_cache(4)
    runner.forward(cache, torch.randint(0, 256, (4, 40), generator=gen))
    first = (_buffer(cache).data_ptr(), cache.capacity, cache.nbytes())
    for step in range(60):
        spec = int(torch.randint(1, 8, (1,), generator=gen))
        runner.forward(cache, torch.randint(0, 256, (cache.batch_size, spec), generator=gen))
        cache.drop_last(torch.randint(0, spec, (cache.batch_size,), generator=gen))
        if step % 10 == 9:  # a sequence finishes and another is admitted
            cache.keep(torch.tensor([1, 2, 3]))
            runner.forward(cache.add_rows(1), torch.randint(0, 256, (1, 30), generator=gen))
    assert int(cache.lengths().max()) < cache.capacity[1]
    assert (_buffer(cache).data_ptr(), cache.capacity, cache.nbytes()) == first


def test_a_prefill_without_logits_fills_the_same_cache(tiny_pair):
    """with_logits=False skips the LM head (nobody reads a prefill's logits unless a request
    asks for prompt logprobs): the forward returns None and the next one sees the same cache."""
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], local_files_only=True).eval()
    prompt, nxt = torch.tensor([[5, 9, 2, 77, 31]]), torch.tensor([[12]])
    for lean in (True, False):  # the lean forward and Hugging Face's
        runner = ModelRunner(model, torch.device("cpu"), lean=lean)
        with_head, without = runner.new_cache(), runner.new_cache()
        assert runner.forward(with_head, prompt).shape == (1, 5, model.config.vocab_size)
        assert runner.forward(without, prompt, with_logits=False) is None
        assert without.lengths().tolist() == with_head.lengths().tolist() == [5]
        assert torch.equal(runner.forward(without, nxt), runner.forward(with_head, nxt))
