"""A Llama-architecture model loaded for the lean forward alone, straight from its safetensors
files, with none of transformers' modeling code.

Why: `AutoModelForCausalLM.from_pretrained` imports transformers.modeling_utils and the model's
modeling module (and through them torch._dynamo, masking and generation code) for a model whose
forward the engine then runs itself (fast_forward.FastLlamaForward reads only its tensors).
Loading the bundled draft in a fresh interpreter took 3.5 s this way against 4.5 s through
from_pretrained (median of 3, the 2-core development CPU; -X importtime: 2.4 s of imports
against 3.4 s). Here the tensors are read as a tensor-parallel rank reads its slices
(shards.load_shard), the whole model being rank 0 of a world of one. Its config is read without
transformers' config classes too (ssd/model/model_config.py: AutoConfig imports
transformers.activations and torch.distributed.tensor through configuration_llama, about 1.5 s),
as AutoConfig would read it. Its generation config (transformers' GenerationConfig, whose import
is most of transformers' own: 0.5 s) is read when first asked for: the engine asks for the
target's, nobody for a draft worker's, so a worker's process never imports transformers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ssd.model.checkpoint_slices import INDEX_FILE, SINGLE_FILE
from ssd.model.fast_forward import unsupported_config_reason
from ssd.model.shards import ShardPlan, load_shard

# safetensors' names of the floating dtypes Hugging Face picks a checkpoint's dtype from.
_FLOATING = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class LeanModel:
    """What the engine and ModelRunner read from a loaded model: config, generation_config,
    model.embed_tokens / layers / norm / rotary_emb, lm_head, parameters(), dtype, device. It has
    no forward of its own: ModelRunner runs the lean forward on it, whatever lean_forward says."""

    def __init__(self, shard, config, generation_config: Callable[[], object]) -> None:
        """generation_config: reads it (on first use of the attribute)."""
        self.config = config
        self._read_generation_config = generation_config
        self._generation_config = None
        self.model = shard.model
        self.lm_head = shard.lm_head

    @property
    def generation_config(self):
        if self._generation_config is None:
            self._generation_config = self._read_generation_config()
        return self._generation_config

    def parameters(self) -> Iterator[torch.Tensor]:
        """Each tensor once (a tied head is the embedding), in a Hugging Face model's order: the
        embedding first (next(parameters()) names the model's dtype and device)."""
        inner, seen = self.model, set()
        modules = [inner.embed_tokens]
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj]
            modules += [mlp.down_proj, layer.input_layernorm, layer.post_attention_layernorm]
        for module in [*modules, inner.norm, self.lm_head]:
            for tensor in (module.weight, getattr(module, "bias", None)):
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    yield tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device


def lean_checkpoint(name: str | Path) -> bool:
    """Whether `name` is a local directory of safetensors weights, which load_lean_model reads."""
    directory = Path(name)
    return directory.is_dir() and ((directory / SINGLE_FILE).exists() or (directory / INDEX_FILE).exists())


def lean_unsupported_reason(config) -> str | None:
    """Why a checkpoint of this Hugging Face config cannot load as a LeanModel, or None. Beyond
    what the lean forward cannot run: quantized weights (other tensors than a Linear's weight and
    bias) and modeling code of the checkpoint's own, which from_pretrained would run instead of
    Llama's."""
    reason = unsupported_config_reason(config)
    if reason is not None:
        return reason
    if getattr(config, "quantization_config", None) is not None:
        return "quantized weights"
    if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return "modeling code of its own (auto_map)"
    return None


def stored_dtype(directory: str | Path, config) -> torch.dtype:
    """The dtype from_pretrained(dtype="auto") loads in: the config's, else the sharded index's
    metadata's, else the first floating tensor's (by name) in the first weights file."""
    stored = getattr(config, "dtype", None)
    if stored is not None:
        return _torch_dtype(stored)
    directory = Path(directory)
    files = [SINGLE_FILE]
    if (directory / INDEX_FILE).exists():
        index = json.loads((directory / INDEX_FILE).read_text())
        if "dtype" in (index.get("metadata") or {}):
            return _torch_dtype(index["metadata"]["dtype"])
        files = sorted(set(index["weight_map"].values()))
    from safetensors import safe_open

    with safe_open(directory / files[0], framework="pt") as f:
        for name in f.keys():  # sorted by name, as Hugging Face's state dict lists them
            dtype = _FLOATING.get(f.get_slice(name).get_dtype())
            if dtype is not None:
                return dtype
    return torch.float32  # no floating tensor at all: not a model the lean forward could run


def _torch_dtype(value) -> torch.dtype:
    # A config holds a torch.dtype, or its name ("bfloat16", "torch.bfloat16") where read as a string.
    return value if isinstance(value, torch.dtype) else getattr(torch, str(value).removeprefix("torch."))


def load_lean_model(
    directory: str | Path, config, dtype: torch.dtype, device: torch.device, generation_config: Callable[[], object]
) -> LeanModel:
    """The model in `directory` (lean_checkpoint, lean_unsupported_reason None) -> a LeanModel,
    its tensors in `dtype` on `device`, its config `config` (dtype set to the one loaded, as
    from_pretrained sets it), its generation config read by generation_config() when first used."""
    shard = load_shard(directory, config, ShardPlan.of(config, 0, 1), dtype, device)
    # The config as read, not the shard's copy (which names head_dim for its rank's counts).
    config.dtype = dtype
    return LeanModel(shard, config, generation_config)
