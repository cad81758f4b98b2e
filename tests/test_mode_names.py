"""A speculation mode has one name, the engine's (EngineArgs.mode: auto, ssd, sd, ar), which the
server reports everywhere (/v1/models' speculation_modes, a reply's speculation.mode); `off`,
plain decoding's name in the API before, is a deprecated spelling of `ar` that a request (HTTP or
gRPC), a config's extra_modes and `--extra-modes` still accept, read as `ar`."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from serve_app.cli import add_arguments, app_config_from
from serve_app.config import AppConfig
from serve_app.engine_loop import EngineLoop
from serve_app.errors import APIError
from serve_app.openai_protocol import Speculation


def test_a_request_may_spell_ar_off():
    assert Speculation(mode="off").mode == "ar" and Speculation(mode="ar").mode == "ar"
    assert Speculation().mode is None and Speculation(mode="sd", k=2).k == 2
    with pytest.raises(ValidationError):
        Speculation(mode="turbo")


def test_a_config_may_spell_ar_off_and_the_server_reports_ar():
    config = AppConfig(extra_modes=["sd", "off"])
    assert config.extra_modes == ["sd", "ar"]
    settings = config.to_settings()
    assert settings.engine_modes == ("auto", "sd", "ar") and settings.request_modes == ("auto", "sd", "ar")
    assert AppConfig().extra_modes == ["ar"]  # the default: plain decoding served beside auto
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert app_config_from(parser.parse_args(["--extra-modes", "sd", "off"])).extra_modes == ["sd", "ar"]


def test_the_engine_loop_reads_off_as_ar():
    loop = SimpleNamespace(engines={"sd": None, "ar": None}, default_mode="sd")
    assert EngineLoop.engine_for(loop, "off") == "ar" == EngineLoop.engine_for(loop, "ar")
    assert EngineLoop.engine_for(loop, None) == "sd"
    with pytest.raises(APIError) as info:
        EngineLoop.engine_for(loop, "ssd")
    assert info.value.param == "speculation.mode" and "served: ['ar', 'sd']" in info.value.message


def test_a_grpc_request_may_spell_ar_off():
    pb = pytest.importorskip("serve_app._proto.ssd_serve_pb2")
    from serve_app.grpc_api import GrpcFrontend

    frontend = GrpcFrontend(AppConfig().to_settings(), None, None, None)
    context = SimpleNamespace(invocation_metadata=lambda: [])

    def mode_of(mode: str) -> str | None:
        request = pb.GenerateRequest(model="ssd-demo", prompt="x", speculation=pb.Speculation(mode=mode, k=2))
        (generate,) = frontend._check(request, context)
        assert generate.k == 2
        return generate.mode

    assert mode_of("off") == "ar" and mode_of("ar") == "ar" and mode_of("") is None
    with pytest.raises(APIError) as info:
        mode_of("turbo")
    assert info.value.param == "speculation.mode"
