"""How the target reaches its drafters: typed messages and their wire format, channels (shared
memory, torch.distributed), the worker process and its client.
"""
