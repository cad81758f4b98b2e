"""How a target reaches its draft workers: the wire format of the draft protocol's messages,
channels (shared memory, gloo, torch.distributed, gRPC), the link to one worker, the pool client
over D of them, spawned workers and leases.
"""
