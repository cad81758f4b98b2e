"""The Ray Serve application: OpenAI-compatible HTTP and a gRPC API in front of target replicas
that batch continuously and lease draft workers from a shared pool.

    config.py        AppConfig (user boundary) -> ServeSettings (derived, frozen)
    types.py         GenerateRequest / GenerateChunk: the ingress <-> target hand-off
    errors.py        APIError: one error type with its HTTP status, OpenAI type, param and gRPC code
    engine_loop.py   EngineLoop: continuous batching for async callers (plain class, no Ray)
    openai_api.py    OpenAI request models and response/stream builders (plain, no Ray)
    grpc_api.py      the gRPC service's request/response conversion (plain, no Ray)
    metrics.py       Prometheus metrics through Ray Serve's metrics API
    deployments.py   thin Serve deployments: Ingress (HTTP + gRPC), Target, DraftWorker
    app.py           build_app(args): the builder `serve run` and `ssd serve` use
    cli.py           `ssd serve`: a local Ray cluster, the app, clean shutdown
    bench.py         serving overhead: HTTP against the offline engine at batch 1
"""
