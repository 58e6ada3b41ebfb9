"""`specjax demo`: complete a prompt with the shipped pair and measure the speedup.

Loads the default target/draft pair, completes the prompt greedily with `specjax.decode`, prints
the text and the acceptance statistics, then times `decode` against `specjax.generate` on the same
prompt after a warm-up call of each (so compilation is not counted) and prints the ratio.
"""

from __future__ import annotations

import time

import jax
import numpy as np


def _time(fn, repeats: int) -> float:
  """Best wall-clock seconds of `repeats` calls (each blocks on its result)."""
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def run(args) -> int:
  """Runs the demo with parsed `specjax demo` arguments (`prompt`, `max_new_tokens`,
  `num_draft`)."""
  import specjax as sj
  from rich.console import Console

  console = Console()
  start = time.perf_counter()
  pair = sj.load_default()
  target, draft, tokenizer = pair.target, pair.draft, pair.tokenizer
  console.print(f"[dim]loaded target ({target.config.num_params() / 1e6:.1f}M params) and draft "
                f"({draft.config.num_params() / 1e6:.2f}M) in {time.perf_counter() - start:.1f}s"
                "[/dim]")
  ids, lengths = tokenizer.encode_batch([args.prompt])
  rng = jax.random.PRNGKey(0)
  greedy = sj.Sampling(temperature=0.0)

  def speculative():
    return sj.decode(target, draft, ids, rng, lengths=lengths, max_new_tokens=args.max_new_tokens,
                     num_draft=args.num_draft, sampling=greedy)

  def plain():
    return sj.generate(target, ids, rng, lengths=lengths, max_new_tokens=args.max_new_tokens,
                       sampling=greedy)

  start = time.perf_counter()
  out = jax.block_until_ready(speculative())
  compile_s = time.perf_counter() - start
  count = int(out.num_tokens[0])
  completion = tokenizer.decode(np.asarray(out.tokens[0, :count]))
  console.rule("completion")
  console.print(args.prompt, end="", style="bold", markup=False, highlight=False)
  console.print(completion, markup=False, highlight=False)
  console.rule()
  stats = out.stats.summary()
  console.print(f"speculative decoding, k={args.num_draft}: {count} tokens in {stats['rounds']} "
                f"rounds; acceptance rate {stats['acceptance_rate']:.1%}, "
                f"{stats['tokens_per_round']:.2f} tokens per target pass; accepted per position "
                f"{stats['accepted_per_position']} (first call incl. compile {compile_s:.1f}s)")

  jax.block_until_ready(plain())  # warm-up: compile generate
  reference = plain()
  same = bool(np.array_equal(np.asarray(reference.tokens), np.asarray(out.tokens)))
  decode_s = _time(speculative, 3)
  generate_s = _time(plain, 3)
  console.print(f"decode {decode_s * 1e3:.0f} ms vs generate {generate_s * 1e3:.0f} ms for "
                f"{count} tokens: [bold]{generate_s / decode_s:.2f}x[/bold] speedup "
                f"({jax.devices()[0].platform}); output identical to generate: {same}")
  return 0
