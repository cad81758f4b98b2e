"""Runs a Hugging Face causal LM (or a LeanModel of its weights) over a StaticKVCache: batched,
padded, masked forwards."""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from ssd.core.transfer import to_device
from ssd.model.cuda_graphs import CudaGraphs, GraphStats
from ssd.model.fast_forward import FastLlamaForward, can_pack, unsupported_reason
from ssd.model.kv_cache import COLUMN_MULTIPLE, StaticKVCache, start_columns
from ssd.model.lean_model import LeanModel
from ssd.model.step_graphs import StepGraphs
from ssd.model.tensor_parallel import TensorParallelRunner

logger = logging.getLogger(__name__)


class ModelRunner:
    """One model (target or draft) and the forward pass the engine needs from it.

    Every forward writes n columns per row into the cache: tokens [b, n] with new_valid [b, n]
    marking the real ones, which the row commits (its padding lies past its length, unseen).
    Positions default to each row's next positions.
    With lean=True, Llama-architecture models run through FastLlamaForward (same math, less
    Python per call); other models, or lean=False, run the Hugging Face forward. fused=True
    fuses and prepacks the projections (faster for few-token forwards on CPU, not bit-identical
    to Hugging Face). A bfloat16 or float16 model on CPU attends in float32 through the lean
    forward (its cache is float32 too): CPU attention kernels are slow in reduced precision
    (single-query attention over 400 cached columns: 270 us in bfloat16, 46 us in float32, on the
    development CPU), and the cache costs little next to the weights at a draft's size.
    """

    def __init__(
        self, model, device: torch.device, lean: bool = True, fused: bool = False, parallel=None, eager: bool = False
    ) -> None:
        """parallel: None, or a tensor-parallel rank's communicator, `model` being that rank's shard
        (ssd/model/shards.py: shaped like a model as the lean forward reads it, which is the only
        forward a shard has, as it is a LeanModel's, whatever `lean` says). On a CUDA device the lean
        forward replays CUDA graphs (ssd/model/cuda_graphs.py) unless eager is set (enforce_eager)
        or the model is a shard."""
        self.model = model
        self.device = device
        self.dtype = model.model.embed_tokens.weight.dtype if parallel is not None else next(model.parameters()).dtype
        self.vocab_size = model.config.vocab_size
        self.lean: FastLlamaForward | None = None
        self.attention_dtype = self.dtype  # of the attention masks, and of the cache
        # A shard, or a model loaded for the lean forward (loader.load_model), has no other forward.
        lean_only = parallel is not None or isinstance(model, LeanModel)
        # Hugging Face models take logits_to_keep (older or remote-code ones may not).
        self._keeps_logits = not lean_only and "logits_to_keep" in inspect.signature(model.forward).parameters
        lean = lean or lean_only
        reason = unsupported_reason(model) if lean else None
        if reason is not None and lean_only:
            what = "tensor parallelism runs" if parallel is not None else "a LeanModel runs only"
            raise ValueError(f"{what} the lean forward, which does not support this model: {reason}")
        if reason is not None:
            logger.info("lean forward unavailable (%s): using the Hugging Face forward", reason)
        elif lean:
            if device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16):
                self.attention_dtype = torch.float32
            upcast = self.attention_dtype if self.attention_dtype != self.dtype else None
            self.lean = FastLlamaForward(model, fused=fused, attention_dtype=upcast, parallel=parallel)
        self.graphs: CudaGraphs | None = None
        if self.lean is not None and device.type == "cuda" and parallel is None and not eager:
            self.graphs = CudaGraphs(self.lean, device, self.attention_dtype)
        # The sampling and verification between forwards replay graphs too, counted in the same stats.
        self.steps: StepGraphs | None = StepGraphs(device, self.graphs.stats) if self.graphs is not None else None

    def close(self) -> None:
        """Nothing to release (a TensorParallelRunner, the other target runner, stops its ranks)."""

    def broken(self) -> str | None:
        """Why this runner cannot run a forward: never, in-process (see TensorParallelRunner)."""
        return None

    def new_cache(self, rows: int = 1, columns: int = COLUMN_MULTIPLE, max_bytes: int | None = None) -> StaticKVCache:
        """An empty cache with room for `rows` rows of `columns` columns at its first forward, or
        as many columns as fit in max_bytes (kv_cache.start_columns); it grows past them."""
        return StaticKVCache(rows, self.start_columns(rows, columns, max_bytes))

    def start_columns(self, rows: int, columns: int, max_bytes: int | None) -> int:
        """The columns new_cache gives a cache of `rows` rows that wants `columns`."""
        return columns if max_bytes is None else start_columns(rows, columns, self.slot_bytes(), max_bytes)

    def slot_bytes(self) -> int:
        """Bytes of one row's column of this model's KV cache: every layer's key and value (a
        shard's config names the whole model's heads: an upper bound for its share)."""
        cfg = self.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cfg.num_hidden_layers * 2 * heads * dim * self.attention_dtype.itemsize

    @torch.inference_mode()
    def forward(
        self,
        cache: StaticKVCache,
        tokens: torch.Tensor,
        new_valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        columns: torch.Tensor | None = None,
        on_host: bool = True,
        with_logits: bool = True,
    ) -> torch.Tensor | None:
        """tokens [b, n] -> logits [b, n, V] (float32; on CPU, or left on the model's device when
        on_host is False).

        new_valid [b, n]: the real tokens, a prefix of each row (rows are right-padded); each row
        commits its real tokens to the cache. A cache with no rows yet takes the batch's b rows.

        Runs under torch.inference_mode (as do the cache's rollbacks and the engine's step): no
        view or version tracking, about 13% less time per draft forward on CPU than no_grad
        (paired A/B, ad hoc). Its tensors are inference tensors: read them anywhere, change them
        in place only through this package.

        A scratch forward (SSD's tree) gives `columns` [b, n], where its tokens are written (past
        each row's length), `positions` and a prebuilt additive `attn_mask` [b, 1, n, width] in
        attention_dtype (width = max(columns) + 1); it commits nothing.

        with_logits=False: a prefill whose logits nobody reads (the LM head over every prompt position
        is [b, n, V], 2 GB of float32 for a 4k-token prompt at V = 128k): returns None."""
        b, n = tokens.shape
        if new_valid is None:
            new_valid = torch.ones(b, n, dtype=torch.bool)
        if cache.batch_size == 0:
            cache.add_rows(b)
        assert cache.batch_size == b, (cache.batch_size, b)
        if positions is None:
            positions = cache.lengths().unsqueeze(1) + torch.arange(n)
        width = cache.begin_forward(n, self.device, columns)
        if self.graphs is not None:
            logits = self._replayed(cache, tokens, new_valid, positions, attn_mask, columns, width, with_logits)
            if logits is not None:
                cache.commit(new_valid)
                return logits.cpu() if on_host else logits
            self.graphs.stats.eager_forwards += 1
        if attn_mask is None:
            mask = cache.attention_mask(new_valid, self.attention_dtype, self.device)
        else:
            assert attn_mask.shape == (b, 1, n, width) and attn_mask.dtype == self.attention_dtype
            mask = to_device(attn_mask, self.device)
        tokens, position_ids = to_device(tokens, self.device), to_device(positions, self.device)
        if self.lean is not None:
            self.lean.reserve_positions(int(positions.max()) + 1, self.device)  # from the host copy
            logits = self.lean(tokens, mask, position_ids, cache, head=with_logits)
        else:
            keep = {"logits_to_keep": 1} if not with_logits and self._keeps_logits else {}
            logits = self.model(
                input_ids=tokens, attention_mask=mask, position_ids=position_ids, past_key_values=_hf_view(cache),
                use_cache=True, **keep,
            ).logits  # fmt: skip
        cache.commit(new_valid)
        if not with_logits or logits is None:  # None: a tensor-parallel rank other than 0
            return None
        return logits.float().cpu() if on_host else logits.float()

    def _replayed(self, cache, tokens, new_valid, positions, attn_mask, columns, width, with_logits):
        """The forward by a CUDA graph replay -> its logits, or None where none applies (a
        forward whose logits nobody reads is a prefill: left eager)."""
        if not with_logits:
            return None
        if columns is None:  # a default forward writes each row's next n columns
            columns = cache.lengths().unsqueeze(1) + torch.arange(tokens.shape[1])
        self.lean.reserve_positions(int(positions.max()) + 1, self.device)
        return self.graphs.forward(cache, tokens, positions, columns, new_valid, attn_mask, width)

    def graph_stats(self) -> GraphStats | None:
        """What this runner's CUDA graphs did (None: it runs eagerly)."""
        return self.graphs.stats if self.graphs is not None else None


