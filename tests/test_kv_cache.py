"""The batch KV cache: rollback, packing, row selection and merging are exact."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

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


def test_compact_select_and_extend_preserve_rows(tiny_pair):
    runner = _runner(tiny_pair[0])
    gen = torch.Generator().manual_seed(1)
    a = runner.new_cache()
    rows_a = torch.randint(0, 256, (2, 6), generator=gen)
    runner.forward(a, rows_a)
    a.drop_last(torch.tensor([3, 1]))
    a.compact()
    assert a.num_columns == 5 and a.lengths().tolist() == [3, 5]
    b = runner.new_cache()
    rows_b = torch.randint(0, 256, (1, 8), generator=gen)
    runner.forward(b, rows_b)
    a.extend(b)
    a.select(torch.tensor([2, 0]))
    histories = [rows_b[0].tolist(), rows_a[0, :3].tolist()]
    nxt = torch.randint(0, 256, (2, 1), generator=gen)
    logits = runner.forward(a, nxt)[:, -1]
    for i, h in enumerate(histories):
        torch.testing.assert_close(logits[i], _fresh_logits(runner, h + [int(nxt[i])]), atol=1e-4, rtol=1e-4)


def test_append_grows_in_place_and_rollback_reuses_the_room(tiny_pair):
    """Regression (cost): every forward copied each layer's whole cache (torch.cat). Appends now
    write into spare room; a rollback keeps the buffer, and the next forward overwrites the
    dropped columns, with the same logits as a fresh forward."""
    runner = _runner(tiny_pair[0])
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (1, 12), generator=gen).tolist()[0]
    cache = runner.new_cache()
    runner.forward(cache, torch.tensor([prompt]))
    layer = cache.hf_cache.layers[0]
    start = layer.keys.data_ptr()
    spec = torch.randint(0, 256, (1, 3), generator=gen)
    runner.forward(cache, spec)
    assert layer.keys.data_ptr() == start and layer.keys.shape[2] == 15
    cache.drop_last(torch.tensor([3]))
    nxt = torch.randint(0, 256, (1, 2), generator=gen)
    out = runner.forward(cache, nxt)
    assert layer.keys.data_ptr() == start, "the rollback and the next append reuse the buffer"
    torch.testing.assert_close(out[0, -1], _fresh_logits(runner, prompt + nxt[0].tolist()), atol=1e-5, rtol=0)
    # Past the spare room the layer moves to a larger buffer, keeping every column.
    long = torch.randint(0, 256, (1, 100), generator=gen)
    out = runner.forward(cache, long)
    assert layer.keys.shape[2] == 114
    history = prompt + nxt[0].tolist() + long[0].tolist()
    torch.testing.assert_close(out[0, -1], _fresh_logits(runner, history), atol=1e-5, rtol=0)


def test_uniform_rollback_crops_and_matches_the_masking_rollback(tiny_pair):
    """Dropping the same number of newest columns from every row, all of them valid, crops them
    (the buffer stays, later appends reuse it); any other rollback masks columns. Both give the
    cache a fresh forward of the kept tokens would give."""
    runner = _runner(tiny_pair[0])
    gen = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 256, (2, 6), generator=gen)
    cache = runner.new_cache()
    runner.forward(cache, rows)
    layer = cache.hf_cache.layers[0]
    start = layer.keys.data_ptr()
    runner.forward(cache, torch.randint(0, 256, (2, 4), generator=gen))
    cache.drop_last(torch.tensor([4, 4]))
    assert cache.num_columns == 6 and bool(cache.valid.all()) and layer.keys.shape[2] == 6
    # A tail with a hole (row 1 rolled back one more) takes the masking path.
    spec = torch.randint(0, 256, (2, 3), generator=gen)
    runner.forward(cache, spec)
    cache.drop_last(torch.tensor([1, 2]))
    cache.drop_last(torch.tensor([1, 1]))
    assert cache.lengths().tolist() == [7, 6] and cache.num_columns == 7
    nxt = torch.randint(0, 256, (2, 1), generator=gen)
    logits = runner.forward(cache, nxt)[:, -1]
    assert layer.keys.data_ptr() == start
    histories = [rows[0].tolist() + spec[0, :1].tolist(), rows[1].tolist()]
    for i, h in enumerate(histories):
        torch.testing.assert_close(logits[i], _fresh_logits(runner, h + [int(nxt[i])]), atol=1e-4, rtol=1e-4)


def test_prebuilt_mask_equals_the_mask_from_visibility(tiny_pair):
    """A caller may build the additive mask once (the drafter's tree) and pass it as attn_mask:
    the forward is the one that within/history describe."""
    runner = _runner(tiny_pair[0])
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (2, 5), generator=gen)
    a, b = runner.new_cache(), runner.new_cache()
    runner.forward(a, prompt)
    runner.forward(b, prompt)
    eye = torch.eye(3, dtype=torch.bool).expand(2, 3, 3)
    history = torch.ones(2, 3, 5, dtype=torch.bool)
    history[:, 1:, -1] = False
    tokens = torch.randint(0, 256, (2, 3), generator=gen)
    positions = torch.full((2, 3), 5)
    mask = a.attention_mask(torch.ones(2, 3, dtype=torch.bool), eye, runner.attention_dtype, history)
    got = runner.forward(a, tokens, positions=positions, attn_mask=mask)
    want = runner.forward(b, tokens, positions=positions, within=eye, history=history)
    assert torch.equal(got, want)
