"""The target's side of a round: the engine loop (continuous batching), sequences, sampling,
verification, stop checks.
"""
