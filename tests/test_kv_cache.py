"""The batch KV cache: rollback, packing, row selection and merging are exact."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from ssd.runner import ModelRunner


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
