"""The one engine factory (ssd/engine/factory.py) and the configuration it resolves: EngineConfig's
fields are EngineArgs' own, every mode's engine runs on one loaded pair, `LLM` and the Serve
target replica build through it, and a failed engine closes what was built."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from ssd import LLM, EngineArgs
from ssd.core.config import EngineConfig
from ssd.engine import factory
from ssd.engine.factory import build_engines, engine_configs, pair_config


def test_engine_config_has_exactly_engine_args_fields_and_stays_frozen():
    config = EngineArgs().to_config()
    assert [f.name for f in dataclasses.fields(EngineConfig)] == list(EngineArgs.model_fields)
    assert EngineConfig(**dataclasses.asdict(config)) == config  # what a draft worker rebuilds
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.k = 3
    assert (config.draft_dtype, config.draft_device) == (config.dtype, config.device)  # resolved, never None


def test_the_pair_is_loaded_by_a_mode_that_runs_the_draft_in_the_engine():
    configs = engine_configs(EngineArgs(mode="ssd"), ("ssd", "sd", "ar"))
    assert list(configs) == ["ssd", "sd", "ar"] and pair_config(configs).mode == "sd"
    assert pair_config(engine_configs(EngineArgs(mode="ssd"), ("ssd", "ar"))).mode == "ssd"
    assert list(engine_configs(EngineArgs(mode="ar"))) == ["ar"]


def test_one_pair_serves_every_mode_and_llm_builds_through_the_factory(tiny_pair, monkeypatch):
    engines = build_engines(EngineArgs(target=tiny_pair[0], draft=tiny_pair[1], mode="sd"), ("sd", "ar"))
    try:
        assert engines["sd"].target.model is engines["ar"].target.model
    finally:
        for engine in engines.values():
            engine.close()
    calls, real = [], factory.load_pair
    monkeypatch.setattr(factory, "load_pair", lambda *a: calls.append(a) or real(*a))
    with LLM(*tiny_pair, mode="ar") as llm:
        assert llm.engine.config.mode == "ar" and len(calls) == 1


def test_a_failed_engine_closes_those_built_and_the_pair(tiny_pair, monkeypatch):
    closed = []

    class Failing(factory.LLMEngine):
        def __init__(self, config, *args, **kwargs):
            if config.mode == "ar":
                raise RuntimeError("no engine")
            super().__init__(config, *args, **kwargs)

        def close(self):
            closed.append(self.config.mode)
            super().close()

    monkeypatch.setattr(factory, "LLMEngine", Failing)
    with pytest.raises(RuntimeError, match="no engine"):
        build_engines(EngineArgs(target=tiny_pair[0], draft=tiny_pair[1], mode="sd"), ("sd", "ar"))
    assert closed == ["sd"]


def test_the_target_deployment_takes_an_engine_factory():
    pytest.importorskip("ray")
    from serve_app.deployments import TargetDeployment

    parameter = inspect.signature(TargetDeployment.func_or_class.__init__).parameters["engine_factory"]
    assert parameter.default is build_engines
