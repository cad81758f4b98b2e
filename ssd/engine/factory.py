"""The one place engines are built: `LLM`, a Serve target replica and the bench all come here.

`build_engines` resolves the configuration of every mode asked for (EngineArgs.to_config, the
one resolver), sets the process's torch threads, prestarts the fork server of the helper
processes the engines will fork (draft workers, tensor-parallel ranks) so that it imports while
the models load, loads the model pair once and builds one LLMEngine per mode over it. The worker
provider (where SSD's draft pool gets its workers: ssd/engine/proposers.py) and the rank launcher
(what starts a split target's ranks 1..t-1: ssd/model/tp_launch.py) are injected by the caller:
the serving package passes its Ray ones. `engines_over` builds engines over a pair loaded
elsewhere (the bench's models built in memory).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from ssd.core.config import EngineArgs, EngineConfig
from ssd.core.threads import set_process_threads
from ssd.engine.llm_engine import LLMEngine
from ssd.engine.proposers import WorkerProviderFactory, warm_fork_server
from ssd.model.loader import LoadedPair, load_pair

if TYPE_CHECKING:
    from ssd.model.tp_launch import RankLauncher


class EngineFactory(Protocol):
    """What builds a caller's engines (build_engines' signature): a Serve target replica takes one."""

    def __call__(
        self,
        args: EngineArgs,
        modes: Sequence[str] | None = None,
        worker_provider: WorkerProviderFactory | None = None,
        rank_launcher: RankLauncher | None = None,
    ) -> dict[str, LLMEngine]: ...


def engine_configs(args: EngineArgs, modes: Sequence[str] | None = None) -> dict[str, EngineConfig]:
    """mode -> its engine's configuration: args with that mode, resolved; modes None = args.mode alone."""
    return {mode: args.model_copy(update={"mode": mode}).to_config() for mode in (modes or (args.mode,))}


def pair_config(configs: Mapping[str, EngineConfig]) -> EngineConfig:
    """The configuration the pair is loaded by, once for every mode: one whose mode runs the
    draft in the engine's process (sd, auto), so that the draft's weights load, else one with a
    draft (ssd's workers load their own weights; its config still limits the context), else any."""
    in_engine = [c for c in configs.values() if c.draft_in_engine]
    with_draft = [c for c in configs.values() if c.draft is not None]
    return (in_engine or with_draft or list(configs.values()))[0]


def build_engines(
    args: EngineArgs,
    modes: Sequence[str] | None = None,
    worker_provider: WorkerProviderFactory | None = None,
    rank_launcher: RankLauncher | None = None,
) -> dict[str, LLMEngine]:
    """One engine per mode (modes None = args.mode alone; the first is the caller's default) over
    one loaded model pair. worker_provider: where an ssd or auto engine's draft pool gets its
    workers (None: processes this one forks); rank_launcher: what starts a tensor-parallel
    target's other ranks (None: child processes on this host)."""
    configs = engine_configs(args, modes)
    base = pair_config(configs)
    set_process_threads(base.num_threads)
    # The fork server of the workers and ranks the engines fork imports while the models load.
    for config in configs.values():
        warm_fork_server(config, worker_provider, rank_launcher)
    return engines_over(load_pair(base, rank_launcher), configs, worker_provider)


def engines_over(
    pair: LoadedPair, configs: Mapping[str, EngineConfig], worker_provider: WorkerProviderFactory | None = None
) -> dict[str, LLMEngine]:
    """One engine per configuration over a loaded pair. If one fails to start, those built and
    what loading the pair started (a split model's ranks) are closed before the error goes on."""
    engines: dict[str, LLMEngine] = {}
    try:
        for mode, config in configs.items():
            engines[mode] = LLMEngine(
                config, pair.target, pair.draft, pair.tokenizer, pair.max_model_len, worker_provider
            )
    except BaseException:
        for built in engines.values():
            built.close()
        pair.close()
        raise
    return engines
