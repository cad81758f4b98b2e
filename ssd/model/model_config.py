"""A Llama-family checkpoint's config.json read as transformers reads it, without its config classes.

Why: `AutoConfig.from_pretrained` on a llama checkpoint imports transformers.configuration_utils and
models/llama/configuration_llama, which pull in transformers.activations and through it
torch.distributed.tensor, plus the model-type registry's scan: a fresh interpreter reads the demo
target's config in 3.4 s that way against 2.3 s through read_config (torch's 1.5 s in both; the
2-core development CPU), paid by the engine (for the target, the draft and the tokenizer, which
AutoTokenizer reads the config for) and by every draft worker and tensor-parallel rank. The lean
forward reads a handful of numbers from that config.

`read_config(directory)` builds, for model_type llama, mistral or qwen2 (those
fast_forward.unsupported_config_reason accepts), a `CheckpointConfig` holding what
`AutoConfig.from_pretrained(directory)` holds (transformers 5's LlamaConfig, MistralConfig,
Qwen2Config): every field with its per-class default, the derived head_dim and
num_key_value_heads, qwen2's sliding_window and layer_types, dtype as a torch.dtype,
rope_theta/rope_scaling standardized into rope_parameters (rope_theta 10000.0 by default,
original_max_position_embeddings defaulted for llama3/yarn/longrope), generation parameters
dropped, any other key kept as an attribute; `to_dict()` equals transformers' `to_dict()`.
tests/test_model_config.py checks that against transformers itself.

It returns None, and the caller falls back to AutoConfig, wherever transformers would read the
file otherwise than these rules say, or would refuse it:
- no readable config.json, not a JSON object, a "__float__" tag (special floats), or
  "configuration_files" (a versioned config file);
- model_type other than the three, mistral with layer_types (AutoConfig reads it as ministral),
  an auto_map naming an AutoConfig (code of the checkpoint's own);
- a field of the wrong type (transformers' strict dataclass refuses it), initializer_range outside
  [0, 1] (llama), hidden_size not a multiple of num_attention_heads (llama), a zero head count
  where head_dim is derived, an odd head_dim over 4 (RoPE refuses it);
- a dtype/torch_dtype that is not the name of a torch dtype, an id2label not keyed by integers;
- problem_type, a truthy is_encoder_decoder, output_attentions, attn_implementation,
  experts_implementation or per_layer_config (what changes how transformers builds the config or
  its generation config);
- a rope type other than default/linear/dynamic/yarn/longrope/llama3/proportional, missing one
  of its required keys, a partial_rotary_factor, or parameters nested by layer type;
- qwen2 layer_types other than full_attention/sliding_attention entries, one per layer;
- a quantization_config (such checkpoints load through from_pretrained anyway);
- a key beginning with "_" (other than _name_or_path, _commit_hash and the two attention
  implementation keys transformers ignores), or named like an attribute or method of
  transformers' config classes or read by them (_RESERVED: num_labels, layer_types on llama,
  a top-level original_max_position_embeddings, text_config, ...).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_THETA = 10000.0  # RotaryEmbeddingConfigMixin.default_theta; none of the three overrides it
# GenerationConfig._get_default_generation_params()'s keys, which a config drops (a draft worker
# reads its config without importing transformers; tests/test_model_config.py holds this to them).
GENERATION_KEYS = frozenset(
    "assistant_confidence_threshold assistant_lookbehind bad_words_ids begin_suppress_tokens diversity_penalty "
    "do_sample early_stopping encoder_no_repeat_ngram_size encoder_repetition_penalty epsilon_cutoff eta_cutoff "
    "exponential_decay_length_penalty forced_bos_token_id forced_eos_token_id length_penalty max_length min_length "
    "no_repeat_ngram_size num_assistant_tokens num_assistant_tokens_schedule num_beam_groups num_beams "
    "num_return_sequences output_scores remove_invalid_values repetition_penalty return_dict_in_generate "
    "suppress_tokens target_lookbehind temperature top_k top_p typical_p use_cache".split()
)


def _of(*types):
    """A check that a value is of one of `types`, as huggingface_hub's strict dataclass checks a
    field's annotation (a bool is no int there)."""
    return lambda v: isinstance(v, types) and (bool in types or not isinstance(v, bool))


