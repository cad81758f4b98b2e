"""A Llama-family checkpoint's config, tokenizer and generation config load without transformers'
config classes (ssd/model/model_config.py, ssd/model/loader.py), as what transformers loads: the
same attributes (types included), the same to_dict(), bit-identical rotary frequencies, the same
generation config and the same tokenizer; and a fresh engine imports none of those classes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, TokenizersBackend

from ssd.model.fast_forward import unsupported_config_reason
from ssd.model.lean_model import lean_unsupported_reason
from ssd.model.loader import context_limit, load_generation_config, load_tokenizer, loads_tokenizers_backend
from ssd.model.model_config import BASE_FIELDS, DEFAULT_THETA, FIELDS, GENERATION_KEYS, CheckpointConfig, read_config
from ssd.model.shards import rotary_parameters

ROOT = Path(__file__).resolve().parents[1]
# What the engine must not import to start on the demo pair (1.5 s of a process's start).
CONFIG_CLASSES = (
    "torch.distributed.tensor", "transformers.configuration_utils", "transformers.models.llama.configuration_llama",
)  # fmt: skip
# What ssd/ reads of a model's config (the loaders, the lean forward, shards, context_limit, the
# rotary functions), plus the names context_limit probes: each must be equal, or absent on both.
READ = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window", "pretraining_tp",
    "dtype", "bos_token_id", "eos_token_id", "pad_token_id", "quantization_config", "auto_map", "model_type",
    "architectures", "layer_types", "name_or_path", "n_positions", "max_sequence_length", "seq_length",
)  # fmt: skip
MISSING = object()
# How AutoConfig refuses a config.json (its strict dataclass's errors, the rope validation's KeyError).
REFUSALS = (StrictDataclassError, ValueError, TypeError, KeyError, AttributeError)
LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip
LLAMA2 = {
    "_name_or_path": "meta-llama/Llama-2-7b-hf", "architectures": ["LlamaForCausalLM"], "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "pad_token_id": 0, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip
MISTRAL = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip
QWEN25 = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    "attention_bias": True,
}  # fmt: skip
CASES = {
    "demo-target": None, "demo-draft": None,  # the bundled pair, read in place
    "llama-3.1-8b": LLAMA31, "llama-2-7b": LLAMA2, "mistral-7b-v0.1": MISTRAL,
    "mistral-no-window": {**MISTRAL, "sliding_window": None}, "qwen2.5-0.5b": QWEN25,
    "minimal-llama": {"model_type": "llama"}, "minimal-mistral": {"model_type": "mistral"},
    "minimal-qwen2": {"model_type": "qwen2"},
    # rope_scaling in its old form ("type"), an int rope_theta, generation keys (dropped), a key of
    # no field (kept), torch_dtype beside dtype, a qwen2 sliding window from layer 2 on.
    "linear-rope": {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "rope_theta": 20000,
                    "rope_scaling": {"type": "linear", "factor": 2.0}, "max_length": 4096, "temperature": 0.6,
                    "do_sample": True, "custom_key": [1, 2], "dtype": "float32", "torch_dtype": "bfloat16"},
    "yarn-rope": {**QWEN25, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
                  "use_sliding_window": True, "max_window_layers": 2},
    "dynamic-rope": {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    # llama3 without original_max_position_embeddings: standardization fills it in.
    "llama3-implicit": {**LLAMA31, "max_position_embeddings": 8192, "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_type": "llama3"}},
    # Both: a non-empty rope_scaling replaces rope_parameters.
    "both-rope-keys": {**LLAMA31, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}},
    "labels": {"model_type": "llama", "id2label": {"0": "neg", "1": "pos"}, "label2id": {"neg": 0, "pos": 1},
               "auto_map": {"AutoModelForCausalLM": "modeling.Model"}, "head_dim": 64},
}  # fmt: skip
# Configs read_config leaves to AutoConfig: (the contents, whether AutoConfig refuses them too).
FALLBACKS = {
    "gpt2": ({"model_type": "gpt2"}, False),
    "ministral": ({"model_type": "mistral", "layer_types": ["full_attention"] * 32}, False),
    "remote-config": ({"model_type": "llama", "auto_map": {"AutoConfig": "configuration.C"}}, False),
    "int-eps": ({"model_type": "llama", "rms_norm_eps": 1}, True),
    "null-kv-heads-mistral": ({"model_type": "mistral", "num_key_value_heads": None}, True),
    "range": ({"model_type": "llama", "initializer_range": 2.0}, True),
    "heads": ({"model_type": "llama", "hidden_size": 100, "num_attention_heads": 8}, True),
    "odd-head": ({"model_type": "llama", "head_dim": 7}, True),
    "llama3-missing": ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, True),
    "dtype-name": ({"model_type": "llama", "dtype": "torch.float16"}, True),
    "num-labels": ({"model_type": "llama", "num_labels": 3}, False),
    "partial-rotary": ({"model_type": "llama", "partial_rotary_factor": 0.5}, False),
    "outer-original-max": ({**LLAMA31, "original_max_position_embeddings": 4096}, False),
    "nested-rope": ({"model_type": "qwen2", "num_hidden_layers": 2,
                     "rope_parameters": {"full_attention": {"rope_type": "default"}}}, False),
    "quantized": ({"model_type": "llama", "quantization_config": {"quant_method": "gptq"}}, False),
    "private-key": ({"model_type": "llama", "_is_quantized": True}, False),
    "special-float": ({"model_type": "llama", "custom": {"__float__": "NaN"}}, False),
    "attention": ({"model_type": "llama", "output_attentions": True}, False),
}  # fmt: skip


def _write(directory: Path, raw: dict) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw))
    return str(directory)


def _checkpoint(case: str, tmp_path: Path, demo_pair) -> str:
    if CASES[case] is None:
        return demo_pair[0] if case == "demo-target" else demo_pair[1]
    return _write(tmp_path / case, CASES[case])


def _both(directory: str) -> tuple[CheckpointConfig, object]:
    ours = read_config(directory, directory)
    assert isinstance(ours, CheckpointConfig), "read_config fell back"
    return ours, AutoConfig.from_pretrained(directory, local_files_only=True)


def _exact(value):
    """`value` with the type of every part in it: 1 and 1.0 (or True) compare unequal."""
    if isinstance(value, dict):
        return {k: _exact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_exact(v) for v in value]
    return type(value).__name__, value


@pytest.mark.parametrize("case", list(CASES))
def test_a_config_reads_as_autoconfig_reads_it(case, tmp_path, demo_pair):
    ours, theirs = _both(_checkpoint(case, tmp_path, demo_pair))
    for name in READ:
        assert _exact(getattr(ours, name, MISSING)) == _exact(getattr(theirs, name, MISSING)), name
    internal = ("_attn_implementation_internal", "_experts_implementation_internal", "_post_init_done")
    assert _exact(vars(ours)) == _exact({k: v for k, v in vars(theirs).items() if k not in internal})
    assert _exact(ours.to_dict()) == _exact(theirs.to_dict())
    assert unsupported_config_reason(ours) == unsupported_config_reason(theirs)
    assert lean_unsupported_reason(ours) == lean_unsupported_reason(theirs)
    assert context_limit(ours) == context_limit(theirs)


@pytest.mark.parametrize("case", list(CASES))
def test_rotary_parameters_are_transformers_bit_for_bit(case, tmp_path, demo_pair):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    ours, theirs = _both(_checkpoint(case, tmp_path, demo_pair))
    rotary = {"llama": LlamaRotaryEmbedding, "mistral": MistralRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding}
    module = rotary[theirs.model_type](config=theirs)
    inv_freq, scaling = rotary_parameters(ours)
    assert inv_freq.dtype == module.inv_freq.dtype and torch.equal(inv_freq, module.inv_freq)
    assert _exact(scaling) == _exact(module.attention_scaling)
    assert _exact(ours.rope_parameters) == _exact(theirs.rope_parameters)  # the same after both computed


@pytest.mark.parametrize("case", ["llama-3.1-8b", "minimal-qwen2", "linear-rope", "labels"])
def test_a_generation_config_from_the_config_alone(case, tmp_path):
    directory = _write(tmp_path / case, CASES[case])  # no generation_config.json
    ours, theirs = _both(directory)
    assert load_generation_config(directory, ours).to_dict() == GenerationConfig.from_model_config(theirs).to_dict()


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_what_read_config_leaves_to_autoconfig(case, tmp_path):
    raw, refused = FALLBACKS[case]
    directory = _write(tmp_path / case, raw)
    assert read_config(directory) is None
    if refused:  # transformers refuses it: AutoConfig raises as it does
        with pytest.raises(REFUSALS):
            AutoConfig.from_pretrained(directory, local_files_only=True)


def test_the_generation_keys_are_transformers_own():
    assert GENERATION_KEYS == set(GenerationConfig._get_default_generation_params())


def test_the_tables_are_transformers_own():
    from transformers import LlamaConfig, MistralConfig, PreTrainedConfig, Qwen2Config

    base = {f.name: f.default for f in dataclasses.fields(PreTrainedConfig)}
    assert base == BASE_FIELDS
    for cls in (LlamaConfig, MistralConfig, Qwen2Config):
        fields = [(f.name, f.default) for f in dataclasses.fields(cls) if f.name not in base]
        assert fields == [(name, default) for name, (default, _) in FIELDS[cls.model_type].items()]
        assert cls.default_theta == DEFAULT_THETA and cls.default_rope_type == "default"
        assert cls.attribute_map == {}
    # Every name of ours is one of transformers' config's, so no config.json key collides with it.
    assert {n for n in dir(CheckpointConfig) if not n.startswith("__")} <= set(dir(LlamaConfig))


@pytest.mark.parametrize("model_type", list(FIELDS))
def test_each_field_is_checked_as_transformers_checks_it(model_type, tmp_path):
    """Each field set to a value of another type, and to null: where AutoConfig refuses the file,
    read_config leaves it to AutoConfig; where AutoConfig takes it, read_config reads the same."""
    for name, (default, _) in FIELDS[model_type].items():
        for value in ("text" if not isinstance(default, str) else 1, None):
            directory = _write(tmp_path / f"{name}-{value}", {"model_type": model_type, name: value})
            ours = read_config(directory, directory)
            try:
                theirs = AutoConfig.from_pretrained(directory, local_files_only=True)
            except REFUSALS:
                assert ours is None, (name, value)
                continue
            assert ours is not None and _exact(ours.to_dict()) == _exact(theirs.to_dict()), (name, value)


def _tokenizer_dir(tmp_path: Path, demo_pair, model_type: str = "llama", **declared) -> str:
    """The demo target's tokenizer files, under a config.json of `model_type`, with `declared`
    changed in its tokenizer_config.json."""
    directory = tmp_path / "-".join(["tokenizer", model_type, *declared])
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(demo_pair[0]) / name, directory / name)
    (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, **declared}))
    return str(directory)


def _assert_same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs) is TokenizersBackend
    assert ours.get_vocab() == theirs.get_vocab() and ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id,
    )  # fmt: skip
    for text in ("hello world", "<|endoftext|>def f(x):\n    return x<|pad|>", " é\t<|pad|>"):
        ids = ours.encode(text)
        assert ids == theirs.encode(text) and ours.decode(ids) == theirs.decode(ids)


@pytest.mark.parametrize("which", ["target", "draft", "PreTrainedTokenizerFast", "mistral"])
def test_the_tokenizer_loads_as_autotokenizer_loads_it(which, tmp_path, demo_pair):
    if which in ("target", "draft"):
        directory = demo_pair[0] if which == "target" else demo_pair[1]
    elif which == "mistral":
        directory = _tokenizer_dir(tmp_path, demo_pair, "mistral")
    else:
        directory = _tokenizer_dir(tmp_path, demo_pair, tokenizer_class="PreTrainedTokenizerFast")
    assert loads_tokenizers_backend(directory)  # the fast path is the one taken
    _assert_same_tokenizer(load_tokenizer(directory), AutoTokenizer.from_pretrained(directory, local_files_only=True))


def test_other_tokenizers_load_through_autotokenizer(tmp_path, demo_pair):
    # qwen2: AutoTokenizer prefers its registered Qwen2Tokenizer to the checkpoint's class.
    qwen2 = _tokenizer_dir(tmp_path, demo_pair, "qwen2")
    assert not loads_tokenizers_backend(qwen2)
    assert type(load_tokenizer(qwen2)) is type(AutoTokenizer.from_pretrained(qwen2, local_files_only=True))
    assert type(load_tokenizer(qwen2)) is not TokenizersBackend
    assert not loads_tokenizers_backend(_tokenizer_dir(tmp_path, demo_pair, tokenizer_class="LlamaTokenizerFast"))
    assert not loads_tokenizers_backend(_tokenizer_dir(tmp_path, demo_pair, auto_map={"AutoTokenizer": ["a", "b"]}))
    assert not loads_tokenizers_backend(str(tmp_path / "absent"))


def test_an_engine_starts_without_transformers_config_classes(demo_pair):
    code = (
        "import sys\n"
        "from ssd import LLM, SamplingParams\n"
        f"llm = LLM(target={demo_pair[0]!r}, draft={demo_pair[1]!r}, mode='sd')\n"
        "out = llm.generate(['def add(a, b):'], SamplingParams(temperature=0.0, max_tokens=6))\n"
        "assert len(out[0].token_ids) == 6, out\n"
        "print(type(llm.engine.target.model.config).__name__, type(llm.engine.tokenizer).__name__)\n"
        "llm.close()\n"
        f"print(*[m for m in {CONFIG_CLASSES!r} if m in sys.modules])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    kinds, imported = run.stdout.splitlines()[-2:]
    assert kinds == "CheckpointConfig TokenizersBackend" and imported == ""
