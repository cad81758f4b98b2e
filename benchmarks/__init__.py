"""One-off investigations: scripts that measured something once, to decide a design question, and
that a user of the engine does not need to run. What a user runs stays in the package: `ssd bench`
(ssd/bench/: modes side by side, the pool sweep, startup, real shapes, the acceptance-matched pair
and the projection).

Run each from the repository root as `python -m benchmarks.NAME --help`. They import `ssd` (and its
helpers in ssd.bench); nothing in `ssd/` imports them, and they are not in the wheel
(pyproject.toml's package list names ssd, actors and serve_app only). Each figure's command, date
and machine are in the doc section named beside it:

- `contention`: does a draft worker slow the target's verification? A paired A/B with the drafter
  idle, drafting or spinning: a drafter on the other core costs the target a few percent,
  spinning slightly more than computing, yet the spin pays for itself end to end, so it stays
  (`draft_spin_ms`). docs/benchmarks.md, "Benchmark" ("Contention A/B"); docs/gpu.md's
  `contention` part (scripts/gpu_check.sh) runs it on a GPU.
- `miss_law`: does the miss law fitted at D = 1 draft worker predict the hit rate of wider trees
  (D = 2, 4, 8)? At T=0 within 0.03. docs/benchmarks.md, "Benchmark" ("Miss law and D");
  docs/gpu.md, "The draft pool on 16 cores".
- `payload`: what the draft pool's data plane carries per row and round, and what a draft worker
  keeps, at a 128256-token vocabulary: greedy rows travel as their tokens, top-k rows as their
  support, only sampled dense rows whole. docs/engine.md, "The draft pool" ("Payload,
  measured"). Its random tiny pair (`build_pair`) is also `vocab_speed`'s and
  `processing_share`'s.
- `pack_time`: host time to frame and unframe a reply per row, by the form its distributions
  travel in, and a round's three messages: a greedy row marked by the drafter takes 0.026 ms to frame, and
  message bodies are gathered in one list. docs/engine.md, "The draft pool"; docs/gpu.md, "H200,
  2026-11-26, later that day".
- `vocab_speed`: sd and ssd on the random pair at V = 128256: a greedy row's speculation travels
  as its tokens alone. docs/benchmarks.md, "At a real vocabulary".
- `constrained`: speculation under a JSON schema, under penalties, and with neither: drafters
  that mask and process as the target does keep ssd/sd at the unconstrained ratio.
  docs/benchmarks.md, "Under constraints and penalties"; docs/structured-output.md, "How it stays
  exact".
- `processing_cost`: what penalties and bias cost per round on the host, beside sampling; with
  `processing_share` (their share of a real round, in the engine) it led to in-place applies and
  the draft's host form (numba): under 5% of a round. docs/benchmarks.md, "Under constraints and
  penalties".
- `grammar_cost`: what structured output costs per round, and the grammar engines compared
  (llguidance, xgrammar, outlines-core): why llguidance. docs/structured-output.md, "Why
  llguidance".
- `tensor_parallel`: each rank's memory and speed for a random Llama of real layer shapes at
  t = 1, 2: a rank holds half the weights; packing adds a copy. docs/tensor-parallel.md,
  "Measured" (the speed of t ranks across modes is `ssd bench --tensor-parallel-size`).
"""
