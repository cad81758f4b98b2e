"""Runs a Hugging Face causal LM over a BatchKVCache: batched, padded, masked forwards."""

from __future__ import annotations

import logging

import torch

from ssd.model.fast_forward import FastLlamaForward, can_pack, unsupported_reason
from ssd.model.kv_cache import BatchKVCache

logger = logging.getLogger(__name__)


class ModelRunner:
    """One model (target or draft) and the forward pass the engine needs from it.

    Every forward appends n columns to the cache: tokens [b, n] with new_valid [b, n] marking the
    real ones (padding is masked out forever). Positions default to each row's next positions.
    With lean=True, Llama-architecture models run through FastLlamaForward (same math, less
    Python per call); other models, or lean=False, run the Hugging Face forward. fused=True
    fuses and prepacks the projections (faster for few-token forwards on CPU, not bit-identical
    to Hugging Face). A bfloat16 or float16 model on CPU attends in float32 through the lean
    forward (its cache is float32 too): CPU attention kernels are slow in reduced precision
    (single-query attention over 400 cached columns: 270 us in bfloat16, 46 us in float32, on the
    development CPU), and the cache costs little next to the weights at a draft's size.
    """

    def __init__(self, model, device: torch.device, lean: bool = True, fused: bool = False) -> None:
        self.model = model
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = model.config.vocab_size
        self.lean: FastLlamaForward | None = None
        self.attention_dtype = self.dtype  # of the attention masks, and of the cache
        if lean:
            reason = unsupported_reason(model)
            if reason is None:
                if device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16):
                    self.attention_dtype = torch.float32
                upcast = self.attention_dtype if self.attention_dtype != self.dtype else None
                self.lean = FastLlamaForward(model, fused=fused, attention_dtype=upcast)
            else:
                logger.info("lean forward unavailable (%s): using the Hugging Face forward", reason)

    def new_cache(self) -> BatchKVCache:
        return BatchKVCache(self.model.config)

    @torch.inference_mode()
    def forward(
        self,
        cache: BatchKVCache,
        tokens: torch.Tensor,
        new_valid: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        within: torch.Tensor | None = None,
        history: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [b, n] -> logits [b, n, V] (float32, on CPU).

        Runs under torch.inference_mode (as do the cache's rollbacks and the engine's step): no
        view or version tracking, about 13% less time per draft forward on CPU than no_grad
        (paired A/B, ad hoc). Its tensors are inference tensors: read them anywhere, change them
        in place only through this package.

        attn_mask: a prebuilt additive mask [b, 1, n, L+n] in attention_dtype (a caller that runs
        many forwards under one visibility pattern builds it once); it replaces the mask that
        new_valid, within and history would give, so it must hide padding and invalid columns."""
        b, n = tokens.shape
        if new_valid is None:
            new_valid = torch.ones(b, n, dtype=torch.bool)
        if cache.batch_size == 0 and cache.num_columns == 0:
            cache.valid = torch.zeros(b, 0, dtype=torch.bool)
        assert cache.batch_size == b, (cache.batch_size, b)
        if positions is None:
            positions = cache.lengths().unsqueeze(1) + new_valid.long().cumsum(1) - 1
            positions.clamp_(min=0)
        if attn_mask is None:
            mask = cache.attention_mask(new_valid, within, self.attention_dtype, history)
        else:
            assert attn_mask.shape == (b, 1, n, cache.num_columns + n) and attn_mask.dtype == self.attention_dtype
            mask = attn_mask
        if self.lean is not None:
            logits = self.lean(tokens.to(self.device), mask.to(self.device), positions.to(self.device), cache)
            cache.commit_columns(new_valid)
            return logits.float().cpu()
        out = self.model(
            input_ids=tokens.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache.hf_cache,
            use_cache=True,
        )
        cache.commit_columns(new_valid)
        return out.logits.float().cpu()


def draft_runner(model, device: str, lean: bool) -> ModelRunner:
    """The draft's runner wherever the draft runs (SD proposer, in-process or worker drafter):
    always fused (a draft's weights are small, so a concatenated copy costs little off CPU too)."""
    return ModelRunner(model, torch.device(device), lean, fused=True)


def target_runner(model, device: str, lean: bool, pack: bool) -> ModelRunner:
    """The target's runner. With pack=True it fuses and prepacks its projections only where
    oneDNN can pack them (CPU): elsewhere fusing would copy the target's weights for nothing."""
    weight = next(model.parameters())
    return ModelRunner(model, torch.device(device), lean, fused=pack and can_pack(weight))


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
