"""Train the bundled demo model pair from the Python standard library's own source.

The pair is the embedded default: a target and a draft causal LM in standard Hugging Face
format (Llama architecture, byte-level tokenizer shared by both). Bytes rather than BPE pieces
because source code is far more predictable per byte, which is what a tiny draft needs to agree
with the target often. The draft is distilled from the target (KL to the target's next-byte
distribution), so it learns to imitate the target rather than the corpus.

Everything is seeded; the corpus is the running interpreter's stdlib, so a rebuild on the same
Python version reproduces the committed weights up to floating-point nondeterminism of threads.
"""

from __future__ import annotations

import json
import logging
import math
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ssd.core.threads import set_process_threads

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
NUM_BYTES = 256
EOS_ID = NUM_BYTES
PAD_ID = NUM_BYTES + 1
VOCAB_SIZE = NUM_BYTES + 2


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    intermediate: int


@dataclass(frozen=True)
class DemoTrainingConfig:
    """What `ssd build-demo-models` trains; the defaults produced the committed pair."""

    target: ModelShape = ModelShape(hidden=384, layers=10, heads=6, intermediate=1024)
    draft: ModelShape = ModelShape(hidden=256, layers=2, heads=4, intermediate=640)
    seq_len: int = 256
    batch_size: int = 16
    target_steps: int = 900
    draft_steps: int = 700
    target_lr: float = 2e-3
    draft_lr: float = 3e-3
    warmup_steps: int = 60
    max_position_embeddings: int = 2048
    seed: int = 0
    # 1 in `holdout_every` stdlib files (by a stable hash of the path) is never trained on.
    holdout_every: int = 20
    threads: int = 2
    extra: dict = field(default_factory=dict)


def stdlib_files() -> list[Path]:
    """Sorted .py files of this interpreter's standard library (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts]
    return sorted(files, key=lambda p: str(p.relative_to(root)))


def is_heldout(path: Path, holdout_every: int) -> bool:
    root = Path(sysconfig.get_paths()["stdlib"])
    return zlib.crc32(str(path.relative_to(root)).encode()) % holdout_every == 0


def load_corpus(heldout: bool, holdout_every: int = 20) -> torch.Tensor:
    """Byte tokens of the (train or held-out) stdlib files, each file followed by EOS."""
    chunks: list[torch.Tensor] = []
    eos = torch.tensor([EOS_ID], dtype=torch.int16)
    for path in stdlib_files():
        if is_heldout(path, holdout_every) != heldout:
            continue
        data = path.read_bytes()
        if not data:
            continue
        chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16))
        chunks.append(eos)
    return torch.cat(chunks)


def heldout_prompts(count: int, prompt_bytes: int = 128, seed: int = 1234) -> list[str]:
    """Code-completion prompts cut from held-out stdlib files at line starts (deterministic)."""
    gen = torch.Generator().manual_seed(seed)
    texts = []
    for path in stdlib_files():
        if not is_heldout(path, DemoTrainingConfig.holdout_every):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if len(text) > 4 * prompt_bytes and text.isascii():
            texts.append(text)
    prompts = []
    while len(prompts) < count:
        text = texts[int(torch.randint(len(texts), (1,), generator=gen))]
        start = int(torch.randint(len(text) - 2 * prompt_bytes, (1,), generator=gen))
        start = text.find("\n", start) + 1
        prompt = text[start : start + prompt_bytes]
        if prompt.strip():
            prompts.append(prompt)
    return prompts


def build_tokenizer():
    """A byte-level tokenizer: token i < 256 is byte i; then EOS and PAD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps byte b to a printable char; order the vocab so id == byte value.
    mapping = _bytes_to_unicode()
    vocab = {mapping[b]: b for b in range(NUM_BYTES)}
    assert set(vocab) == set(byte_chars)
    vocab[EOS_TOKEN] = EOS_ID
    vocab[PAD_TOKEN] = PAD_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=DemoTrainingConfig.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )


