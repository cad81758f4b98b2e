"""The demo-model builder: byte tokenizer, training run, standard Hugging Face output."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ssd.model.demo_models import (
    EOS_ID,
    DemoTrainingConfig,
    ModelShape,
    build_demo_models,
    build_tokenizer,
    heldout_prompts,
    is_heldout,
    stdlib_files,
)


def test_tokenizer_is_bytes():
    tok = build_tokenizer()
    text = "def f(x):\n\treturn x + 1  # é 日本\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.eos_token_id == EOS_ID and len(tok) == 258


def test_heldout_prompts_are_deterministic_and_heldout():
    assert heldout_prompts(3) == heldout_prompts(3)
    held = [p for p in stdlib_files() if is_heldout(p, DemoTrainingConfig.holdout_every)]
    assert 0 < len(held) < len(stdlib_files()) / 10


def test_build_demo_models_small_run(tmp_path):
    cfg = DemoTrainingConfig(
        target=ModelShape(32, 1, 2, 64),
        draft=ModelShape(16, 1, 2, 32),
        seq_len=32,
        batch_size=2,
        target_steps=3,
        draft_steps=2,
        warmup_steps=1,
    )
    report = build_demo_models(tmp_path, cfg, progress=False)
    assert json.loads((tmp_path / "training_report.json").read_text())["target_params"] == report["target_params"]
    for name in ("target", "draft"):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / name, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(tmp_path / name, local_files_only=True)
        assert model.dtype == torch.float16
        assert tok.encode("ab", add_special_tokens=False) == [97, 98]
