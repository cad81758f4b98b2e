"""Llama-architecture models in a local safetensors directory load without transformers' modeling
code when the engine runs the lean forward (ssd/model/lean_model.py), as the same tensors that
from_pretrained gives: same rotary frequencies, same parameters, same logits, same greedy output."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from refimpl import hf_greedy
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from ssd import LLM, SamplingParams
from ssd.core.config import EngineArgs
from ssd.model.demo_models import VOCAB_SIZE, build_tokenizer
from ssd.model.lean_model import LeanModel
from ssd.model.loader import load_draft, load_model
from ssd.model.runner import ModelRunner
from ssd.model.shards import rotary_parameters

ROOT = Path(__file__).resolve().parents[1]
# What from_pretrained imports and the lean loader must not (about 2.5 s on the development CPU).
HEAVY = ("transformers.modeling_utils", "transformers.models.llama.modeling_llama", "scipy", "torch._dynamo")
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}  # fmt: skip
SHAPE = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
)  # fmt: skip


def _save(path: Path, kind: str, dtype: torch.dtype = torch.float32, **extra) -> str:
    """A tiny random model of `kind` (llama; qwen2: q/k/v biases, made non-zero) saved in `dtype`."""
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=False, **extra))
    else:
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.to(dtype).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return str(path)


def _edit_config(path: str, **changes) -> None:
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}  # None: drop the key
    config_file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def models(tiny_pair, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lean_loading")
    paths = {
        "llama": tiny_pair[0],  # float32, an LM head of its own
        "tied": _save(root / "tied", "llama", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE),
        "qwen2-bf16": _save(root / "qwen2", "qwen2", torch.bfloat16, tie_word_embeddings=False),
        "no-dtype": _save(root / "no_dtype", "llama", torch.bfloat16, tie_word_embeddings=False),
        # Tied in its config, but its checkpoint's head differs: Hugging Face keeps the head.
        "untrue-tie": _save(root / "untrue_tie", "llama", tie_word_embeddings=False),
    }
    _edit_config(paths["no-dtype"], dtype=None)  # "auto" then reads the weights' dtype
    _edit_config(paths["untrue-tie"], tie_word_embeddings=True)
    return paths


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**SHAPE),
        LlamaConfig(**SHAPE, rope_parameters=LLAMA3_ROPE),
        LlamaConfig(**{**SHAPE, "num_attention_heads": 2}, head_dim=48),
        Qwen2Config(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    ],
    ids=["default", "llama3", "head_dim", "qwen2"],
)
def test_rotary_parameters_equal_hugging_faces(config):
    module = (Qwen2RotaryEmbedding if config.model_type == "qwen2" else LlamaRotaryEmbedding)(config=config)
    inv_freq, scaling = rotary_parameters(config)
    assert inv_freq.dtype == module.inv_freq.dtype and torch.equal(inv_freq, module.inv_freq)
    assert scaling == module.attention_scaling


def _logits(model) -> list[torch.Tensor]:
    """A padded prefill of two rows, then a step, through the unfused lean forward."""
    runner = ModelRunner(model, torch.device("cpu"), lean=True, fused=False)
    cache = runner.new_cache()
    tokens = torch.tensor([[5, 9, 33, 70, 101, 7], [7, 8, 12, 0, 0, 0]])
    valid = tokens != 0
    return [runner.forward(cache, tokens, valid), runner.forward(cache, torch.tensor([[3], [6]]))]


@pytest.mark.parametrize(
    "name,dtype,want_dtype",
    [
        ("llama", "float32", torch.float32),
        ("tied", "float32", torch.float32),
        ("tied", "bfloat16", torch.bfloat16),
        ("qwen2-bf16", "auto", torch.bfloat16),
        ("qwen2-bf16", "float32", torch.float32),
        ("no-dtype", "auto", torch.bfloat16),
        ("untrue-tie", "float32", torch.float32),
    ],
)
def test_lean_model_holds_what_from_pretrained_loads(models, name, dtype, want_dtype):
    lean = load_model(models[name], dtype, "cpu", lean=True)
    hf = load_model(models[name], dtype, "cpu", lean=False)
    assert isinstance(lean, LeanModel) and isinstance(hf, PreTrainedModel)
    assert lean.dtype == hf.dtype == want_dtype and lean.device == torch.device("cpu")
    named = list(hf.named_parameters())  # each tensor once: a tied head is not listed again
    ours = list(lean.parameters())
    assert len(ours) == len(named)
    for tensor, (param_name, param) in zip(ours, named):
        assert tensor.dtype == param.dtype and torch.equal(tensor, param), param_name
    tied = hf.lm_head.weight is hf.model.embed_tokens.weight
    assert tied == (name == "tied") and (lean.lm_head.weight is lean.model.embed_tokens.weight) == tied
    assert lean.generation_config.to_dict() == hf.generation_config.to_dict()
    assert lean.config.to_dict() == hf.config.to_dict()
    for got, want in zip(_logits(lean), _logits(hf)):
        assert torch.equal(got, want)


def test_a_lean_model_runs_the_lean_forward_whatever_lean_says(models):
    model = load_model(models["llama"], "float32", "cpu", lean=True)
    runner = ModelRunner(model, torch.device("cpu"), lean=False)
    assert runner.lean is not None


@pytest.mark.parametrize("pair", ["tiny", "tied"])
def test_greedy_sd_on_lean_models_matches_hf_generate(tiny_pair, models, pair):
    target, draft = tiny_pair if pair == "tiny" else (models["tied"], models["tied"])
    prompts = ["abc", "def add(a, b):\n    return"]
    expected = hf_greedy(target, prompts, 24)
    with LLM(target, draft, mode="sd", k=3, pack_target_weights=False) as llm:
        assert isinstance(llm.engine.target.model, LeanModel)
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    assert [o.token_ids for o in out] == expected


def _load_in_fresh_interpreter(lean: bool) -> subprocess.Popen:
    """Start loading the bundled draft through the loader, as a draft worker does, and running a
    forward, in a new interpreter; _loaded() reads what it found."""
    code = (
        "import sys, torch\n"
        "from ssd.core.config import EngineArgs\n"
        "from ssd.model.loader import load_draft\n"
        "from ssd.model.runner import draft_runner\n"
        f"config = EngineArgs(mode='sd', lean_forward={lean}).to_config()\n"
        "runner = draft_runner(load_draft(config), 'cpu', config.lean_forward)\n"
        "runner.forward(runner.new_cache(), torch.tensor([[5, 9, 33]]))\n"
        f"print(type(runner.model).__name__, *[m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )


def _loaded(run: subprocess.Popen) -> tuple[str, list[str]]:
    """-> (the model's class, which of HEAVY it imported)."""
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    name, *heavy = out.split()
    return name, heavy


def test_loading_a_draft_lean_imports_no_modeling_code(demo_pair):
    lean, hf = _load_in_fresh_interpreter(lean=True), _load_in_fresh_interpreter(lean=False)  # both at once
    try:
        assert _loaded(lean) == ("LeanModel", [])
        # The check fails on the Hugging Face path: from_pretrained imports modeling_utils.
        name, heavy = _loaded(hf)
        assert name == "LlamaForCausalLM" and "transformers.modeling_utils" in heavy
    finally:
        for run in (lean, hf):
            if run.poll() is None:
                run.kill()
                run.communicate()


def test_other_checkpoints_load_through_hugging_face(models, tmp_path):
    # lean_forward=False, threaded from the engine's config
    config = EngineArgs(target=models["llama"], draft=models["llama"], mode="sd", lean_forward=False).to_config()
    assert isinstance(load_draft(config), PreTrainedModel)
    assert isinstance(load_draft(dataclasses.replace(config, lean_forward=True)), LeanModel)
    # .bin weights
    bin_dir = tmp_path / "bin"
    model = LlamaForCausalLM.from_pretrained(models["llama"])
    model.save_pretrained(bin_dir)
    (bin_dir / "model.safetensors").unlink()
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    assert isinstance(load_model(str(bin_dir), "float32", "cpu", lean=True), PreTrainedModel)
    # an architecture the lean forward does not run
    gelu = _save(tmp_path / "gelu", "llama", hidden_act="gelu")
    assert isinstance(load_model(gelu, "float32", "cpu", lean=True), PreTrainedModel)
