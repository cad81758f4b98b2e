"""A target and a draft at any Llama shapes whose next-token distributions agree by construction,
at a rate one knob sets: ordinary Hugging Face Llama checkpoints the engine runs unchanged.

Why: random weights at real shapes (real_shapes.py) time the forwards truthfully but make every
draft guess worthless, so sd and ssd show nothing of what a user would see; training a pair at
8B/1B shapes is out of reach here, building one is not.

The construction (every weight still a dense matrix of its full size, so the timings stay those
of the shapes):
- shared by both models: successor maps succ_1..succ_m (random permutations of the ordinary
  tokens; nothing leads to the special ones) with weights w_1 > ... > w_m, and a random unit
  vector a_t in R^rank per token;
- each model, with an orthonormal Q [rank, hidden] of its own: embedding row t is
  sqrt(hidden) a_t Q (RMS 1), head row y is logit_scale / sqrt(hidden) sum_j w_j a_{succ_j^-1(y)} Q
  (zero for a special token). With silent layers the final norm sees the embedding, so
  logits(x)_y = logit_scale sum_j w_j <a_{succ_j^-1(y)}, a_x>: succ_j(x) gets logit_scale w_j, any
  other token a cross-talk of about logit_scale |w| / sqrt(rank), and both models give the same
  distribution: a few ranked candidates (what sampling at T=1 meets), then a flat tail;
- each model's layers are random and its own; their output projections (o_proj, down_proj) write
  only into the rank-dim subspace the head reads, calibrated on a forward so that each of the 2L
  writes has RMS scale / sqrt(2L) against the embedding's 1 (their sum about `scale`). Scale 0
  makes the two models identical (acceptance 1); as it grows, each model's logits move,
  context-dependently (attention) and independently of the other's: the candidates swap ranks
  and the distributions part, and acceptance falls. How fast depends on the weights, rank,
  vocabulary and logit_scale, little on the hidden sizes or depths (the writes are normalized,
  and only their part in the subspace reaches the logits): docs/gpu.md has the measured table.

The draft's head is untied even where its shape's model ties it (Llama-3.2-1B): a tied head would
be the embedding, and logits <e_y, e_x> favor x itself. Untying adds memory, not bandwidth: a
decoding step reads a head of the same size either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ssd.model.demo_models import EOS_ID, PAD_ID

# Chosen for a Llama-3.1-8B / Llama-3.2-1B-like acceptance (about 0.77 a token at T=0, an assumed
# figure) at their vocabulary: docs/gpu.md, "The acceptance-matched pair", has the measured table.
DEFAULT_SCALE = 0.7


@dataclass(frozen=True)
class PairSpec:
    """What decides the pair's weights besides the shapes."""

    scale: float = DEFAULT_SCALE  # RMS of the layers' total write against the embedding's 1
    # The candidates' logits over logit_scale. The rank bounds the tail: 128256 tokens of
    # cross-talk at rank 64 outweigh any candidate at T=1; at 256, a candidate of 30 stands clear.
    successor_weights: tuple[float, ...] = (1.0, 0.9, 0.8)
    rank: int = 256  # dimension of the shared token map (at most the smaller hidden size)
    logit_scale: float = 30.0
    seed: int = 0
    query_gain: float = 2.0  # q and k weights' std times sqrt(hidden): sharp, context-dependent attention
    calibration_passes: int = 3


def llama_config(shape: dict, vocab_size: int, max_positions: int):
    """A LlamaConfig of `shape` (real_shapes.SHAPES' fields), untied, with the demo tokenizer's
    special tokens."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=max_positions, rope_theta=500000.0, rms_norm_eps=1e-5,
        eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=PAD_ID, **{**shape, "tie_word_embeddings": False},
    )  # fmt: skip


def build_matched_pair(
    target_shape: dict,
    draft_shape: dict,
    spec: PairSpec = PairSpec(),
    vocab_size: int = 128256,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    max_positions: int = 2048,
):
    """-> (target, draft): LlamaForCausalLM models in eval mode on `device`, built as the module
    docstring says."""
    rank = min(spec.rank, target_shape["hidden_size"], draft_shape["hidden_size"])
    token_vectors, previous = shared_map(vocab_size, rank, spec.seed, len(spec.successor_weights))
    models = []
    for offset, shape in ((1, target_shape), (2, draft_shape)):
        config = llama_config(shape, vocab_size, max_positions)
        models.append(_build_one(config, spec, token_vectors, previous, spec.seed + 1000 * offset, device, dtype))
    return models[0], models[1]


def shared_map(vocab_size: int, rank: int, seed: int, maps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (token vectors [V, rank] of unit norm, previous [maps, V]: under each successor map,
    the token whose successor each token is, -1 for the special ones), seeded on the CPU so that
    both models get the same."""
    gen = torch.Generator().manual_seed(seed)
    special = torch.zeros(vocab_size, dtype=torch.bool)
    special[[t for t in (EOS_ID, PAD_ID) if t < vocab_size]] = True
    ordinary = torch.nonzero(~special).squeeze(1)
    previous = torch.full((maps, vocab_size), -1, dtype=torch.long)
    for j in range(maps):  # drawn first: the maps are the same at any rank
        previous[j, ordinary[torch.randperm(len(ordinary), generator=gen)]] = ordinary
    vectors = torch.randn(vocab_size, rank, generator=gen)
    return vectors / vectors.norm(dim=1, keepdim=True), previous