def _opt(check):  # X | None
    return lambda v: v is None or check(v)


_int, _float, _number, _bool, _str, _dict = _of(int), _of(float), _of(int, float), _of(bool), _of(str), _of(dict)


def _unit(v) -> bool:  # llama's initializer_range: a float in [0, 1]
    return _float(v) and 0.0 <= v <= 1.0


def _ids(v) -> bool:  # int | list[int] | None (eos_token_id)
    return v is None or _int(v) or (isinstance(v, list) and all(_int(x) for x in v))


# Each class's dataclass fields beyond PreTrainedConfig's: name -> (default, the type check
# huggingface_hub's strict dataclass applies to it). Order and defaults as transformers 5 declares.
_LLAMA = {
    "vocab_size": (32000, _int), "hidden_size": (4096, _int), "intermediate_size": (11008, _int),
    "num_hidden_layers": (32, _int), "num_attention_heads": (32, _int), "num_key_value_heads": (None, _opt(_int)),
    "hidden_act": ("silu", _str), "max_position_embeddings": (2048, _int), "initializer_range": (0.02, _unit),
    "rms_norm_eps": (1e-6, _float), "use_cache": (True, _bool), "pad_token_id": (None, _opt(_int)),
    "bos_token_id": (1, _opt(_int)), "eos_token_id": (2, _ids), "pretraining_tp": (1, _opt(_int)),
    "tie_word_embeddings": (False, _bool), "rope_parameters": (None, _opt(_dict)),
    "attention_bias": (False, _bool), "attention_dropout": (0.0, _opt(_number)), "mlp_bias": (False, _bool),
    "head_dim": (None, _opt(_int)),
}  # fmt: skip
_MISTRAL = {
    "vocab_size": (32000, _int), "hidden_size": (4096, _int), "intermediate_size": (14336, _int),
    "num_hidden_layers": (32, _int), "num_attention_heads": (32, _int), "num_key_value_heads": (8, _int),
    "head_dim": (None, _opt(_int)), "hidden_act": ("silu", _str), "max_position_embeddings": (4096 * 32, _int),
    "initializer_range": (0.02, _float), "rms_norm_eps": (1e-6, _float), "use_cache": (True, _bool),
    "pad_token_id": (None, _opt(_int)), "bos_token_id": (1, _opt(_int)), "eos_token_id": (2, _ids),
    "tie_word_embeddings": (False, _bool), "rope_parameters": (None, _opt(_dict)),
    "sliding_window": (4096, _opt(_int)), "attention_dropout": (0.0, _number),
}  # fmt: skip
_QWEN2 = {
    "vocab_size": (151936, _int), "hidden_size": (4096, _int), "intermediate_size": (22016, _int),
    "num_hidden_layers": (32, _int), "num_attention_heads": (32, _int), "num_key_value_heads": (32, _opt(_int)),
    "hidden_act": ("silu", _str), "max_position_embeddings": (32768, _int), "initializer_range": (0.02, _float),
    "rms_norm_eps": (1e-6, _float), "use_cache": (True, _bool), "tie_word_embeddings": (False, _bool),
    "rope_parameters": (None, _opt(_dict)), "use_sliding_window": (False, _bool),
    "sliding_window": (4096, _opt(_int)), "max_window_layers": (28, _int),
    "layer_types": (None, _opt(lambda v: isinstance(v, list) and all(_str(x) for x in v))),
    "attention_dropout": (0.0, _number), "pad_token_id": (None, _opt(_int)), "bos_token_id": (None, _opt(_int)),
    "eos_token_id": (None, _ids),
}  # fmt: skip
FIELDS = {"llama": _LLAMA, "mistral": _MISTRAL, "qwen2": _QWEN2}
# PreTrainedConfig's own fields (annotated as strings there, so not type-checked) and defaults.
BASE_FIELDS = {
    "transformers_version": None, "architectures": None, "output_hidden_states": False, "return_dict": True,
    "dtype": None, "chunk_size_feed_forward": 0, "is_encoder_decoder": False, "id2label": None, "label2id": None,
    "problem_type": None,
}  # fmt: skip

