"""The Ray Serve application: OpenAI-compatible HTTP and a gRPC API in front of target replicas
that batch continuously and lease draft workers from a shared pool.

    config.py        AppConfig (user boundary) -> ServeSettings (derived, frozen)
    types.py         GenerateRequest / GenerateChunk: the ingress <-> target hand-off
    errors.py        APIError: one error type with its HTTP status, OpenAI type, param and gRPC code
    auth.py          the API key check HTTP and gRPC share
    engine_loop.py   EngineLoop: continuous batching for async callers over the engines the
                     Target deployment's engine factory built (plain class, no Ray)
    fan_out.py       the checks both APIs share; one request -> one GenerateRequest per choice,
                     and the choices' chunks back as one stream (interleave)
    http_body.py     an HTTP body read within the size limit and parsed as a JSON object
    openai_protocol.py  the OpenAI request bodies (pydantic: unknown keys rejected)
    openai_api.py    OpenAI response/stream builders over a Generate function (plain, no Ray)
    grpc_api.py      the gRPC service's request/response conversion (plain, no Ray)
    drain.py         graceful drain: refuse new work, finish the streams in flight
    metrics.py       Prometheus metrics through Ray Serve's metrics API
    deployments.py   thin Serve deployments: Ingress (HTTP + gRPC), Target (given an engine
                     factory, ssd.engine.factory.build_engines by default), DraftPool
    app.py           build_app(args): the builder `serve run` and `ssd serve` use
    cli.py           `ssd serve`: a local Ray cluster, the app, clean shutdown
    bench.py         serving overhead: HTTP against the offline engine at batch 1
"""
