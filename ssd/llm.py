"""The offline Python API, shaped like vLLM's `LLM`."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq

from ssd.core.config import EngineArgs
from ssd.core.sampling_params import SamplingParams
from ssd.core.sequence import CompletionOutput
from ssd.engine.factory import build_engines
from ssd.engine.proposers import WorkerProviderFactory

Prompt = str | list[int]


class LLM:
    """`LLM()` serves the bundled demo pair; `LLM(target=..., draft=..., mode="sd", k=6)` any
    Hugging Face pair with one vocabulary. See `EngineArgs` for every option."""

    def __init__(
        self,
        target: str | None = None,
        draft: str | None = None,
        worker_provider: WorkerProviderFactory | None = None,
        rank_launcher=None,
        **kwargs,
    ) -> None:
        """kwargs: EngineArgs' fields. worker_provider: where SSD's draft workers come from
        (default: processes this one starts; the serving package has one that leases Ray actors).
        rank_launcher: what starts a tensor-parallel target's ranks 1..t-1
        (ssd.model.tp_launch.RankLauncher; default: child processes on this host; the serving
        package has one that starts Ray actors in the caller's placement group). The engine is
        built as every engine is (ssd/engine/factory.py)."""
        self.args = EngineArgs(target=target, draft=draft, **kwargs)
        self.engine = build_engines(self.args, None, worker_provider, rank_launcher)[self.args.mode]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _submit(self, prompts: Prompt | Seq[Prompt], params) -> list[str]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None:
            params = SamplingParams()
        param_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(
                f"got {len(param_list)} sampling_params for {len(prompts)} prompts: pass one or one per prompt"
            )
        # Validate everything before queueing anything, so a bad request leaves the engine clean;
        # what is queued is the token ids the check made (a prompt is tokenized once).
        ids = [self.engine.check_request(prompt, sp) for prompt, sp in zip(prompts, param_list)]
        return [self.engine.add_request(p, sp) for p, sp in zip(ids, param_list)]

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        ids = self._submit(prompts, sampling_params)
        done: dict[str, CompletionOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate")
        try:
            wanted = set(ids)
            while len(done) < len(ids):
                for out in self.engine.step():
                    # Other requests may share the engine (added directly): only ours count.
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.engine.abort(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]

    def generate_stream(
        self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> Iterator[CompletionOutput]:
        """Yield an output per request each round it progresses (delta_token_ids/delta_text hold
        what is new); the last output of a request has finish_reason set."""
        ids = self._submit(prompts, sampling_params)
        pending = set(ids)
        try:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            if pending:
                self.engine.abort(list(pending))

    def close(self) -> None:
        """Stop helper processes (SSD's draft worker); also done at interpreter exit."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def metrics(self) -> dict:
        return self.engine.engine_metrics()