# Keys a config class would not simply store: attributes, properties and methods of transformers'
# config classes (a key of that name would shadow or set them), and what their construction,
# validation, rope standardization or GenerationConfig.from_model_config read from the config.
_RESERVED = frozenset(
    """allow_global_per_layer_attribute_access attribute_map base_config_key base_model_ep_plan
    base_model_fsdp_plan base_model_pp_plan base_model_tp_plan convert_rope_params_to_dict
    default_config_fields default_rope_type default_theta dict_dtype_to_str extra_config_files extra_files
    from_dict from_json_file from_pretrained get_config_dict get_mtp_config get_text_config
    ignore_keys_at_rope_validation is_custom_code is_heterogeneous is_remote_code name_or_path
    nested_rope_parameter_keys num_labels per_layer_attributes per_layer_config push_to_hub
    register_for_auto_class rope_scaling save_pretrained serialize_explicit_per_layer_config
    standardize_rope_params sub_configs sub_configs_defaults to_dict to_diff_dict to_json_file
    to_json_string torch_dtype update update_from_string use_return_dict validate validate_architecture
    validate_layer_type validate_output_attentions validate_rope validate_token_ids
    layer_types mtp_layer_types original_max_position_embeddings partial_rotary_factor num_heads embed_dim
    text_config text_encoder decoder generator distributed_config kwargs configuration_files""".split()
)
# Keys transformers drops or overrides: AutoConfig sets _name_or_path to the name it was given.
_IGNORED = ("_name_or_path", "_commit_hash", "_attn_implementation_internal", "_experts_implementation_internal")
# rope type -> the keys RotaryEmbeddingConfigMixin.validate_rope requires of it.
_ROPE_REQUIRED = {
    "default": {"rope_type"}, "linear": {"rope_type", "factor"}, "dynamic": {"rope_type", "factor"},
    "yarn": {"rope_type", "factor", "original_max_position_embeddings"},
    "longrope": {"rope_type", "short_factor", "long_factor", "original_max_position_embeddings"},
    "llama3": {"rope_type", "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
               "rope_theta"},
    "proportional": {"rope_type", "rope_theta"},
}  # fmt: skip
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Keys removed from to_dict's output at every level (PreTrainedConfig._remove_keys_not_serialized).
_NOT_SERIALIZED = (
    "_is_quantized", "_auto_class", "_commit_hash", "_attn_implementation_internal",
    "_experts_implementation_internal", "_post_init_done", "ignore_keys_at_rope_validation", "base_model_tp_plan",
    "base_model_pp_plan", "base_model_fsdp_plan", "distributed_config",
)  # fmt: skip


class Unsupported(ValueError):
    """config.json is one read_config leaves to AutoConfig (the message says why)."""


class CheckpointConfig:
    """A checkpoint's config as transformers' config class for its model_type holds it: the same
    attributes with the same values, as plain attributes (assignable: load_lean_model sets dtype),
    and only those, so that getattr(config, name, default) answers as on transformers' (a qwen2
    config has no head_dim unless its config.json names one; a llama one has no sliding_window).
    Built by read_config; what the lean forward, the loaders, rotary_parameters (transformers'
    ROPE_INIT_FUNCTIONS) and GenerationConfig.from_model_config (given to_dict()) read of it."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)

    @property
    def name_or_path(self) -> str:
        return self._name_or_path

    @property
    def output_attentions(self):
        return self._output_attentions

    @property
    def rope_scaling(self) -> dict:  # transformers' alias of rope_parameters
        return self.rope_parameters

    def standardize_rope_params(self) -> None:
        """What ROPE_INIT_FUNCTIONS call first. read_config standardized rope_parameters already, and
        accepts no config for which transformers' second standardization would change them (no
        top-level rope_theta, partial_rotary_factor or original_max_position_embeddings attribute,
        no nesting by layer type): nothing to do."""

    def get_text_config(self, decoder=None, encoder=None) -> CheckpointConfig:
        return self  # a decoder-only config is its own text config (no text_config/decoder attribute)

    def to_dict(self) -> dict:
        """PreTrainedConfig.to_dict's output for this config, key for key."""
        import transformers  # the package alone (its version), not its config modules

        out = copy.deepcopy(self.__dict__)
        out["model_type"] = self.model_type
        out["transformers_version"] = transformers.__version__
        _strip_unserialized(out)
        _dtype_names(out)
        return out

    def __repr__(self) -> str:
        return f"CheckpointConfig({json.dumps(self.to_dict(), sort_keys=True, default=str)})"


