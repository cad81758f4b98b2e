"""Loading a target/draft pair of Hugging Face causal LMs (local directory or hub id)."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ssd.core.config import EngineConfig
from ssd.model.lean_model import lean_checkpoint, lean_unsupported_reason, load_lean_model, stored_dtype
from ssd.model.model_config import CheckpointConfig, read_config
from ssd.model.tensor_parallel import TensorParallelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "auto": "auto"}


@dataclass
class LoadedPair:
    target: object  # PreTrainedModel, LeanModel, or a TensorParallelRunner (rank 0 of a split target)
    draft: object | None  # the same, for the draft
    tokenizer: object  # PreTrainedTokenizerBase (the target's)
    max_model_len: int

    def close(self) -> None:
        """Stop what loading started (a split model's ranks); for a caller whose engine did not
        come up: an engine closes its models itself."""
        for model in (self.target, self.draft):
            if isinstance(model, TensorParallelRunner):
                model.close()


def _source_kwargs(name: str) -> dict:
    # A path that exists is read offline; anything else is a hub id (fetching is the user's business).
    return {"local_files_only": True} if Path(name).exists() else {}


def load_model(name: str, dtype: str, device: str, trust_remote_code: bool = False, lean: bool = False):
    """The causal LM `name` (a local directory or a hub id) in `dtype` (_DTYPES) on `device`.

    lean: the engine runs the lean forward on it (EngineConfig.lean_forward). A Llama-architecture
    model in a local safetensors directory then loads as a LeanModel, with none of transformers'
    modeling code (its import is most of a draft worker's start: ssd/model/lean_model.py);
    anything else (a hub id, .bin weights, another architecture, lean False) loads through
    from_pretrained, a Hugging Face model with a forward of its own."""
    if lean and lean_checkpoint(name):
        hf_config = _hf_config(name, trust_remote_code, lean=True)
        reason = lean_unsupported_reason(hf_config)
        if reason is None:
            torch_dtype = _DTYPES[dtype] if dtype != "auto" else stored_dtype(name, hf_config)
            generation = lambda: load_generation_config(name, hf_config)  # noqa: E731 - read on first use
            return load_lean_model(name, hf_config, torch_dtype, torch.device(device), generation)
        logger.info("%s loads through Hugging Face (%s)", name, reason)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        name,
        dtype=_DTYPES[dtype],
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
        **_source_kwargs(name),
    )
    return model.to(device).eval()


def load_config(name: str, config: EngineConfig):
    return _hf_config(name, config.trust_remote_code, config.lean_forward)


def _hf_config(name: str, trust_remote_code: bool, lean: bool = False):
    """`name`'s Hugging Face config. Where the lean path applies (lean, a local safetensors
    checkpoint), the CheckpointConfig read_config builds (what AutoConfig gives, without importing
    transformers' config classes: ssd/model/model_config.py) unless it leaves the file to
    AutoConfig; AutoConfig's otherwise (it imports the configuration module, not modeling code)."""
    if lean and lean_checkpoint(name):
        config = read_config(name, name)
        if config is not None:
            return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **_source_kwargs(name))


def load_generation_config(directory: str, hf_config):
    """The generation config a model loaded from `directory` has: its generation_config.json,
    else what its config implies (as from_pretrained does)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory, local_files_only=True)
    except OSError:  # no generation_config.json
        # from_model_config reads a config's to_dict() (a CheckpointConfig's equals transformers'),
        # and takes that dict as it is.
        source = hf_config.to_dict() if isinstance(hf_config, CheckpointConfig) else hf_config
        return GenerationConfig.from_model_config(source)


def load_tokenizer(name: str, trust_remote_code: bool = False):
    """`name`'s tokenizer, as AutoTokenizer.from_pretrained loads it; where that provably comes down
    to TokenizersBackend.from_pretrained (loads_tokenizers_backend), that call itself, without the
    AutoConfig AutoTokenizer reads first (1.5 s of imports: ssd/model/model_config.py)."""
    if loads_tokenizers_backend(name):
        from transformers import TokenizersBackend

        # What AutoTokenizer passes it for a local directory (whose revision resolves to None).
        return TokenizersBackend.from_pretrained(name, local_files_only=True, _from_auto=True, revision=None)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **_source_kwargs(name))


# tokenizer_config.json classes AutoTokenizer resolves to TokenizersBackend: PreTrainedTokenizerFast
# is its alias (and, "Fast" stripped, PreTrainedTokenizer names PythonBackend, which it replaces).
BACKEND_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def loads_tokenizers_backend(name: str) -> bool:
    """Whether AutoTokenizer.from_pretrained(name) (transformers 5, models/auto/tokenization_auto.py)
    ends in TokenizersBackend.from_pretrained(name): `name` is a local directory whose
    - tokenizer_config.json has no auto_map (no tokenizer code of its own) and names its class in
      BACKEND_TOKENIZER_CLASSES (not LlamaTokenizer: its ByteLevel rule reads tokenizer.json);
    - config.json reads as AutoConfig reads it (read_config) with model_type llama (for which
      transformers registers no tokenizer class) or mistral while mistral-common is not installed
      (its registered class is then TokenizersBackend); qwen2 registers Qwen2Tokenizer, which
      AutoTokenizer prefers to the checkpoint's class;
    and no tokenizer class was registered with AutoTokenizer in this process."""
    directory = Path(name)
    try:
        declared = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(declared, dict) or "auto_map" in declared:
        return False
    if declared.get("tokenizer_class") not in BACKEND_TOKENIZER_CLASSES:
        return False
    config = read_config(directory, name)
    from transformers.utils import is_mistral_common_available, is_tokenizers_available

    if config is None or not is_tokenizers_available():
        return False
    if config.model_type != "llama" and (config.model_type != "mistral" or is_mistral_common_available()):
        return False
    auto = sys.modules.get("transformers.models.auto.tokenization_auto")  # registrations live there
    return auto is None or not (
        auto.REGISTERED_TOKENIZER_CLASSES or auto.REGISTERED_FAST_ALIASES or auto.TOKENIZER_MAPPING._extra_content
    )


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


def load_split(config: EngineConfig, role: str, rank_launcher=None) -> TensorParallelRunner:
    """config's target (role "target") or draft ("draft") split over its tensor-parallel ranks ->
    rank 0's TensorParallelRunner (with the model's `config` and `generation_config`, as a loaded
    model has them). rank_launcher: what starts the other ranks (ssd.model.tp_launch.RankLauncher;
    child processes by default). A draft's ranks run draft_num_threads threads each on CPU."""
    from ssd.model.tp_launch import size_option, start_split

    target = role == "target"
    directory, world = (config.target, config.tensor_parallel_size) if target else (
        config.draft, config.draft_tensor_parallel_size)  # fmt: skip
    if not Path(directory).is_dir():
        raise ValueError(
            f"{size_option(role)}={world} loads each rank's slices from a local checkpoint directory: {directory!r} "
            "is not one (download it first, e.g. with `hf download`)"
        )
    # A local directory (read offline) whose split runs the lean forward, whatever lean_forward says.
    hf_config = _hf_config(directory, config.trust_remote_code, lean=True)
    stored = getattr(hf_config, "dtype", None)  # the checkpoint's, for dtype "auto" (float32 when it names none)
    dtype = config.dtype if target else config.draft_dtype
    dtype = (str(stored).removeprefix("torch.") if stored else "float32") if dtype == "auto" else dtype
    runner = start_split(
        directory, hf_config, world, dtype, config.device if target else config.draft_device,
        config.pack_target_weights if target else True, config.num_threads if target else config.draft_num_threads,
        rank_launcher, role,
    )  # fmt: skip
    runner.config = hf_config
    runner.generation_config = load_generation_config(directory, hf_config)
    return runner


