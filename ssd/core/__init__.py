"""The types every role shares, and nothing that runs a model or a channel. The one layer below
is ssd/processing/ (what a request's sampling parameters do to logits), whose types these hold.

config.py         EngineArgs (user boundary) -> EngineConfig (frozen, derived once)
sampling_params   SamplingParams: one request's sampling, validated
sampling.py       SequenceSampling / BatchSampling, logits -> processed distributions (the
                  adjustments, then the shaping), draws
sequence.py       Sequence (one request inside the engine), CompletionOutput
speculation.py    Speculation (a round's proposals), Source, RoundOutcome, SpecMetrics, Proposer
protocol.py       the draft protocol: message kinds, messages, DraftClient
detokenizer.py    incremental detokenization
transfer.py       host-to-device copies that do not wait for the device
"""
