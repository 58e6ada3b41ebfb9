"""The `specjax` command line.

Each subcommand is one `_add_<name>(subparsers)` function that declares its arguments and sets
`func`; heavy imports happen inside the handlers so `specjax --help` is instant.
"""

from __future__ import annotations

import argparse
import sys


class CliError(Exception):
  """A user-facing error: printed as one line, exit status 2."""


def _add_demo(subparsers):
  parser = subparsers.add_parser(
      "demo", help="complete a prompt with the shipped target/draft pair and show the speedup")
  parser.add_argument("--prompt", default="def fibonacci(n):\n", help="text to complete")
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--num-draft", type=int, default=4, help="draft tokens per round (k)")
  parser.set_defaults(func=_run_demo)


def _run_demo(args):
  try:
    import specjax as sj
    load_default = sj.load_default
  except AttributeError:
    raise CliError("no checkpoint shipped yet: the default target/draft pair is not in this "
                   "build (see checkpoints/README.md)") from None
  del load_default
  from specjax import demo
  return demo.run(args)


def _add_train(subparsers):
  parser = subparsers.add_parser(
      "train", help="train the tokenizer, a target LM, or a draft distilled from a target")
  from specjax import train
  train.add_arguments(parser)
  parser.set_defaults(func=_run_train)


def _run_train(args):
  from specjax import train
  return train.run_cli(args)


SUBCOMMANDS = [_add_demo, _add_train]


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="specjax", description="Exact speculative decoding in JAX.")
  subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  for add in SUBCOMMANDS:
    add(subparsers)
  return parser


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    result = args.func(args)
  except (CliError, ValueError, FileNotFoundError) as error:
    print(f"specjax {args.command}: error: {error}", file=sys.stderr)
    return 2
  return int(result or 0)


if __name__ == "__main__":
  sys.exit(main())