def load_draft(config: EngineConfig):
    """config's draft: a loaded model, or rank 0 of its split (draft_tensor_parallel_size > 1,
    the other ranks child processes of this one)."""
    if config.draft_tensor_parallel_size > 1:
        return load_split(config, "draft")
    return load_model(
        config.draft, config.draft_dtype, config.draft_device, config.trust_remote_code, config.lean_forward
    )


def context_limit(cfg) -> int:
    """The context length a Hugging Face config names."""
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell the context length of {cfg.__class__.__name__}: set max_model_len")


def load_pair(config: EngineConfig, rank_launcher=None) -> LoadedPair:
    """The target (over its tensor-parallel ranks, which rank_launcher starts where given), the
    draft where this process runs it (config.draft_in_engine; SSD's workers load their own) and
    the tokenizer, checked against each other."""
    tokenizer = load_tokenizer(config.target, config.trust_remote_code)
    if config.draft is not None:
        check_same_vocabulary(
            tokenizer, load_tokenizer(config.draft, config.trust_remote_code), config.target, config.draft
        )
    if config.tensor_parallel_size > 1:
        target = load_split(config, "target", rank_launcher)
    else:
        target = load_model(config.target, config.dtype, config.device, config.trust_remote_code, config.lean_forward)
    pair = LoadedPair(target, None, tokenizer, context_limit(target.config))
    try:
        if config.draft_in_engine:
            pair.draft = load_draft(config)
        if config.draft is not None:  # a draft the workers load limits the context too
            draft_config = pair.draft.config if pair.draft is not None else load_config(config.draft, config)
            pair.max_model_len = min(pair.max_model_len, context_limit(draft_config))
        if config.max_model_len is not None and config.max_model_len > pair.max_model_len:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the models' context length {pair.max_model_len}"
            )
    except BaseException:
        pair.close()
        raise
    pair.max_model_len = config.max_model_len or pair.max_model_len
    logger.info(
        "loaded target %s%s, context %d", config.target, f" and draft {config.draft}" if pair.draft else "",
        pair.max_model_len,
    )  # fmt: skip
    return pair
