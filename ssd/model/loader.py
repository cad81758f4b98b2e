"""Loading a target/draft pair of Hugging Face causal LMs (local directory or hub id)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ssd.core.config import EngineConfig
from ssd.model.tensor_parallel import TensorParallelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "auto": "auto"}


@dataclass
class LoadedPair:
    target: object  # PreTrainedModel, or a TensorParallelRunner (rank 0 of a split target)
    draft: object | None
    tokenizer: object  # PreTrainedTokenizerBase (the target's)
    max_model_len: int

    def close(self) -> None:
        """Stop what loading started (a split target's ranks); for a caller whose engine did not
        come up: an engine closes its target itself."""
        if isinstance(self.target, TensorParallelRunner):
            self.target.close()


def _source_kwargs(name: str) -> dict:
    # A path that exists is read offline; anything else is a hub id (fetching is the user's business).
    return {"local_files_only": True} if Path(name).exists() else {}


def load_model(name: str, dtype: str, device: str, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        name,
        dtype=_DTYPES[dtype],
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
        **_source_kwargs(name),
    )
    return model.to(device).eval()


def load_tokenizer(name: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **_source_kwargs(name))


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if t_vocab != d_vocab:
        only_t = len(set(t_vocab.items()) - set(d_vocab.items()))
        only_d = len(set(d_vocab.items()) - set(t_vocab.items()))
        raise ValueError(
            f"draft vocabulary does not match the target's: {draft_name!r} has {len(d_vocab)} tokens, "
            f"{target_name!r} has {len(t_vocab)} ({only_d} draft and {only_t} target entries differ); "
            "choose a draft trained with the target's tokenizer"
        )


def load_tensor_parallel(config: EngineConfig, rank_launcher=None):
    """The target split over config.tensor_parallel_size ranks -> rank 0's TensorParallelRunner
    (with the model's `config` and `generation_config`, as a loaded model has them).
    rank_launcher: what starts the other ranks (ssd.model.tp_launch.RankLauncher; child processes
    by default)."""
    from transformers import AutoConfig, GenerationConfig

    from ssd.model.tp_launch import start_target

    if not Path(config.target).is_dir():
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size} loads each rank's slices from a local checkpoint "
            f"directory: {config.target!r} is not one (download it first, e.g. with `hf download`)"
        )
    hf_config = AutoConfig.from_pretrained(
        config.target, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    stored = getattr(hf_config, "dtype", None)  # the checkpoint's, for dtype "auto" (float32 when it names none)
    dtype = (str(stored).removeprefix("torch.") if stored else "float32") if config.dtype == "auto" else config.dtype
    runner = start_target(
        config.target, hf_config, config.tensor_parallel_size, dtype, config.device, config.pack_target_weights,
        config.num_threads, rank_launcher,
    )  # fmt: skip
    runner.config = hf_config
    try:
        runner.generation_config = GenerationConfig.from_pretrained(config.target, local_files_only=True)
    except OSError:  # no generation_config.json: what the model's config implies, as from_pretrained does
        runner.generation_config = GenerationConfig.from_model_config(hf_config)
    return runner


def context_limit(model) -> int:
    cfg = model.config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell the context length of {cfg.__class__.__name__}: set max_model_len")


def load_pair(config: EngineConfig, rank_launcher=None) -> LoadedPair:
    """The target (over its tensor-parallel ranks, which rank_launcher starts where given), the
    draft and the tokenizer, checked against each other."""
    tokenizer = load_tokenizer(config.target, config.trust_remote_code)
    draft = None
    if config.draft is not None:
        check_same_vocabulary(
            tokenizer, load_tokenizer(config.draft, config.trust_remote_code), config.target, config.draft
        )
    if config.tensor_parallel_size > 1:
        target = load_tensor_parallel(config, rank_launcher)
    else:
        target = load_model(config.target, config.dtype, config.device, config.trust_remote_code)
    limit = context_limit(target)
    if config.draft is not None:
        draft = load_model(config.draft, config.draft_dtype, config.draft_device, config.trust_remote_code)
        limit = min(limit, context_limit(draft))
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the models' context length {limit}")
        limit = config.max_model_len
    logger.info("loaded target %s%s, context %d", config.target, f" and draft {config.draft}" if draft else "", limit)
    return LoadedPair(target, draft, tokenizer, limit)
