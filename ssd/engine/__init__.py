"""The target's side of a round: the engine loop (continuous batching; one step = speculate,
verify, commit), the proposer for each mode, verification, stop checks, the engine's metrics.
"""