def _strip_unserialized(d: dict) -> None:
    for key in _NOT_SERIALIZED:
        d.pop(key, None)
    if "_output_attentions" in d:
        d["output_attentions"] = d.pop("_output_attentions")
    for value in d.values():
        if isinstance(value, dict):
            _strip_unserialized(value)


def _dtype_names(d: dict) -> None:  # PreTrainedConfig.dict_dtype_to_str
    dtype = d.get("dtype")
    if dtype is not None:
        if isinstance(dtype, dict):
            d["dtype"] = {k: str(v).split(".")[-1] for k, v in dtype.items()}
        elif not isinstance(dtype, (str, int)):
            d["dtype"] = str(dtype).split(".")[1]
    for value in d.values():
        if isinstance(value, dict):
            _dtype_names(value)


def read_config(directory: str | Path, name: str | None = None) -> CheckpointConfig | None:
    """`directory`'s config.json as AutoConfig.from_pretrained(name) reads it (name: what the
    caller would pass AutoConfig, its _name_or_path; the directory by default), or None where
    that takes transformers itself (the module's docstring lists when)."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # AutoConfig reports it as it does
    try:
        return CheckpointConfig(build(raw, str(directory if name is None else name)))
    except Unsupported as why:
        logger.debug("%s reads through transformers' AutoConfig: %s", path, why)
        return None


def build(raw, name: str) -> dict:
    """The attributes transformers' config class gives a config.json of these contents, as
    AutoConfig.from_pretrained(name) builds it (the dataclass fields, the class's __post_init__,
    PreTrainedConfig.__post_init__, the strict validators, from_dict's name_or_path); Unsupported
    where read_config falls back."""
    if not isinstance(raw, dict) or _has_float_tag(raw):
        raise Unsupported("not a plain JSON object")
    model_type = raw.get("model_type")
    if model_type not in FIELDS:
        raise Unsupported(f"model_type {model_type!r}")
    if model_type == "mistral" and "layer_types" in raw:
        raise Unsupported("mistral with layer_types (AutoConfig reads it as ministral)")
    fields = FIELDS[model_type]
    values = {**BASE_FIELDS, **{k: v for k, (v, _) in fields.items()}}
    extras = {}
    for key, value in raw.items():
        (values if key in values else extras)[key] = value
    for key, (_, check) in fields.items():
        if not check(values[key]):
            raise Unsupported(f"{key}={values[key]!r} is not of the type {model_type} declares")
    _class_post_init(model_type, values)
    _base_post_init(values, extras)
    values["_name_or_path"] = name
    values["_output_attentions"] = _falsy(extras, "output_attentions", False)
    for key in ("attn_implementation", "experts_implementation"):
        _falsy(extras, key, None)
    _keep_extras(values, extras)
    _validate(values)
    return values


def _has_float_tag(obj) -> bool:  # {"__float__": "NaN"}: PreTrainedConfig._decode_special_floats's work
    if isinstance(obj, dict):
        return "__float__" in obj or any(_has_float_tag(v) for v in obj.values())
    return isinstance(obj, list) and any(_has_float_tag(v) for v in obj)


def _class_post_init(model_type: str, values: dict) -> None:
    """LlamaConfig/MistralConfig/Qwen2Config.__post_init__ (and llama's validate_architecture)."""
    heads = values["num_attention_heads"]
    if model_type == "qwen2":
        values["sliding_window"] = values["sliding_window"] if values["use_sliding_window"] else None
        if values["layer_types"] is None:
            window, first = values["sliding_window"], values["max_window_layers"]
            values["layer_types"] = [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(values["num_hidden_layers"])
            ]
        elif len(values["layer_types"]) != values["num_hidden_layers"] or any(
            t not in _LAYER_TYPES for t in values["layer_types"]
        ):
            raise Unsupported(f"layer_types {values['layer_types']!r}")
    else:
        if values["head_dim"] is None:
            if heads == 0:
                raise Unsupported("num_attention_heads=0")
            values["head_dim"] = values["hidden_size"] // heads
        if model_type == "llama" and (heads == 0 or values["hidden_size"] % heads):
            raise Unsupported("hidden_size is not a multiple of num_attention_heads")
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads


def _base_post_init(values: dict, extras: dict) -> None:
    """PreTrainedConfig.__post_init__ up to the extra keys: dtype, labels, rope, generation keys."""
    torch_dtype = extras.pop("torch_dtype", None)
    if torch_dtype is not None and values["dtype"] is None:
        values["dtype"] = torch_dtype
    if values["dtype"] is not None:
        dtype = getattr(torch, values["dtype"], None) if isinstance(values["dtype"], str) else None
        if not isinstance(dtype, torch.dtype):
            raise Unsupported(f"dtype {values['dtype']!r}")
        values["dtype"] = dtype
    if values["id2label"] is None:  # num_labels = 2, the default
        values["id2label"] = {0: "LABEL_0", 1: "LABEL_1"}
        values["label2id"] = {"LABEL_0": 0, "LABEL_1": 1}
    else:
        try:
            values["id2label"] = {int(key): value for key, value in values["id2label"].items()}
        except (AttributeError, TypeError, ValueError) as e:
            raise Unsupported(f"id2label {values['id2label']!r}") from e
    if values["problem_type"] is not None or values["is_encoder_decoder"]:
        raise Unsupported("problem_type or is_encoder_decoder")
    labels = values["layer_types"] if "layer_types" in values else ()
    values["rope_parameters"] = _rope_parameters(values, extras, labels)
    for key in GENERATION_KEYS:  # generation keys are dropped
        extras.pop(key, None)


def _rope_parameters(values: dict, extras: dict, labels) -> dict:
    """RotaryEmbeddingConfigMixin.convert_rope_params_to_dict + standardize_rope_params, and the
    keys validate_rope requires: rope_scaling (where non-empty) replaces rope_parameters; rope_theta
    (top-level, else 10000.0), rope_type (from "type", else "default") and, for the scaled
    types, original_max_position_embeddings (max_position_embeddings) filled in where missing."""
    scaling = extras.pop("rope_scaling", None)
    rope = scaling or values["rope_parameters"]
    rope = {} if rope is None else rope
    theta = extras.pop("rope_theta", DEFAULT_THETA)
    if not isinstance(rope, dict) or "partial_rotary_factor" in rope or "partial_rotary_factor" in extras:
        raise Unsupported(f"rope parameters {rope!r}")
    if any(key in labels for key in rope):
        raise Unsupported("rope parameters nested by layer type")
    rope.setdefault("rope_theta", theta)
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", values["max_position_embeddings"])
    required = _ROPE_REQUIRED.get(rope["rope_type"])
    if required is None or not required <= rope.keys():
        raise Unsupported(f"rope parameters {rope!r}")
    return rope


def _falsy(extras: dict, key: str, default):
    value = extras.pop(key, default)
    if value:
        raise Unsupported(f"{key}={value!r}")
    return value


def _keep_extras(values: dict, extras: dict) -> None:
    """The keys no field names: set as attributes, as PreTrainedConfig.__post_init__ sets them."""
    if extras.pop("per_layer_config", None) is not None:
        raise Unsupported("per_layer_config")
    if extras.get("quantization_config") is not None:
        # Quantized weights load through from_pretrained in any case; and transformers' config
        # rewrites that dict in place as it logs itself (from_dict's repr strips keys from it).
        raise Unsupported("quantization_config")
    auto_map = extras.get("auto_map")
    if auto_map is not None and (not isinstance(auto_map, dict) or "AutoConfig" in auto_map):
        raise Unsupported("an AutoConfig of the checkpoint's own (auto_map)")
    for key, value in extras.items():
        if key in _IGNORED:
            continue
        if key.startswith("_") or key in _RESERVED:
            raise Unsupported(f"key {key!r}")
        values[key] = value


def _validate(values: dict) -> None:
    """validate_rope's check of the head size (the others were checked where their keys were read)."""
    head_dim = values.get("head_dim")
    if head_dim is not None and (not _int(head_dim) or (head_dim > 4 and head_dim % 2)):
        raise Unsupported(f"head_dim {head_dim!r}")