def _hf_view(cache: StaticKVCache):
    """`cache` as a Hugging Face forward's past_key_values (_hf_view_class)."""
    return _hf_view_class()(cache)


@functools.cache
def _hf_view_class() -> type:
    """The Cache subclass that shows a StaticKVCache to a Hugging Face forward: each attention
    layer's update writes its new columns and reads back the forward's keys and values. Made on
    the first Hugging Face forward: transformers' Cache module imports its config classes
    (transformers.configuration_utils), which a lean-only process does without."""
    from transformers import Cache

    class HFView(Cache):
        def __init__(self, cache: StaticKVCache) -> None:
            super().__init__(layers=[])
            self.cache = cache

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return self.cache.append(layer_idx, key_states, value_states)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return int(self.cache.lengths().max()) if self.cache.batch_size else 0

    return HFView


def draft_runner(model, device: str, lean: bool, eager: bool = False) -> ModelRunner:
    """The draft's runner wherever the draft runs (SD proposer, in-process or worker drafter):
    always fused (off CPU in place: fast_forward._Linear)."""
    if isinstance(model, TensorParallelRunner):  # loaded as its ranks already (loader.load_draft)
        return model
    return ModelRunner(model, torch.device(device), lean, fused=True, eager=eager)


def target_runner(model, device: str, lean: bool, pack: bool, eager: bool = False) -> ModelRunner:
    """The target's runner. With pack=True it fuses its projections (q, k, v; gate, up): on CPU
    prepacked for oneDNN where it can pack them (elsewhere on CPU unfused, bit-identical to
    Hugging Face); off CPU in place, the modules' weights becoming views of the fused ones (no
    copy): fewer, wider products per layer, as vLLM's fused QKV and gate-up layers run."""
    if isinstance(model, TensorParallelRunner):  # loaded as its ranks already (loader.load_split)
        return model
    weight = next(model.parameters())
    fused = pack and (can_pack(weight) or weight.device.type != "cpu")
    return ModelRunner(model, torch.device(device), lean, fused=fused, eager=eager)


def pad_rows(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists: -> tokens [b, n], valid [b, n]; n >= 1 (an all-padding column
    keeps every cache layer initialized even when each row is empty)."""
    n = max(1, max((len(r) for r in rows), default=0))
    tokens = torch.zeros(len(rows), n, dtype=torch.long)
    valid = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        valid[i, : len(r)] = True
    return tokens, valid
