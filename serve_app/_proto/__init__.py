"""Generated gRPC stubs of protos/ssd_serve.proto (by `make protos`; never edited, never committed)."""
