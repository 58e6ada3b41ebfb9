"""Tree vs chain on a real model: tokens per round (tau) and wall time, greedy, n-gram drafting.

SmolLM2-135M-Instruct (its packaged Q4_1 GGUF, dequantized to float32) on the held-out chat prompts
of `benchmarks/prompts/real.json` (the first `--per-category` conversations of each category), one
ragged batch. Compared: plain `specjax.generate`; `specjax.decode` with the n-gram chain
drafter at several `k`; `specjax.decode(..., tree=TreeSpec(...))` with n-gram trees (several
earlier matches merged into a trie) at several widths and depths. Every speculative output is
checked to be token-identical to `generate`. Wall times are the second call of each configuration
(the first compiles); on a shared CPU they are noisy, the tau numbers are not.

Usage: `python -m benchmarks.experiments.trees [--per-category 2] [--max-new-tokens 64]`; writes
`benchmarks/results/trees.json` and `benchmarks/results/trees.png`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1]
RESULTS = BENCHMARKS / "results"


def load_prompts(tokenizer, per_category: int):
  from benchmarks.real_models import chat_ids
  data = json.loads((BENCHMARKS / "prompts" / "real.json").read_text())
  rows, categories = [], []
  for category, conversations in data["categories"].items():
    for conversation in conversations[:per_category]:
      rows.append(chat_ids(tokenizer, conversation["messages"]))
      categories.append(category)
  width = max(len(r) for r in rows)
  tokens = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
  return jnp.asarray(tokens), jnp.asarray([len(r) for r in rows], jnp.int32), categories


def timed(fn):
  out = fn()
  jax.block_until_ready(out.tokens)
  start = time.perf_counter()
  out = fn()
  jax.block_until_ready(out.tokens)
  return out, time.perf_counter() - start


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--per-category", type=int, default=2)
  parser.add_argument("--max-new-tokens", type=int, default=64)
  args = parser.parse_args(argv)

  import specjax as sj
  from benchmarks.real_models import gguf_path, load_tokenizer
  from specjax.trees.structure import TreeSpec

  path = gguf_path("smollm2-135m")
  target = sj.from_gguf(path, dtype=jnp.float32)
  try:
    tokenizer = load_tokenizer(path)
  except ValueError:  # a specjax without GGUF tokenizers: the transformers one, same template
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
  tokens, lengths, categories = load_prompts(tokenizer, args.per_category)
  rng = jax.random.key(0)
  common = dict(lengths=lengths, max_new_tokens=args.max_new_tokens)
  ref, ref_time = timed(lambda: sj.generate(target, tokens, rng, **common))
  results = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF -> float32)",
             "device": str(jax.devices()[0]),
             "batch": int(tokens.shape[0]), "max_new_tokens": args.max_new_tokens,
             "categories": categories, "generate_seconds": ref_time, "configs": []}
  configs = [("chain", k, lambda k=k: sj.decode(target, sj.NGramDrafter(), tokens, rng,
                                                 num_draft=k, **common)) for k in (2, 4, 6)]
  for width, depth in ((2, 4), (3, 4), (4, 4), (3, 6)):
    spec = TreeSpec("ngram", depth=depth, width=width)
    configs.append((f"tree w{width} d{depth}", spec.size,
                    lambda spec=spec: sj.decode(target, None, tokens, rng, tree=spec, **common)))
  for name, nodes, fn in configs:
    out, seconds = timed(fn)
    identical = bool(np.array_equal(np.asarray(out.tokens), np.asarray(ref.tokens)))
    stats = out.stats
    tau_rows = np.asarray(stats.mean_accepted_length)
    per_category = {c: float(np.mean([t for t, cc in zip(tau_rows, categories) if cc == c]))
                    for c in dict.fromkeys(categories)}
    entry = {"name": name, "nodes_or_k": nodes, "identical_to_generate": identical,
             "tau": float(stats.summary()["tokens_per_round"]), "tau_per_category": per_category,
             "seconds": seconds, "speedup_vs_generate": ref_time / seconds}
    results["configs"].append(entry)
    print(json.dumps(entry), flush=True)
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "trees.json").write_text(json.dumps(results, indent=1))
  from benchmarks.plots import plot_tau_and_speedup
  configs = results["configs"]
  plot_tau_and_speedup(
      [c["name"] for c in configs], [c["tau"] for c in configs],
      [c["speedup_vs_generate"] for c in configs], RESULTS / "trees.png",
      title="SmolLM2-135M, n-gram drafting, greedy, held-out chat prompts (CPU)")


if __name__ == "__main__":
  main()