def _bytes_to_unicode() -> dict[int, str]:
    # The GPT-2 byte-to-printable-char table that the ByteLevel pre-tokenizer uses.
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(NUM_BYTES):
        if b not in printable:
            printable.append(b)
            chars.append(NUM_BYTES + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def make_model(shape: ModelShape, cfg: DemoTrainingConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def _batches(corpus: torch.Tensor, cfg: DemoTrainingConfig, gen: torch.Generator):
    span = cfg.seq_len + 1
    while True:
        starts = torch.randint(len(corpus) - span, (cfg.batch_size,), generator=gen)
        yield torch.stack([corpus[s : s + span] for s in starts.tolist()]).long()


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _train(model, corpus, cfg, steps, lr, teacher=None, desc="train", progress=True):
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(cfg.seed + (1 if teacher is not None else 0))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    bar = tqdm(range(steps), desc=desc, disable=not progress)
    batches = _batches(corpus, cfg, gen)
    ema = None
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr, cfg.warmup_steps)
        batch = next(batches)
        inputs, labels = batch[:, :-1], batch[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=inputs).logits.float()
        if teacher is None:
            loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1))
        else:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                teacher_logits = teacher(input_ids=inputs).logits.float()
            # Forward KL to the teacher: the draft should put its mass where the target does.
            loss = F.kl_div(
                F.log_softmax(logits, -1).reshape(-1, VOCAB_SIZE),
                F.log_softmax(teacher_logits, -1).reshape(-1, VOCAB_SIZE),
                log_target=True,
                reduction="batchmean",
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}")
    model.eval()
    return ema


@torch.no_grad()
def heldout_loss(model, corpus: torch.Tensor, cfg: DemoTrainingConfig, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(99)
    it = _batches(corpus, cfg, gen)
    total = 0.0
    for _ in range(batches):
        batch = next(it)
        logits = model(input_ids=batch[:, :-1]).logits
        total += F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1)).item()
    return total / batches


def build_demo_models(
    out_dir: Path, cfg: DemoTrainingConfig = DemoTrainingConfig(), progress: bool = True, draft_only: bool = False
) -> dict:
    """Train target then distil draft; save both (fp16 safetensors) under out_dir/{target,draft}.

    draft_only: keep the target already in out_dir/target and distil a new draft from it (as
    the engine will run it: the saved fp16 weights in fp32)."""
    torch.manual_seed(cfg.seed)
    set_process_threads(cfg.threads)
    out_dir = Path(out_dir)
    started = time.perf_counter()
    train = load_corpus(heldout=False, holdout_every=cfg.holdout_every)
    held = load_corpus(heldout=True, holdout_every=cfg.holdout_every)
    logger.info("corpus: %d train bytes, %d held-out bytes", len(train), len(held))
    tokenizer = build_tokenizer()

    previous = {}
    if draft_only:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(
            out_dir / "target", local_files_only=True, dtype=torch.float32
        ).eval()
        report_path = out_dir / "training_report.json"
        previous = json.loads(report_path.read_text()) if report_path.exists() else {}
        target_loss, target_minutes = previous.get("target_train_loss"), previous.get("target_train_minutes", 0.0)
    else:
        target = make_model(cfg.target, cfg)
        t0 = time.perf_counter()
        target_loss = _train(target, train, cfg, cfg.target_steps, cfg.target_lr, desc="target", progress=progress)
        target_minutes = (time.perf_counter() - t0) / 60

    draft = make_model(cfg.draft, cfg)
    t0 = time.perf_counter()
    draft_kl = _train(draft, train, cfg, cfg.draft_steps, cfg.draft_lr, teacher=target, desc="draft", progress=progress)
    draft_minutes = (time.perf_counter() - t0) / 60

    report = {
        "config": asdict(cfg),
        "train_bytes": len(train),
        "heldout_bytes": len(held),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "target_train_loss": target_loss,
        "draft_train_kl": draft_kl,
        "target_heldout_loss": heldout_loss(target, held, cfg),
        "draft_heldout_loss": heldout_loss(draft, held, cfg),
        "target_train_minutes": round(target_minutes, 1),
        "draft_train_minutes": round(draft_minutes, 1),
        "total_minutes": round((time.perf_counter() - started) / 60, 1),
        "draft_only_rebuild": draft_only,
        "torch_version": torch.__version__,
    }
    for name, model in (("draft", draft),) if draft_only else (("target", target), ("draft", draft)):
        path = out_dir / name
        path.mkdir(parents=True, exist_ok=True)
        model.to(torch.float16).save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