def successor_path(previous: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """[len(starts), length] token ids following the successor map `previous` [V] (one row of
    shared_map's) from each start (calibration input: what the models mostly generate)."""
    successor = torch.zeros_like(previous)
    ordinary = previous >= 0
    successor[previous[ordinary]] = torch.nonzero(ordinary).squeeze(1)
    rows = [starts]
    for _ in range(length - 1):
        rows.append(successor[rows[-1]])
    return torch.stack(rows, dim=1)


@torch.no_grad()
def _build_one(config, spec: PairSpec, vectors, previous, seed: int, device: str, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa")
    gen = torch.Generator(device=device).manual_seed(seed)
    basis = torch.linalg.qr(_randn((config.hidden_size, vectors.shape[1]), gen, device))[0].T.contiguous()
    vectors, previous = vectors.to(device), previous.to(device)
    _fill_token_map(model, spec, vectors, previous, basis)
    _fill_layers(model, spec, basis, gen)
    model.eval()
    starts = torch.nonzero(previous[0] >= 0).squeeze(1)
    pick = torch.randperm(len(starts), generator=torch.Generator().manual_seed(seed))[:4]
    calibrate_writes(model, successor_path(previous[0], starts[pick.to(device)], 128), spec)
    return model


def _fill_token_map(model, spec: PairSpec, vectors, previous, basis) -> None:
    """The embedding and the head (basis: [rank, hidden], this model's)."""
    hidden = basis.shape[1]
    head_rows = sum(w * vectors[before.clamp(min=0)] * (before >= 0).unsqueeze(1)
                    for w, before in zip(spec.successor_weights, previous))  # fmt: skip
    _fill_rows(model.model.embed_tokens.weight, vectors, basis, math.sqrt(hidden))
    _fill_rows(model.lm_head.weight, head_rows, basis, spec.logit_scale / math.sqrt(hidden))


def _fill_layers(model, spec: PairSpec, basis, gen: torch.Generator) -> None:
    """Random layers: inputs read at unit gain (q and k sharper), writes at about the calibrated
    size already, so that calibration converges in a few passes."""
    rank, hidden = basis.shape
    device = basis.device
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for linear, std in ((attn.q_proj, spec.query_gain), (attn.k_proj, spec.query_gain), (attn.v_proj, 1.0),
                            (mlp.gate_proj, 1.0), (mlp.up_proj, 1.0)):  # fmt: skip
            linear.weight.copy_(_randn(linear.weight.shape, gen, device) * (std / math.sqrt(hidden)))
        for linear in (attn.o_proj, mlp.down_proj):
            # Into the subspace the head reads: a write there moves the logits; elsewhere it would
            # only grow the norm the final RMSNorm divides by.
            inner = linear.weight.shape[1]
            linear.weight.copy_(basis.T @ _randn((rank, inner), gen, device) * math.sqrt(hidden / rank / inner))


def _randn(shape, gen: torch.Generator, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32)


def _fill_rows(weight: torch.Tensor, rows: torch.Tensor, basis: torch.Tensor, factor: float) -> None:
    """weight = factor * rows @ basis, in blocks of rows (a [128256, 4096] float32 product at once
    is 2 GiB beside the model)."""
    for start in range(0, weight.shape[0], 16384):
        weight[start : start + 16384].copy_(rows[start : start + 16384] @ basis * factor)


def _writes(model) -> list[torch.nn.Linear]:
    return [m for layer in model.model.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]


@torch.no_grad()
def calibrate_writes(model, tokens: torch.Tensor, spec: PairSpec) -> None:
    """Scale each output projection so that its write's RMS over `tokens` is scale / sqrt(2L).
    Repeated: a write's input is normalized, but its direction moves with the writes upstream."""
    writes = _writes(model)
    if spec.scale == 0:
        for linear in writes:
            linear.weight.zero_()
        return
    wanted = spec.scale / math.sqrt(len(writes))
    for _ in range(spec.calibration_passes):
        measured = write_rms(model, tokens)
        for linear, rms in zip(writes, measured):
            linear.weight.mul_(wanted / max(rms, 1e-12))


@torch.no_grad()
def write_rms(model, tokens: torch.Tensor) -> list[float]:
    """The RMS of each output projection's write (o_proj, down_proj by layer) over `tokens`."""
    measured: list[float] = []

    def record(_module, _inputs, output) -> None:
        measured.append(float(output.float().pow(2).mean().sqrt()))

    hooks = [linear.register_forward_hook(record) for linear in _writes(model)]
    try:
        model(input_ids=tokens.to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return measured


@torch.no_grad()
def perturbation_rms(model, tokens: torch.Tensor) -> float:
    """RMS of what the layers added to the residual stream (before the final norm) over `tokens`,
    against the embedding's: the effective scale."""
    seen: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].float()))
    try:
        tokens = tokens.to(model.device)
        model(input_ids=tokens)
    finally:
        hook.remove()
    embedded = model.model.embed_tokens(tokens).float()
    return float((seen[0] - embedded).pow(2).mean().sqrt() / embedded.pow(2).mean().sqrt())
