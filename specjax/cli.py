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


def _add_convert(subparsers):
  parser = subparsers.add_parser(
      "convert", help="convert a Hugging Face checkpoint directory to a specjax (Orbax) checkpoint")
  parser.add_argument("hf_dir", help="directory with config.json and *.safetensors")
  parser.add_argument("out_dir", help="the specjax checkpoint directory to create")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="cast the weights (default: keep the checkpoint's dtype)")
  parser.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
  parser.set_defaults(func=_run_convert)


def _run_convert(args):
  import pathlib

  from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                             TimeElapsedColumn)

  from specjax import checkpoint

  if pathlib.Path(args.out_dir).exists() and not args.overwrite:
    raise CliError(f"{args.out_dir} already exists (pass --overwrite to replace it)")
  columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
             TimeElapsedColumn(), TextColumn("{task.fields[tensor]}", style="dim"))
  with Progress(*columns) as bar:
    reading = bar.add_task("reading weights", total=None, tensor="")

    def progress(done, total, name):
      bar.update(reading, completed=done, total=total, tensor=name)

    model = checkpoint.from_hf(args.hf_dir, dtype=args.dtype, progress=progress)
    bar.update(reading, tensor="")
    writing = bar.add_task("writing Orbax checkpoint", total=1, tensor=str(args.out_dir))
    checkpoint.save(model, args.out_dir, overwrite=args.overwrite)
    copied = checkpoint.copy_tokenizer_files(args.hf_dir, args.out_dir)
    bar.update(writing, completed=1)
  config = model.config
  print(f"wrote {args.out_dir}: {config.family}, {config.num_layers} layers, "
        f"{config.num_params() / 1e6:.1f}M parameters, {model.dtype}"
        + (f"; tokenizer files: {', '.join(copied)}" if copied else "; no tokenizer files found"))
  return 0


SUBCOMMANDS = [_add_demo, _add_train, _add_convert]


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
