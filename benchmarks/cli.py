"""`specjax bench` / `python -m benchmarks`: the command line of the benchmark suites.

Suites (`--suite`):

* `speedup`: a target/draft pair (the shipped pair, or random weights) over k, batch and
  temperature: tokens/s of both, acceptance, mean accepted length, and the analytic bound
  (`benchmarks.bound`) from the measured acceptance and the measured costs of one draft step, one
  target step and one `(k + 1)`-token verify. Efficiency = measured speedup / bound.
* `synthetic`: random-weight targets of growing size with a **synthetic-acceptance** verify rule
  (`benchmarks.synthetic`). Benchmark only: not exact, and every record says so.
* `peer`: the same weights exported to a Hugging Face Llama directory: `transformers` greedy
  `generate` and assisted generation against specjax `generate` and `decode`.
* `readme`: the README table (pair over k, then temperatures and batches at the best k; the
  synthetic 126M target at a = 0.8; the peer).
* `real`: pretrained models (SmolLM2-135M-Instruct, Gemma 3 270M) on the project's own prompt set
  in the Spec-Bench categories, every drafter the library has, and `transformers` on the same
  weights (`benchmarks.real`).
* `tiny`: `readme` with tiny random models and a few tokens (the tests run this).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

from benchmarks.models import default_pair_available
from benchmarks.real_models import REAL_MODELS
from benchmarks.suites import Settings, run
from benchmarks.synthetic import SYNTHETIC_SIZES

DEFAULT_OUT = pathlib.Path("benchmarks/results")


def _ints(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(x) for x in text.split(",") if x.strip())


def _strings(text: str) -> tuple[str, ...]:
  return tuple(x.strip() for x in text.split(",") if x.strip())


SUITES = ("readme", "speedup", "synthetic", "peer", "real", "tiny")

# Per-suite defaults; command-line flags override them.
SUITE_DEFAULTS = {
    "readme": dict(num_drafts=(1, 2, 3, 4, 5, 6, 7, 8), batches=(1, 4, 16),
                   temperatures=(0.0, 0.7, 1.0), max_new_tokens=128,
                   synthetic_sizes=("126M",), acceptances=(0.8,), peer_prompts=3, repeats=5),
    "speedup": dict(num_drafts=(1, 2, 3, 4, 5, 6, 7, 8), batches=(1, 4, 16, 64),
                    temperatures=(0.0, 0.7, 1.0), max_new_tokens=128, repeats=3),
    "synthetic": dict(num_drafts=(2, 4, 6, 8), batches=(1, 4), max_new_tokens=64, repeats=2,
                      synthetic_sizes=("12M", "50M", "126M", "400M"),
                      acceptances=(0.5, 0.8, 0.9)),
    "peer": dict(num_drafts=(4,), max_new_tokens=128, repeats=3, peer_prompts=3),
    "real": dict(model="smollm2-135m", num_drafts=(4,), temperatures=(0.0, 0.7),
                 max_new_tokens=64, repeats=1, prompts_per_category=4),
    "tiny": dict(model="tiny", num_drafts=(1, 2), batches=(1, 2), temperatures=(0.0, 1.0),
                 max_new_tokens=8, prompt_tokens=8, repeats=1, synthetic_sizes=("tiny",),
                 acceptances=(0.8,), peer_prompts=1),
}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
  """Declares the `specjax bench` arguments (on `parser` if given, e.g. a CLI subparser)."""
  parser = parser or argparse.ArgumentParser(prog="specjax bench",
                                             description=__doc__.split("\n")[0])
  parser.add_argument("--suite", choices=SUITES, default="readme",
                      help="what to measure (default: readme, the README table)")
  parser.add_argument("--model", default=None,
                      help="'default' (the shipped pair) or a random size: "
                      + ", ".join(SYNTHETIC_SIZES) + "; for --suite real: "
                      + ", ".join(REAL_MODELS))
  parser.add_argument("--k", dest="num_drafts", type=_ints, default=None,
                      help="comma-separated draft lengths, e.g. 1,2,4")
  parser.add_argument("--batch", dest="batches", type=_ints, default=None, help="e.g. 1,4,16,64")
  parser.add_argument("--temperature", dest="temperatures", type=_floats, default=None,
                      help="e.g. 0,0.7,1")
  parser.add_argument("--max-new-tokens", type=int, default=None)
  parser.add_argument("--prompt-tokens", type=int, default=None)
  parser.add_argument("--repeats", type=int, default=None, help="timed calls of each after warm-up")
  parser.add_argument("--sizes", dest="synthetic_sizes", type=_strings, default=None,
                      help="synthetic target sizes, e.g. 50M,126M")
  parser.add_argument("--acceptance", dest="acceptances", type=_floats, default=None,
                      help="synthetic acceptance rates, e.g. 0.5,0.8")
  parser.add_argument("--peer-prompts", type=int, default=None)
  parser.add_argument("--statistic", choices=("min", "median"), default=None,
                      help="per-call time over the repeats (default min: robust on a shared "
                      "machine, where other load only adds time)")
  real = parser.add_argument_group("real-model suite (--suite real)")
  real.add_argument("--prompts-per-category", type=int, default=None,
                    help="prompts of each category (default 6)")
  real.add_argument("--prompt-set", choices=("real", "agent"), default=None,
                    help="real: Spec-Bench's six categories (default); agent: code edits, tool "
                    "calls, repeated requests (benchmarks/prompts/agent.json)")
  real.add_argument("--categories", type=_strings, default=None,
                    help="comma-separated categories (default: all of the prompt file)")
  real.add_argument("--drafters", type=_strings, default=None,
                    help="comma-separated drafter names (default: every drafter the library "
                         "has; on request also suffix+corpus, suffix-tree, suffix-tree+corpus, "
                         "self-int8+vocab, self-q4+vocab, and NAME+adaptive)")
  real.add_argument("--head", dest="heads", action="append", default=None, metavar="DIR",
                    help="a trained head checkpoint (EAGLE-3/MTP or Medusa) to add (repeatable)")
  real.add_argument("--calibration", default=None, metavar="DIR",
                    help="cost table + acceptance profile (`specjax calibrate --out DIR`) for "
                         "drafters named NAME+adaptive; default: measured in the run")
  real.add_argument("--no-peer", dest="peer", action="store_false", default=None,
                    help="skip the transformers runs")
  parser.add_argument("--out", default=str(DEFAULT_OUT), help="results directory")
  parser.add_argument("--no-plots", action="store_true")
  return parser


def settings_from_args(args) -> Settings:
  """The suite's defaults, overridden by the flags given."""
  fields = dict(SUITE_DEFAULTS[args.suite])
  for field in dataclasses.fields(Settings):
    value = getattr(args, field.name, None)
    if value is not None and field.name != "suite":
      fields[field.name] = value
  fields["suite"] = args.suite
  if "model" not in fields:
    fields["model"] = "default" if default_pair_available() else "12M"
  return Settings(**fields)


def main(argv: list[str] | None = None) -> int:
  """`specjax bench` entry point: parses `argv` and runs the suite."""
  args = build_parser().parse_args(argv)
  return run_args(args)


def run_args(args) -> int:
  """Runs a suite from parsed arguments (shared by `main` and the `specjax` CLI)."""
  settings = settings_from_args(args)
  run(settings, pathlib.Path(args.out), plots=not args.no_plots,
      log=lambda line: print(line, flush=True))
  return 0
