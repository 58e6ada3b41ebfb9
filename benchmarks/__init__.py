"""specjax benchmarks: speedup against the analytic bound, against a peer, and on real models.

A package of the source checkout, outside the `specjax` wheel: run it as `specjax bench ...` from
a checkout (the CLI finds this package next to `specjax/`) or as `python -m benchmarks ...` from
the repository root. Modules:

  bound       the analytic speedup bound and the per-token acceptance (pure formulas)
  timing      calls timed alternately in one process; single-forward costs
  synthetic   the synthetic-acceptance verify rule (benchmark only, not exact); random targets
  cases       one decode-vs-generate measurement
  models      pairs, prompts and the machine's description for the pair suites
  peer        `transformers` on the same weights (exported pair)
  suites      the pair/synthetic suites and `run`
  real_models SmolLM2 / Gemma 3 from their GGUF files, for specjax and for `transformers`
  real        the real-model suite on `prompts/real.json`
  drafters, drafter_cost   the real suite's drafters; a drafter's own cost per round
  plots, report   PNG plots (matplotlib) and markdown tables
  cli         the command line
  self_draft, peers_qwen, tpu_memory, tpu_traffic   standalone measurements the README cites
  experiments one-off A/B experiments, outside the suites (`experiments/README.md`)
"""

SPECJAX_BENCHMARKS = True  # lets `specjax bench` tell this package from another `benchmarks`
