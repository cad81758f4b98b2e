"""Ordinary speculative decoding's proposer: the draft model drafts K tokens just in time."""

from __future__ import annotations

from functools import partial

import torch

from ssd.core.proposer import Proposer
from ssd.core.sampling import (
    BatchSampling,
    process_logits,
    process_logits_on_device,
    sample_from,
    sample_on_device,
    sampling_tensors,
)
from ssd.core.sequence import Sequence
from ssd.core.speculation import RoundOutcome, Speculation
from ssd.drafting.saguaro import saguaro_probs
from ssd.model.kv_cache import COLUMN_MULTIPLE, StaticKVCache
from ssd.model.runner import ModelRunner, pad_rows
from ssd.model.step_graphs import run_step
from ssd.processing.draft_adjustments import draft_form
from ssd.processing.token_masks import token_masks


def to_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits [..., V_draft] -> [..., vocab]: cut, or padded with -inf where the draft's
    vocabulary is the smaller (those tokens are never drafted)."""
    logits = logits[..., :vocab]
    if logits.shape[-1] < vocab:
        logits = torch.nn.functional.pad(logits, (0, vocab - logits.shape[-1]), value=float("-inf"))
    return logits


def draw_step(
    vocab: int, greedy: bool, logits, uniforms, temperature=None, top_k=None, top_p=None, fanout=None, *, c=1.0
):
    """A draft step's draw on the device, as one capturable step (ssd/model/step_graphs.py):
    logits [b, n, V_draft], uniforms [b, n], the rows' temperature, top_k and top_p [b] (no other
    processing) -> (tokens [b, n], probs [b, n, vocab]); with Saguaro's C < 1, probs scaled at
    fanout [b, n] (saguaro_probs) before the draw. A greedy batch's draw is the argmax, which is
    what sampling its one-hot distribution gives (the scaling keeps it one-hot): (tokens,)."""
    logits = to_vocab(logits, vocab)
    if greedy:
        return (logits.argmax(-1),)
    probs = process_logits_on_device(logits, BatchSampling(temperature, top_k, top_p))
    if c < 1:
        probs = saguaro_probs(probs, fanout, c)
    return sample_on_device(probs, uniforms), probs


class SDProposer(Proposer):
    """Keeps a draft KV cache per running sequence and drafts autoregressively.

    Invariant between rounds: the draft cache of row r holds the first cache.lengths()[r]
    tokens of its sequence (fewer than num_tokens); the rest are fed at the start of the next
    proposal. The engine calls propose() only with k >= 1.
    """

    def __init__(
        self,
        runner: ModelRunner,
        target_vocab: int,
        rows: int = 1,
        columns: int = COLUMN_MULTIPLE,
        max_bytes: int | None = None,
    ) -> None:
        self.runner = runner
        self.target_vocab = target_vocab
        # rows, columns: the most the engine runs (its max_num_seqs) and the longest sequence it
        # admits (max_model_len), allocated at the first forward, as the target's cache is: a
        # cache sized by the batches and lengths seen so far doubled at the first larger burst or
        # longer sequence, a resident step in a long-running server (the soak found both); at most
        # max_bytes of them (EngineArgs.kv_cache_gib).
        self.cache = runner.new_cache(rows, columns, max_bytes)
        # On an accelerator a proposal reads nothing back per token (tests force it on the CPU):
        # its tokens and probs stay on the draft's device, a token drawn from a distribution
        # without mass is -1 there (the host's sampler raises), and whoever copies them checks.
        self.device_round = runner.device.type != "cpu"
        # Between detach() and rejoin() (mode auto, rounds of another mode): new rows join with an
        # empty cache, and the next proposal feeds their tokens with the rest the cache missed
        # (most never get one): a prefill is a draft forward on the engine's thread.
        self.defer_prefill = False

    def add(self, seqs: list[Sequence]) -> None:
        rows = self.cache.add_rows(len(seqs))
        if self.defer_prefill:
            return
        tokens, valid = pad_rows([s.prompt_ids[:-1] for s in seqs])
        self.runner.forward(rows, tokens, valid, with_logits=False)

    def keep(self, rows: torch.Tensor) -> None:
        self.cache.keep(rows)

    def detach(self) -> None:
        self.defer_prefill = True

    def rejoin(self, seqs: list[Sequence]) -> None:
        self.defer_prefill = False  # the next proposal feeds the deferred rows' tokens

    def graph_runners(self) -> dict:
        return {"draft": self.runner}

    def draft_probs(self, logits: torch.Tensor, sampling: BatchSampling, on_device: bool = False) -> torch.Tensor:
        """Draft logits [b, n, V_draft] -> probs [b, n, V_target] (zero beyond the draft vocab:
        padded with -inf logits, so the request's adjustments see the target's vocabulary).
        on_device: with no host read (sampling's tensors on the logits' device). The logits are
        consumed: the request's adjustments write into them (every caller passes a draft
        forward's own logits, read nowhere else), which spares a [b, n, V] copy per draft step."""
        process = process_logits_on_device if on_device else process_logits
        return process(to_vocab(logits, self.target_vocab), sampling, in_place=True)

    def draft_argmax(self, logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
        """A greedy batch's draws from draft logits [b, n, V_draft]: -> [b, n], the argmax of the
        adjusted logits, which is what sampling draft_probs' one-hot rows gives, without building
        them (at V = 128k, three passes over [b, n, V] per draft step). Consumes the logits too."""
        logits = to_vocab(logits, self.target_vocab)
        return (logits if sampling.adjust is None else sampling.adjust.apply(logits, in_place=True)).argmax(-1)

    def propose(self, seqs: list[Sequence], k: int, sampling: BatchSampling) -> Speculation:
        b, on_device = len(seqs), self.device_round
        device = self.runner.device if on_device else torch.device("cpu")
        uniforms = torch.stack([torch.rand(k, generator=s.generator) for s in seqs]).to(device)  # [b, K]
        greedy = bool(sampling.greedy.all())  # read on the host, before sampling moves to the device
        if sampling.adjust is not None:  # the form a draft applies and advances in fewer operations
            sampling = sampling.adjusted(draft_form(sampling.adjust, device))
        sampling = sampling.to(device)
        synced = self.cache.lengths().tolist()
        pending = [s.tokens_from(synced[r]) for r, s in enumerate(seqs)]
        tokens, valid = pad_rows(pending)
        logits = self.runner.forward(self.cache, tokens, valid, on_host=not on_device)
        last = (valid.long().sum(1) - 1).to(device)
        step_logits = logits[torch.arange(b, device=device), last].unsqueeze(1)  # [b, 1, V]
        drafted, probs = [], []
        one_hot = not on_device and greedy
        for i in range(k):
            if on_device and sampling.adjust is None:
                tok, p = self._draw(step_logits, uniforms[:, i], sampling, greedy)
            elif one_hot:  # a greedy batch on the host: no distribution is read (see `stacked`)
                tok, p = self.draft_argmax(step_logits, sampling)[:, 0], None
            else:
                p = self.draft_probs(step_logits, sampling, on_device)[:, 0]  # [b, V]
                tok = sample_on_device(p, uniforms[:, i]) if on_device else sample_from(p, uniforms[:, i], one_hot)
            drafted.append(tok)
            probs.append(p)
            # A -1 (no mass) fails the round where the drafts are read; until then it feeds token 0.
            feed = tok.clamp(min=0) if on_device else tok
            if sampling.adjust is not None and i < k - 1:  # penalties count this draft token from here on
                masks = None
                if sampling.adjust.masks is not None:  # and the grammar's and bad words' next masks follow it
                    # (host matchers: the one read per token a constrained proposal costs on a device)
                    fed = torch.stack(drafted, 1).clamp(min=0).cpu()
                    masks = token_masks(seqs, fed, self.target_vocab, True).to(device)
                sampling = sampling.adjusted(sampling.adjust.advanced(feed, masks))
            if i < k - 1:
                step_logits = self.runner.forward(self.cache, feed.unsqueeze(1), on_host=not on_device)
        # A greedy batch's verification reads no draft distribution (ssd/engine/verify.py): none is stacked.
        stacked = None if greedy else torch.stack(probs, 1)  # [b, K, V]
        return Speculation(torch.stack(drafted, 1), stacked, torch.full((b,), k, dtype=torch.long))

    def _draw(self, logits, uniforms, sampling: BatchSampling, greedy: bool):
        """A device step's draw without processing: logits [b, 1, V_draft], uniforms [b] ->
        (tokens [b], probs [b, V] or None for a greedy batch). A sampled batch's draw replays a
        CUDA graph where the runner has them; a greedy one is an argmax, cheaper than a replay's copies."""
        if greedy:
            return draw_step(self.target_vocab, True, logits, None)[0][:, 0], None
        step = partial(draw_step, self.target_vocab, False)
        inputs = (logits, uniforms[:, None], *sampling_tensors(sampling))
        tok, probs = run_step(self.runner.steps, self.runner.device, f"draw V={self.target_vocab}", step, *inputs)
        return tok[:, 0], probs[:, 0]

    def outcome_known(self, seqs: list[Sequence], speculation: Speculation, outcome: RoundOutcome) -> None:
        pass  # nothing to overlap: drafting happens in propose()

    def observe(self, seqs: list[Sequence], speculation: Speculation, outcome: RoundOutcome) -> None:
        # The cache holds the old committed tokens and drafts 1..K-1; the accepted ones stay.
        keep = outcome.tokens_before + outcome.num_accepted.clamp(max=speculation.k - 1)
        self.cache.drop_last(self.cache.lengths() - keep)

    def close(self) -> None:
        self.runner.close()  # a split draft's ranks stop (closing twice is a no-op)
        self.cache = StaticKVCache()  # the cache's buffers go (nothing drafts after close)
