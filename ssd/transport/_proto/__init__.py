"""Generated gRPC stubs (ssd_draft_pb2.py, ssd_draft_pb2_grpc.py) from protos/ssd_draft.proto.

They are written by `make protos` (which `make install` runs), never edited by hand and never
committed (.gitignore); ssd/transport/grpc_channel.py says so when they are missing.
"""
