"""The lean forward computes what the Hugging Face forward computes, call by call, and the two
paths can share one cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ssd.model.demo_models import VOCAB_SIZE
from ssd.model.fast_forward import FastLlamaForward, can_pack, unsupported_reason
from ssd.model.kv_cache import additive_mask
from ssd.model.runner import ModelRunner, target_runner

# Same weights, same ops; the only differences are ulp-level (kernel blocking), far below this.
ATOL = 2e-5


def _tiny(kind: str):
    torch.manual_seed(1)
    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    if kind == "qwen2":  # q/k/v biases and grouped-query attention
        return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False)).eval()
    return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False)).eval()


def _script(runner: ModelRunner, cache) -> list[torch.Tensor]:
    """Padded prefill, a rollback, a plain step and a tree step with a custom mask."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 250, (2, 7), generator=gen)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 5:] = False
    out = [runner.forward(cache, tokens, valid)]
    out.append(runner.forward(cache, torch.randint(0, 250, (2, 3), generator=gen)))
    cache.drop_last(torch.tensor([2, 1]))
    out.append(runner.forward(cache, torch.randint(0, 250, (2, 1), generator=gen)))
    # A scratch step (a tree's): 4 branches written past the longest row, each seeing its own
    # column; branches 2 and 3 do not see their row's newest committed column.
    lengths = cache.lengths()
    top = int(lengths.max())
    history = torch.arange(top).view(1, 1, -1) < lengths.view(2, 1, 1)
    history = history.expand(2, 4, top).clone()
    history[torch.arange(2), 2:, lengths - 1] = False
    allowed = torch.cat([history, torch.eye(4, dtype=torch.bool).expand(2, 4, 4)], dim=-1)
    mask = additive_mask(allowed, runner.attention_dtype).unsqueeze(1)
    positions = lengths.view(2, 1) + torch.tensor([0, 0, -1, -1])
    columns = (top + torch.arange(4)).expand(2, 4)
    tokens = torch.randint(0, 250, (2, 4), generator=gen)
    out.append(runner.forward(cache, tokens, positions=positions, attn_mask=mask, columns=columns))
    assert torch.equal(cache.lengths(), lengths), "a scratch forward commits nothing"
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_lean_forward_matches_hugging_face(kind):
    model = _tiny(kind)
    assert unsupported_reason(model) is None
    lean, hf = ModelRunner(model, torch.device("cpu")), ModelRunner(model, torch.device("cpu"), lean=False)
    assert lean.lean is not None and hf.lean is None
    got, want = _script(lean, lean.new_cache()), _script(hf, hf.new_cache())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_matches_hugging_face(kind, dtype):
    """The fused, prepacked products (the drafter's always, the target's by default) (q/k/v and
    gate/up stacked, biases included) compute the same function; in float32 only the last bits
    may differ. In bfloat16 (where the lean forward attends in float32) both paths round
    differently, so each is held to the float32 model: ours must be about as close as Hugging
    Face's own bfloat16 forward."""
    model = _tiny(kind).to(dtype)
    fused, hf = ModelRunner(model, torch.device("cpu"), fused=True), ModelRunner(model, torch.device("cpu"), lean=False)
    layer = fused.lean.layers[0]
    assert layer.fused and layer.qkv.sizes == [64, 32, 32]
    # On this project's CPUs (AVX512) the oneDNN path is the one under test.
    assert (layer.qkv.packed is not None) == can_pack(model.lm_head.weight)
    got, want = _script(fused, fused.new_cache()), _script(hf, hf.new_cache())
    if dtype == torch.float32:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
        return
    full = ModelRunner(_tiny(kind), torch.device("cpu"), lean=False)
    exact = _script(full, full.new_cache())
    for g, w, e in zip(got, want, exact):
        ours, theirs = (g - e).abs().max().item(), (w - e).abs().max().item()
        assert ours <= 1.25 * theirs + 0.02, (ours, theirs)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_products_without_packing_share_the_modules_weights(kind, monkeypatch):
    """Where a weight cannot be packed (a GPU target), the fused products hold no copy: the
    modules' q, k, v and gate, up weights become views of the fused ones, so the model's weights
    take the same memory, and both forwards compute what they computed before."""
    from ssd.model import fast_forward

    model = _tiny(kind)
    hf = ModelRunner(model, torch.device("cpu"), lean=False)
    want = _script(hf, hf.new_cache())
    before = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(fast_forward, "can_pack", lambda weight: False)
    fused = ModelRunner(model, torch.device("cpu"), fused=True)
    layer, attn = fused.lean.layers[0], model.model.layers[0].self_attn
    assert layer.qkv.packed is None and layer.qkv.sizes == [64, 32, 32]
    storage = layer.qkv.weight.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == storage for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    mlp = model.model.layers[0].mlp
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == layer.gate_up.weight.untyped_storage().data_ptr()
    assert layer.o_fused.weight.data_ptr() == attn.o_proj.weight.data_ptr()  # one module: its own weight
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == before * 4, "the fused weights are the only copy"
    for g, w in zip(_script(fused, fused.new_cache()), want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)
    for g, w in zip(_script(hf, hf.new_cache()), want):  # Hugging Face's forward reads the views
        assert torch.equal(g, w)


