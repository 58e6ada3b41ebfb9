"""One-off benchmark experiments: A/B comparisons of two builds, layouts or checkouts, and probes
that answered one question. Not part of `specjax bench`; run each from the repository root as
`python -m benchmarks.experiments.NAME` (see `README.md` here for what each answered and where the
answer is written up)."""
