"""The suffix drafter's per-round propose cost against the size of its shared corpus (CPU).

`SuffixDrafter.propose` is timed in a jitted device loop of `steps` rounds (the sequence depends on
the loop's carry, so nothing is hoisted), for a batch of rows with a `buffer_len` token buffer, with
no corpus and with corpora of 10k, 100k and 1M tokens (the default sizes). Beside it: prompt lookup
(`NGramDrafter`) on the same rows, and the one-off costs of building a corpus
(`SuffixCorpus.from_sequences`) and of one jitted `append` of the batch's rows (both rebuild the
index, `O(C log C log depth)`).

The corpus text is synthetic but repetitive, as real outputs are: phrases of 4 to 24 tokens drawn
from a pool of 2,000 (Zipf-weighted) over a 32k vocabulary, joined into sequences of about 200
tokens; the rows are built the same way, so every row finds long matches in a large corpus.

  python -m benchmarks.experiments.suffix_corpus --out suffix_corpus.json
      [--sizes 10000 100000 1000000]

Writes JSON: the machine, the settings, and per size the propose milliseconds per round (min over
repeats), the build and append seconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax as sj
from specjax.drafters import SuffixCorpus
from benchmarks.timing import time_alternately

VOCAB = 32_000


def phrase_pool(rng: np.random.Generator, size: int = 2000) -> list[np.ndarray]:
  return [rng.integers(0, VOCAB, rng.integers(4, 25)).astype(np.int32) for _ in range(size)]


def text(rng: np.random.Generator, pool: list[np.ndarray], length: int) -> np.ndarray:
  """About `length` tokens of Zipf-weighted phrases from `pool`."""
  weights = 1.0 / np.arange(1, len(pool) + 1)
  picks = rng.choice(len(pool), size=max(1, length // 8), p=weights / weights.sum())
  return np.concatenate([pool[i] for i in picks])[:length]


@functools.partial(jax.jit, static_argnames=("num_draft", "steps"))
def _rounds(drafter, sequence, lengths, *, num_draft, steps):
  def body(_, total):
    shifted = sequence + (total > 2**30).astype(sequence.dtype)  # [B, S], depends on the carry
    _, proposal = drafter.propose((), shifted, lengths, num_draft=num_draft, sampling=None,
                                  seeds=None)
    drafted = 0 if proposal.num_drafted is None else jnp.sum(proposal.num_drafted)
    return total + jnp.sum(proposal.tokens) % 7 + drafted
  return jax.lax.fori_loop(0, steps, body, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("num_draft",))
def _drafted(drafter, sequence, lengths, *, num_draft):
  """Mean drafts per row of one propose on these rows."""
  _, proposal = drafter.propose((), sequence, lengths, num_draft=num_draft, sampling=None,
                                seeds=None)
  return jnp.mean(proposal.num_drafted.astype(jnp.float32))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="the JSON file to write")
  parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--buffer-len", type=int, default=1024)
  parser.add_argument("--num-draft", type=int, default=6)
  parser.add_argument("--max-match", type=int, default=32)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args(argv)

  rng = np.random.default_rng(0)
  pool = phrase_pool(rng)
  rows = [text(rng, pool, args.buffer_len // 2) for _ in range(args.batch)]
  sequence = np.zeros((args.batch, args.buffer_len), np.int32)
  for i, row in enumerate(rows):
    sequence[i, :len(row)] = row
  sequence = jnp.asarray(sequence)
  lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
  time_rounds = lambda drafter: time_alternately(
      {"propose": lambda: _rounds(drafter, sequence, lengths, num_draft=args.num_draft,
                                  steps=args.steps)}, args.repeats)["propose"]

  record = dict(machine=dict(platform=platform.platform(), processor=platform.processor(),
                             devices=[str(d) for d in jax.devices()]),
                settings=dict(batch=args.batch, buffer_len=args.buffer_len,
                              row_tokens=[len(r) for r in rows], num_draft=args.num_draft,
                              max_match=args.max_match, steps=args.steps, repeats=args.repeats,
                              vocab=VOCAB, statistic="min"),
                baselines={}, sizes=[])
  for name, drafter in (("ngram_max3", sj.NGramDrafter(max_ngram=3)),
                        ("suffix_no_corpus", sj.SuffixDrafter(max_match=args.max_match))):
    timed = time_rounds(drafter)
    record["baselines"][name] = dict(propose_ms=1e3 * timed["seconds"] / args.steps)
    print(f"{name}: {record['baselines'][name]['propose_ms']:.3f} ms per round", flush=True)
  for size in args.sizes:
    sequences = []
    while sum(len(s) + 1 for s in sequences) < size:
      sequences.append(text(rng, pool, 200))
    start = time.perf_counter()
    corpus = jax.block_until_ready(SuffixCorpus.from_sequences(sequences, capacity=size,
                                                                  depth=args.max_match))
    build_s = time.perf_counter() - start  # the first build at a size includes compiling
    append = jax.jit(lambda c, t, n: c.append(t, n))
    jax.block_until_ready(append(corpus, sequence, lengths))  # compile
    start = time.perf_counter()
    jax.block_until_ready(append(corpus, sequence, lengths))
    append_s = time.perf_counter() - start
    drafter = sj.SuffixDrafter(corpus=corpus, max_match=args.max_match)
    timed = time_rounds(drafter)
    entry = dict(corpus_tokens=size, propose_ms=1e3 * timed["seconds"] / args.steps,
                 propose_median_ms=1e3 * timed["median_s"] / args.steps,
                 build_with_compile_s=build_s, append_s=append_s,
                 drafted_per_row=float(_drafted(drafter, sequence, lengths,
                                                num_draft=args.num_draft)))
    record["sizes"].append(entry)
    print(f"corpus {size}: {entry['propose_ms']:.3f} ms per round, build {build_s:.2f} s "
          f"(with compile), append {append_s:.2f} s", flush=True)
  with open(args.out, "w") as f:
    json.dump(record, f, indent=2)
  return record


if __name__ == "__main__":
  main()
