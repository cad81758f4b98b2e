"""Models and their forwards: loading, the batched runner, the KV cache with per-row rollback, the
lean Llama forward, the demo pair.
"""