def test_fused_rope_table_grows_with_the_positions():
    """The fused path gathers rotary rows from a table of the positions seen so far; positions
    past it (here past the model's max_position_embeddings, 256) grow it, with the same result."""
    model = _tiny("llama")
    fused, hf = ModelRunner(model, torch.device("cpu"), fused=True), ModelRunner(model, torch.device("cpu"), lean=False)
    tokens = torch.randint(0, 250, (1, 300), generator=torch.Generator().manual_seed(4))
    a, b = fused.new_cache(), hf.new_cache()
    torch.testing.assert_close(fused.forward(a, tokens[:, :100]), hf.forward(b, tokens[:, :100]), atol=1e-4, rtol=0)
    assert fused.lean._rope_table.shape[1] == 256
    torch.testing.assert_close(fused.forward(a, tokens[:, 100:]), hf.forward(b, tokens[:, 100:]), atol=1e-4, rtol=0)
    assert fused.lean._rope_table.shape[1] == 512


def test_reduced_precision_models_attend_in_float32_on_cpu():
    """bf16 attention kernels are several times slower than float32 ones on CPU for the few
    queries of a draft step, so the lean forward upcasts q, k, v (and keeps its cache in float32)."""
    model = _tiny("llama").to(torch.bfloat16)
    runner = ModelRunner(model, torch.device("cpu"), fused=True)
    assert runner.attention_dtype == torch.float32
    cache = runner.new_cache()
    logits = runner.forward(cache, torch.randint(0, 250, (1, 5)))
    assert logits.shape == (1, 5, VOCAB_SIZE) and bool(torch.isfinite(logits).all())
    assert cache.dtype == torch.float32
    hf = ModelRunner(model, torch.device("cpu"), lean=False)
    assert hf.attention_dtype == torch.bfloat16


