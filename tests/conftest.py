"""Shared fixtures: the bundled demo pair and tiny pairs built on the fly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssd.core.config import DEMO_MODELS_DIR
from ssd.model.demo_models import EOS_ID, PAD_ID, VOCAB_SIZE, build_tokenizer


def save_tiny_pair(root: Path, seed: int = 0, noise: float = 0.03) -> tuple[str, str]:
    """A random tiny target with varied (not constant) greedy output, and a draft that is a
    noisy copy of it, so drafts are accepted often but not always."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.3,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    model = LlamaForCausalLM(config)
    paths = []
    for name in ("target", "draft"):
        if name == "draft":
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() > 1:
                        p.add_(torch.randn_like(p) * noise * p.std())
        path = root / name
        model.save_pretrained(path)
        build_tokenizer().save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, and CI's two cores are shared with subprocesses."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[str, str]:
    return save_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture(scope="session")
def demo_pair() -> tuple[str, str]:
    target, draft = DEMO_MODELS_DIR / "target", DEMO_MODELS_DIR / "draft"
    if not (target / "config.json").exists() or not (draft / "config.json").exists():
        pytest.fail(f"the bundled demo pair is missing under {DEMO_MODELS_DIR}; run `ssd build-demo-models`")
    return str(target), str(draft)


@pytest.fixture(scope="session")
def peaked_pair(tmp_path_factory) -> tuple[str, str]:
    """The statistical tests' pair (tests/ssd_stats.py): a peaked tiny target and a noisy copy."""
    from ssd_stats import save_peaked_pair

    return save_peaked_pair(tmp_path_factory.mktemp("ssd_peaked"))


@pytest.fixture(scope="session")
def peaked_target(peaked_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(peaked_pair[0], local_files_only=True, dtype=torch.float32).eval()
