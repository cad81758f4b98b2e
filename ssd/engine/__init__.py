"""The target's side of a round: the engine loop (continuous batching; a step = admit, choose
the mode, propose, verify, commit: llm_engine.py) and a module per role in it: the scheduler,
the mode policy (autopilot.py: auto's measurements), the proposer for each mode, the verifier
(verify.py: the rule), the commit and its stop checks, the engine's metrics.
"""
