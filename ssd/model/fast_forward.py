"""A lean forward pass for Llama-architecture Hugging Face models.

Speculative decoding runs many small forwards (one token per draft step, a few per tree depth),
where a Hugging Face forward spends more time in Python (module dispatch, output capture,
mask preparation, cache bookkeeping) than in arithmetic: about 2 ms per call for the bundled
2-layer draft, of which the matrix products take 0.7 ms. This module runs the same weights with
the same operations in the same order as Hugging Face's `sdpa` path, without that framework
layer. It reads the model's parameters in place (no copy), writes keys and values into the
same `DynamicCache` layers the Hugging Face path uses (growing them in place, through
BatchKVCache.append), so the two paths are interchangeable call by call, for a model that
attends in its own dtype (a bf16 model on CPU attends, and caches, in float32 here; see
ssd/model/runner.py); tests compare their logits and the engine's greedy output with `generate`.

With `fused=True` the projections that read the same input run as one product (q, k and v; gate
and up) and, on a CPU with oneDNN, every product uses a weight prepacked once into oneDNN's
blocked layout. Speculative decoding runs many forwards of a few tokens each, where the general
matrix product (MKL's sgemm on the development CPU) is slow for such skinny inputs: the packed
products took about half the time per verification forward of the bundled target (7 tokens,
fp32: 21 ms -> 11 ms) and 10-30% less per draft forward (timed ad hoc on the 2-core development
CPU). Their results differ from Hugging Face's in the last bits (about 1e-5 in the target's
logits), as any optimized kernel's do; the output is still distributed exactly as the target
computes it, because verification uses the target's and the draft's probabilities as computed.
The drafter always fuses; the target does unless `pack_target_weights` is off (then it is
bit-identical to Hugging Face). Packing copies the projection weights once.

Supported: `LlamaForCausalLM`-shaped models (llama, mistral without a sliding window, qwen2)
with SiLU MLPs and a static RoPE (any rope type whose inverse frequencies do not change with
the sequence length). Anything else runs through the Hugging Face forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ARCHITECTURES = ("llama", "mistral", "qwen2")
_DYNAMIC_ROPE = ("dynamic", "longrope")


def unsupported_reason(model) -> str | None:
    """Why `model` cannot use the lean forward, or None when it can."""
    reason = unsupported_config_reason(model.config)
    if reason is not None:
        return reason
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        return "not a *ForCausalLM with model.rotary_emb and lm_head"
    return None


def unsupported_config_reason(config) -> str | None:
    """Why a model of this Hugging Face config cannot use the lean forward, or None."""
    if getattr(config, "model_type", None) not in _ARCHITECTURES:
        return f"model_type {getattr(config, 'model_type', None)!r} is not one of {_ARCHITECTURES}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in _DYNAMIC_ROPE:
        return f"rope_type {rope.get('rope_type')!r} changes with the sequence length"
    return None


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can prepack this weight here (CPU, fp32 or bf16 with bf16 kernels)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    # oneDNN's bf16 kernels need AVX512 (or AMX); elsewhere the plain product is the better choice.
    return weight.dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class _Linear:
    """x -> x W^T + b for one or more nn.Linear modules stacked along the output dimension
    (one product instead of several), with W prepacked for oneDNN where can_pack allows. Packed,
    it holds a copy of the weights (oneDNN's layout); otherwise none: the modules' weights become
    views of the concatenated one (`_share`), so fusing a GPU target's projections costs no
    memory."""

    def __init__(self, modules) -> None:
        weight = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
        biases = [m.bias for m in modules]
        self.modules = list(modules)
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat(
                [
                    b.detach() if b is not None else m.weight.new_zeros(m.weight.shape[0])
                    for m, b in zip(modules, biases)
                ]
            )
        self.sizes = [m.weight.shape[0] for m in modules]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8) if can_pack(weight) else None
        self.weight = None if self.packed is not None else weight
        if self.packed is None:
            _share(self.modules, weight)
            return
        # oneDNN's state for each row count (see __call__) is made now, once per bucket, so that
        # memory holds all of it from the load on: met one by one as batching happened on them,
        # the buckets stepped a replica's memory up after its warm-up (a reliability test read a
        # target replica 60 MiB higher; the 14 buckets hold ~74 MiB on the demo pair).
        with torch.inference_mode():
            for rows in PACKED_ROWS:
                torch.ops.mkldnn._linear_pointwise(
                    weight.new_zeros(rows, weight.shape[1]), self.packed, self.bias, "none", [], ""
                )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        # oneDNN keeps state for every input shape it meets on a packed weight, and a server meets
        # a new row count (batch x tokens) every few prefills: target replicas and draft workers
        # grew without bound under mixed load. Packed products are what makes the few-row
        # products of a round fast, so they run only up to PACKED_MAX_ROWS rows (a bounded set of
        # shapes); larger ones (prefills, wide batches) run the modules' own products, which keep
        # no per-shape state.
        rows = x.numel() // x.shape[-1]
        if rows <= PACKED_MAX_ROWS:  # as [rows, in]: the shape is the row count alone, not its split into b x n
            # Padded to the next of PACKED_ROWS: a bounded set of shapes per module, all met within
            # the first minutes of serving, instead of up to 64 met one by one over hours (each
            # one's state a step up in memory). Each row's result does not depend on the others.
            flat = x.reshape(rows, x.shape[-1])
            bucket = _PADDED_ROWS[rows]
            if bucket != rows:
                flat = torch.cat([flat, flat.new_zeros(bucket - rows, flat.shape[1])])
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
            return out[:rows].reshape(*x.shape[:-1], out.shape[-1])
        outs = [F.linear(x, m.weight, m.bias) for m in self.modules]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _share(modules, weight: torch.Tensor) -> None:
    """Point each module's weight at its rows of `weight`, the concatenation of theirs: the
    concatenated copy becomes the only one (the modules' own weights are freed where nothing
    else holds them). Their products, Hugging Face's forward included, read the same values. A
    runner that recorded CUDA graphs on the old weights (an unfused one on the same model) would
    replay freed memory: the engine builds one runner per target model, and its draft runners all
    fuse (each holds its own fused weight, so a second one costs a copy, never correctness)."""
    if len(modules) == 1:
        return
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        view = weight[start : start + rows]
        m.weight = torch.nn.Parameter(view, requires_grad=False) if isinstance(m.weight, torch.nn.Parameter) else view
        start += rows


# The row counts (batch x tokens) a packed product runs at; a product of more rows than the last
# runs unpacked. oneDNN keeps state per row count and weight shape, about 0.5 MiB each on the
# development CPU, so the set is bounded (14 shapes). Its small counts are exact: there a product
# of a few rows costs about in proportion to its rows (the bundled target's 7-row verification
# forward took ~5% less than when padded to 8, the draft's products ~20% less at 10 rows than at
# 16), and they are the rounds' shapes at batch 1: K + 1 verified tokens, a draft step, a tree
# depth of up to 16 branches (12 or 16). A round of 8 rows at K = 6 verifies 56 tokens.
PACKED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)
PACKED_MAX_ROWS = PACKED_ROWS[-1]
# Row count -> its bucket, a tuple lookup: a captured or traced forward reads it without a
# graph break (bisect is a C function the tracer cannot follow).
_PADDED_ROWS = tuple(next(n for n in PACKED_ROWS if n >= rows) for rows in range(PACKED_MAX_ROWS + 1))


class _Layer:
    """One decoder layer's parameters: references to the modules, plus fused products when asked."""

    def __init__(self, layer, fused: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm_in, self.eps_in = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm_post, self.eps_post = (
            layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.variance_epsilon,
        )
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.fused = fused
        if fused:
            self.qkv, self.gate_up = _Linear([self.q, self.k, self.v]), _Linear([self.gate, self.up])
            self.o_fused, self.down_fused = _Linear([self.o]), _Linear([self.down])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Hugging Face's LlamaRMSNorm, op for op (float32 statistics, weight applied last).
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _linear(x: torch.Tensor, module) -> torch.Tensor:
    return F.linear(x, module.weight, module.bias)


class FastLlamaForward:
    """forward(input_ids [b, n], mask [b, 1, n, L+n] additive, positions [b, n], cache) -> logits [b, n, V].

    `cache` is a BatchKVCache: cache.append(i, k, v) grows layer i's keys and values
    [b, kv_heads, L, head_dim] by the n new columns, as Hugging Face's update does.
    """

    def __init__(self, model, fused: bool = False, attention_dtype: torch.dtype | None = None, parallel=None) -> None:
        """parallel: None, or this rank's tensor-parallel communicator (ssd/model/tensor_parallel.py)
        when `model` is one rank's shard (its heads, MLP columns and vocabulary rows): it
        embeds from the vocabulary slice, all-reduces the two row-parallel products of each layer
        and gathers the LM head's vocabulary slices on rank 0."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the lean forward does not support this model: {reason}")
        config = model.config
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.layers = [_Layer(layer, fused) for layer in inner.layers[: config.num_hidden_layers]]
        self.norm, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = model.lm_head
        self.head_fused = _Linear([model.lm_head]) if fused else None
        self.inv_freq = inner.rotary_emb.inv_freq
        self.rope_scaling = inner.rotary_emb.attention_scaling
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.groups = self.heads // self.kv_heads
        self.scaling = self.head_dim**-0.5
        self.fused = fused
        self.parallel = parallel
        # Attention (and the cache) in this dtype; None: the model's. See runner.attention_dtype.
        self.attention_dtype = attention_dtype
        self._rope_table: torch.Tensor | None = None  # [2, positions, head_dim]: cos, sign-folded sin
        self.rope_version = 0  # counts the table's rebuilds: a captured forward reads the table it saw

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(device=positions.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(dtype)  # [b, n, head_dim]
        sin = (emb.sin() * self.rope_scaling).to(dtype)
        return cos, sin

    def reserve_positions(self, count: int, device: torch.device) -> None:
        """Fused path: make the rotary table cover positions 0..count-1 (doubling as it grows).
        The caller knows its positions on the host (ModelRunner does this before each forward),
        so the forward itself never reads a device value to size the table."""
        table = self._rope_table
        dtype = self.attention_dtype or self.embed.dtype
        if table is None or table.shape[1] < count or table.dtype != dtype:
            size = max(count, 256, 2 * table.shape[1] if table is not None else 0)
            cos, sin = self._rope(torch.arange(size, device=device), dtype)  # [size, head_dim]
            half = self.head_dim // 2
            # rotate_half(x) * sin == roll(x, half) * (sin with its first half negated), bit for bit.
            self._rope_table = torch.stack((cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)))
            self.rope_version += 1

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused path: (cos, sign-folded sin) [b, n, 1, head_dim] for `positions`, gathered from
        the table reserve_positions built: two gathers per forward instead of computing them (a
        dozen small operations). Rows are computed by _rope, so they hold the same values it
        gives for those positions."""
        rows = self._rope_table[:, positions]  # [2, b, n, head_dim]
        return rows[0].unsqueeze(2), rows[1].unsqueeze(2)

    def __call__(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache, head: bool = True
    ) -> torch.Tensor | None:
        """Reads no device value on the host (positions must lie in the table reserve_positions
        covers), so a round on an accelerator can run it without waiting, or capture it. head:
        False fills the cache only (a prefill nobody reads logits of) and returns None."""
        b, n = input_ids.shape
        parallel = self.parallel
        x = F.embedding(input_ids, self.embed) if parallel is None else parallel.embed(input_ids, self.embed)
        if self.fused:
            # Rotary embedding in [b, n, heads, head_dim] layout, q and k together, in the dtype
            # attention runs in (a reduced-precision model's q and k are upcast before rotating).
            rope_dtype = self.attention_dtype or x.dtype
            cos4, sin4 = self._rope_rows(positions)
            half = self.head_dim // 2
        else:
            cos, sin = self._rope(positions, x.dtype)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, n, head_dim]
        qk_width = (self.heads + self.kv_heads) * self.head_dim
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.norm_in, layer.eps_in)
            if layer.fused:
                qkv = layer.qkv(h)  # [b, n, (heads + 2 kv_heads) * head_dim]
                if qkv.dtype != rope_dtype:
                    qkv = qkv.to(rope_dtype)
                qk = qkv[..., :qk_width].view(b, n, -1, self.head_dim)
                qk = (qk * cos4) + (qk.roll(half, -1) * sin4)
                q = qk[:, :, : self.heads].transpose(1, 2)
                k = qk[:, :, self.heads :].transpose(1, 2)
                v = qkv[..., qk_width:].view(b, n, -1, self.head_dim).transpose(1, 2)
            else:
                q, k, v = _linear(h, layer.q), _linear(h, layer.k), _linear(h, layer.v)
                q = q.view(b, n, -1, self.head_dim).transpose(1, 2)
                k = k.view(b, n, -1, self.head_dim).transpose(1, 2)
                v = v.view(b, n, -1, self.head_dim).transpose(1, 2)
                q = (q * cos) + (_rotate_half(q) * sin)
                k = (k * cos) + (_rotate_half(k) * sin)
                if self.attention_dtype is not None:
                    q, k, v = q.to(self.attention_dtype), k.to(self.attention_dtype), v.to(self.attention_dtype)
            keys, values = cache.append(i, k, v)
            if self.groups > 1:
                keys = keys.repeat_interleave(self.groups, dim=1)
                values = values.repeat_interleave(self.groups, dim=1)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling)
            a = a.transpose(1, 2).reshape(b, n, -1).to(x.dtype)
            # o and down are row-parallel on a shard: each rank's product is a partial sum.
            if layer.fused:
                x = x + _reduced(layer.o_fused(a), parallel)
                h = _rms_norm(x, layer.norm_post, layer.eps_post)
                gate, up = layer.gate_up(h).split(layer.gate_up.sizes, dim=-1)
                x = x + _reduced(layer.down_fused(F.silu(gate) * up), parallel)
            else:
                x = x + _reduced(_linear(a, layer.o), parallel)
                h = _rms_norm(x, layer.norm_post, layer.eps_post)
                x = x + _reduced(_linear(F.silu(_linear(h, layer.gate)) * _linear(h, layer.up), layer.down), parallel)
        if not head:
            return None
        x = _rms_norm(x, self.norm, self.norm_eps)
        logits = self.head_fused(x) if self.head_fused is not None else _linear(x, self.lm_head)
        return logits if parallel is None else parallel.gather_vocabulary(logits)


def _reduced(partial: torch.Tensor, parallel) -> torch.Tensor:
    return partial if parallel is None else parallel.all_reduce(partial)
