"""One tensor-parallel rank's slice of a Llama-architecture checkpoint, read straight from its
safetensors files.

How a model of t ranks is split (Megatron's layout; rank r of t):
    q_proj, k_proj, v_proj   column-parallel: rank r's query heads [r h/t, (r+1) h/t) and its
                             key/value heads [r g/t, (r+1) g/t) (GQA: each rank keeps whole groups;
                             with t > g, the one head of its group, copied on t/g ranks, as vLLM does)
    o_proj                   row-parallel: the input columns of rank r's query heads
    gate_proj, up_proj       column-parallel: rows [floor(r I/t), floor((r+1) I/t)) of the intermediate size I
    down_proj                row-parallel: the same columns
    embed_tokens, lm_head    vocabulary-parallel: rows [r ceil(V/t), (r+1) ceil(V/t)) of V
    norms                    whole on every rank (a vector of the hidden size)
so a layer's attention and MLP each end in one all-reduce, and every rank holds about 1/t of the
weights. The embedding and the LM head are split by vocabulary rather than kept whole because at
real sizes they are the largest single matrices (128256 x 8192 for Llama-3.1-70B, 2 GiB each in
bf16): a replicated copy on every rank would cost more than a layer's share, and the price of the
split is one all-reduce of the embedded prompt and one gather of the logits on rank 0, which needs
them for verification anyway. A bias of a row-parallel product is added on rank 0 only (the
all-reduce adds it once).

Only the slices are read, straight from the safetensors files into the rank's own memory
(checkpoint_slices.py, which says why not through a mapping of the file), so a rank's peak is its
shard plus one read chunk; `python -m benchmarks.tensor_parallel` measures it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ssd.model.checkpoint_slices import CheckpointSlices


@dataclass(frozen=True)
class ShardPlan:
    """Where rank `rank` of `world` cuts each dimension (half-open ranges)."""

    rank: int
    world: int
    heads: tuple[int, int]  # query heads
    kv_heads: tuple[int, int]  # key/value heads
    intermediate: tuple[int, int]  # MLP rows
    vocabulary: tuple[int, int]  # embedding and LM head rows (the last rank's may be short)
    vocabulary_share: int  # ceil(V / t): every rank's LM head output width (padded on the last)
    vocabulary_size: int  # V

    @staticmethod
    def of(config, rank: int, world: int, setting: str = "tensor_parallel_size") -> ShardPlan:
        """The cuts for `config` (a Hugging Face config); ValueError naming the sizes that divide
        when the head counts do not split evenly in `world` (the MLP's rows need not: ranks may
        hold a row more or less). setting: the option that set `world`, for the error."""
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

        def splits(t: int) -> bool:  # whole key/value heads per rank, or one replicated over t / kv ranks
            return heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)

        if not splits(world):
            sizes = [t for t in range(1, heads + 1) if splits(t)]
            raise ValueError(
                f"{setting}={world} does not divide the model's heads: {heads} query and {kv_heads} "
                f"key/value heads split evenly over {setting} in {sizes}"
            )
        vocab = config.vocab_size
        if vocab < world:
            raise ValueError(f"{setting}={world} exceeds the vocabulary size {vocab}")
        share = -(-vocab // world)

        def cut(total: int) -> tuple[int, int]:
            return rank * total // world, (rank + 1) * total // world

        first = min(rank * share, vocab)
        # More ranks than key/value heads: rank r keeps the one its query heads attend with
        # (they all lie in one group, since t / kv divides heads / kv).
        kv = cut(kv_heads) if kv_heads % world == 0 else (rank * kv_heads // world, rank * kv_heads // world + 1)
        return ShardPlan(
            rank, world, cut(heads), kv, cut(config.intermediate_size),
            (first, min(first + share, vocab)), share, vocab,
        )  # fmt: skip


@dataclass(frozen=True)
class Rotary:
    """A model's rotary embedding as the lean forward reads it (model.rotary_emb): a buffer
    computed from the config, not a weight (a type of its own, not a namespace of tensors, so
    that what walks a shard's weights does not count it, as parameters() leaves out Hugging
    Face's buffer)."""

    inv_freq: torch.Tensor
    attention_scaling: float


def _linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> SimpleNamespace:
    return SimpleNamespace(weight=weight, bias=bias)


def _norm(weight: torch.Tensor, eps: float) -> SimpleNamespace:
    return SimpleNamespace(weight=weight, variance_epsilon=eps)


def load_shard(directory: str | Path, config, plan: ShardPlan, dtype: torch.dtype, device: torch.device):
    """Rank plan.rank's shard -> an object shaped like a *ForCausalLM as the lean forward reads it
    (config with this rank's head counts, model.embed_tokens / layers / norm / rotary_emb, lm_head),
    its tensors in `dtype` on `device`. The LM head is the embedding where the checkpoint has no
    lm_head, or where the config ties them and the checkpoint's head equals the embedding (Hugging
    Face's rule: a head that differs is a config that does not describe its checkpoint, and it
    keeps the head then)."""
    ckpt = CheckpointSlices(directory)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_rows = tuple(h * head_dim for h in plan.heads)
    kv_rows = tuple(h * head_dim for h in plan.kv_heads)
    root = plan.rank == 0

    def load(name: str, span=None, by_columns: bool = False) -> torch.Tensor:
        if plan.world == 1:  # the whole model: each tensor whole, in one read (not a chunked copy of its columns)
            span, by_columns = None, False
        t = ckpt.columns(name, span) if by_columns else ckpt.rows(name, span)
        return t.to(device=device, dtype=dtype)

    def column_parallel(name: str, span: tuple[int, int]) -> SimpleNamespace:  # its output rows
        bias = f"{name}.bias"
        return _linear(load(f"{name}.weight", span), load(bias, span) if ckpt.has(bias) else None)

    def row_parallel(name: str, span: tuple[int, int]) -> SimpleNamespace:  # its input columns; bias on rank 0
        bias = f"{name}.bias"
        return _linear(load(f"{name}.weight", span, by_columns=True), load(bias) if root and ckpt.has(bias) else None)

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = SimpleNamespace(
            q_proj=column_parallel(p + "self_attn.q_proj", q_rows),
            k_proj=column_parallel(p + "self_attn.k_proj", kv_rows),
            v_proj=column_parallel(p + "self_attn.v_proj", kv_rows),
            o_proj=row_parallel(p + "self_attn.o_proj", q_rows),
        )
        mlp = SimpleNamespace(
            gate_proj=column_parallel(p + "mlp.gate_proj", plan.intermediate),
            up_proj=column_parallel(p + "mlp.up_proj", plan.intermediate),
            down_proj=row_parallel(p + "mlp.down_proj", plan.intermediate),
        )
        layers.append(
            SimpleNamespace(
                self_attn=attn,
                mlp=mlp,
                input_layernorm=_norm(load(p + "input_layernorm.weight"), config.rms_norm_eps),
                post_attention_layernorm=_norm(load(p + "post_attention_layernorm.weight"), config.rms_norm_eps),
            )
        )
    embed = load("model.embed_tokens.weight", plan.vocabulary)
    head = load("lm_head.weight", plan.vocabulary) if ckpt.has("lm_head.weight") else embed
    if head is not embed and getattr(config, "tie_word_embeddings", False) and torch.equal(head, embed):
        head = embed  # one tensor, not two copies (each rank decides on its slice: the values agree either way)
    if head.shape[0] < plan.vocabulary_share:  # the last rank's slice, padded to the common width of the gather
        head = torch.cat([head, head.new_zeros(plan.vocabulary_share - head.shape[0], head.shape[1])])
    local = copy.deepcopy(config)
    local.num_attention_heads = plan.heads[1] - plan.heads[0]
    local.num_key_value_heads = plan.kv_heads[1] - plan.kv_heads[0]
    local.head_dim = head_dim
    inv_freq, scaling = rotary_parameters(config)
    rotary = Rotary(inv_freq.to(device), scaling)
    inner = SimpleNamespace(
        embed_tokens=SimpleNamespace(weight=embed),
        layers=layers,
        norm=_norm(load("model.norm.weight"), config.rms_norm_eps),
        rotary_emb=rotary,
    )
    return SimpleNamespace(config=local, model=inner, lm_head=_linear(head))


def rotary_parameters(config) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) of the model's rotary embedding, computed as transformers'
    LlamaRotaryEmbedding.__init__ computes them (the same values, bit for bit), without importing
    modeling_llama: that module pulls in modeling_utils (and through it torch._dynamo), about a
    second of a process's start (ssd/model/lean_model.py). modeling_rope_utils, for the other
    rope types, is light."""
    rope_type = config.rope_parameters["rope_type"]
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[rope_type](config)
    # LlamaRotaryEmbedding.compute_default_rope_parameters, op for op.
    base = config.rope_parameters["rope_theta"]
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


def planned_elements(config, plan: ShardPlan) -> int:
    """Parameters rank plan.rank will hold, from the config's shapes alone (nothing loaded): what
    a layout is checked against before any weight is read. Counts the LM head padded, as loaded,
    and no bias (Llama has none; a qwen2 rank's few thousand are noise next to its matrices)."""
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    heads = (plan.heads[1] - plan.heads[0]) * head_dim
    kv = (plan.kv_heads[1] - plan.kv_heads[0]) * head_dim
    mlp = plan.intermediate[1] - plan.intermediate[0]
    layer = hidden * (2 * heads + 2 * kv) + 3 * hidden * mlp + 2 * hidden
    embed = (plan.vocabulary[1] - plan.vocabulary[0]) * hidden
    tied = getattr(config, "tie_word_embeddings", False)
    head = (
        plan.vocabulary_share * hidden
        if not tied or plan.vocabulary_share > plan.vocabulary[1] - plan.vocabulary[0]
        else 0
    )
    return config.num_hidden_layers * layer + embed + head + hidden