def test_target_packs_only_where_onednn_can(demo_pair):
    """pack_target_weights fuses the target's products where oneDNN packs them, and never copies
    the target's weights into plain fused products; off, the target is Hugging Face's arithmetic."""
    model = AutoModelForCausalLM.from_pretrained(demo_pair[0], local_files_only=True, dtype=torch.float32).eval()
    packed, plain = target_runner(model, "cpu", True, pack=True), target_runner(model, "cpu", True, pack=False)
    assert packed.lean.layers[0].fused == can_pack(model.lm_head.weight)
    assert not plain.lean.layers[0].fused
    ids = torch.tensor([list(b"def add(a, b):\n    return a")])
    hf = ModelRunner(model, torch.device("cpu"), lean=False)
    want = hf.forward(hf.new_cache(), ids)
    torch.testing.assert_close(plain.forward(plain.new_cache(), ids), want, atol=0, rtol=0)
    got = packed.forward(packed.new_cache(), ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_paths_share_one_cache(demo_pair):
    """Columns written by one path are read correctly by the other."""
    model = AutoModelForCausalLM.from_pretrained(demo_pair[1], local_files_only=True, dtype=torch.float32).eval()
    lean, hf = ModelRunner(model, torch.device("cpu")), ModelRunner(model, torch.device("cpu"), lean=False)
    ids = torch.tensor([list(b"def add(a, b):\n    return")])
    mixed = lean.new_cache()
    lean.forward(mixed, ids[:, :-3])
    hf.forward(mixed, ids[:, -3:-1])
    got = lean.forward(mixed, ids[:, -1:])
    want = hf.forward(hf.new_cache(), ids)[:, -1:]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_unsupported_models_fall_back():
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            hidden_act="gelu",
        )
    ).eval()
    assert "hidden_act" in unsupported_reason(model)
    assert ModelRunner(model, torch.device("cpu")).lean is None
    with pytest.raises(ValueError, match="does not support"):
        FastLlamaForward(model)


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_packed_products_keep_memory_flat_over_many_row_counts():
    """A packed (oneDNN) product meeting a new input shape keeps state for it: a server meets a
    new row count every few prefills, and target replicas and draft workers grew by ~100 MB a
    minute under mixed load. Packed products now run only up to PACKED_MAX_ROWS rows, as
    [rows, in]; the products stay those of the weights on both sides of the bound."""
    import random

    from ssd.model.fast_forward import PACKED_MAX_ROWS, _Linear, can_pack

    q, k = torch.nn.Linear(512, 1024), torch.nn.Linear(512, 512)
    if not can_pack(q.weight):
        pytest.skip("no oneDNN packing on this CPU")
    fused = _Linear([q, k])
    rng = random.Random(0)
    for b, n in ((1, 1), (2, 7), (4, 16), (1, PACKED_MAX_ROWS + 1), (3, 300)):
        x = torch.randn(b, n, 512)
        expected = torch.cat([q(x), k(x)], -1)
        assert fused(x).shape == expected.shape and torch.allclose(fused(x), expected, atol=1e-4), (b, n)
    for _ in range(150):  # warm-up: every packed shape (rows up to the bound), the allocator's pools
        fused(torch.randn(1, rng.randint(1, 600), 512))
    before = _rss_mb()
    for _ in range(600):
        fused(torch.randn(rng.randint(1, 4), rng.randint(1, 400), 512))
    assert _rss_mb() - before < 60, (before, _rss_mb())


def test_packed_products_pad_rows_to_a_bounded_set_of_counts():
    """Row counts are padded to the next of PACKED_ROWS, so a server meets 14 packed shapes per
    module instead of 64 (each a step up in memory: the soak run saw draft workers step up by
    ~10 MiB late in a run), and packing runs each of the 14 once, so none is met later (a
    reliability test saw a target replica step up by 60 MiB after its warm-up: 12 MiB more for
    this module without the packing's run, 2.7 with it). Each row's result is the same in any
    count: a row of a 9-row product equals that row of the 12-row one."""
    from ssd.model.fast_forward import PACKED_ROWS, _Linear, can_pack

    q = torch.nn.Linear(256, 384)
    if not can_pack(q.weight):
        pytest.skip("no oneDNN packing on this CPU")
    assert PACKED_ROWS[:8] == tuple(range(1, 9)) and len(PACKED_ROWS) == 14  # batch 1's rounds run unpadded
    fused = _Linear([q])
    x = torch.randn(1, 12, 256)
    assert torch.equal(fused(x[:, :9]), fused(x)[:, :9])
    wide = _Linear([torch.nn.Linear(1024, 3072)])
    before = _rss_mb()
    for rows in range(1, 65):  # every row count: no new shape
        for _ in range(2):
            wide(torch.randn(1, rows, 1024))
    assert _rss_mb() - before < 6, (before, _rss_mb())
