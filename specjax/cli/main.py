"""The `specjax` command line.

Each subcommand is one `_add_<name>(subparsers)` function that declares its arguments and sets
`func`; heavy imports happen inside the handlers so `specjax --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from specjax.cli import calibrate  # light: its heavy imports sit inside its handlers
from specjax.cli.pair_args import (CliError, add_pair_arguments, add_sampling_arguments, is_gguf,
                                   load_pair, sampling_from)


def _add_demo(subparsers):
  from specjax.cli import demo
  demo.add_subcommand(subparsers, _run_demo)


def _run_demo(args):
  try:
    import specjax as sj
    load_default = sj.load_default
  except AttributeError:
    raise CliError("no checkpoint shipped yet: the default target/draft pair is not in this "
                   "build (see checkpoints/README.md)") from None
  del load_default
  from specjax.cli import demo
  return demo.run(args)


def _add_train(subparsers):
  parser = subparsers.add_parser(
      "train", help="train the tokenizer, a target LM, a distilled draft, or a draft head")
  missing = [m for m in ("optax", "flax") if importlib.util.find_spec(m) is None]
  if missing:  # training needs the `train` extra; the other subcommands do not
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.set_defaults(func=lambda args: _raise(CliError(
        f"{', '.join(missing)} not installed: training needs the `train` extra of specjax "
        "(pip install 'specjax[train]')")))
    return
  tasks = parser.add_subparsers(dest="task", required=True, metavar="TASK")
  from specjax.training import cli as train_cli
  for task, text in train_cli.TASKS.items():
    sub = tasks.add_parser(task, help=text)
    train_cli.add_arguments(sub)
    sub.set_defaults(func=_run_train)
  from specjax.training import head_cli
  for task, text in head_cli.TASKS.items():
    sub = tasks.add_parser(task, help=text)
    head_cli.add_arguments(sub)
    sub.set_defaults(func=_run_head)


def _raise(error):
  raise error


def _run_train(args):
  from specjax.training import cli as train_cli
  return train_cli.run_cli(args)


def _run_head(args):
  from specjax.training import head_cli
  return head_cli.run(args)


def _add_convert(subparsers):
  parser = subparsers.add_parser(
      "convert", help="convert a Hugging Face directory or a GGUF file to a specjax (Orbax) "
      "checkpoint")
  parser.add_argument("hf_dir", metavar="SOURCE",
                      help="a directory with config.json and *.safetensors, or a .gguf file")
  parser.add_argument("out_dir", help="the specjax checkpoint directory to create")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="cast the weights (default: keep the checkpoint's dtype; float32 for "
                      "a GGUF, whose quantized tensors are dequantized)")
  parser.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
  parser.set_defaults(func=_run_convert)


def _run_convert(args):
  import pathlib

  from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                             TimeElapsedColumn)

  from specjax.io import gguf, hf, orbax

  if pathlib.Path(args.out_dir).exists() and not args.overwrite:
    raise CliError(f"{args.out_dir} already exists (pass --overwrite to replace it)")
  columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
             TimeElapsedColumn(), TextColumn("{task.fields[tensor]}", style="dim"))
  with Progress(*columns) as bar:
    reading = bar.add_task("reading weights", total=None, tensor="")

    def progress(done, total, name):
      bar.update(reading, completed=done, total=total, tensor=name)

    source_is_gguf = is_gguf(args.hf_dir)
    if source_is_gguf:
      model = gguf.from_gguf(args.hf_dir, dtype=args.dtype or "float32", progress=progress)
    else:
      model = hf.from_hf(args.hf_dir, dtype=args.dtype, progress=progress)
    bar.update(reading, tensor="")
    writing = bar.add_task("writing Orbax checkpoint", total=1, tensor=str(args.out_dir))
    orbax.save(model, args.out_dir, overwrite=args.overwrite)
    if source_is_gguf:
      from specjax.io.tokenizer import load_tokenizer
      load_tokenizer(args.hf_dir).save(args.out_dir)
      copied = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    else:
      copied = hf.copy_tokenizer_files(args.hf_dir, args.out_dir)
    bar.update(writing, completed=1)
  config = model.config
  print(f"wrote {args.out_dir}: {config.family}, {config.num_layers} layers, "
        f"{config.num_params() / 1e6:.1f}M parameters, {model.dtype}"
        + (f"; tokenizer files: {', '.join(copied)}" if copied else "; no tokenizer files found"))
  return 0


SUBCOMMANDS = [_add_demo, _add_train, _add_convert]

# ---------------------------------------------------------------------------------------------
# generate / audit (a target/draft pair named by `specjax.cli.pair_args`'s arguments) / bench.

DEFAULT_AUDIT_PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef ", "class Stack:\n    def ",
                         "for i in range(")


def _prompt_text(args) -> str:
  import pathlib
  if args.file is not None:
    if args.prompt is not None:
      raise CliError("give the prompt as text or with --file, not both")
    path = pathlib.Path(args.file)
    if not path.is_file():
      raise CliError(f"no prompt file at {args.file}")
    return path.read_text()
  if args.prompt is None:
    raise CliError("no prompt: give it as text or with --file PATH")
  return args.prompt


def _add_generate(subparsers):
  parser = subparsers.add_parser(
      "generate", help="complete a prompt with speculative decoding, printing text as it comes",
      description="Complete a prompt with speculative decoding. Tokens are printed as each "
      "draft/verify round accepts them (one jitted round per step, the same tokens as "
      "specjax.decode); --no-stream runs the whole call as one compiled loop instead. Exit "
      "status 1, with a warning, where the target's logits were not finite (broken weights).")
  parser.add_argument("prompt", nargs="?", default=None, help="the prompt text")
  parser.add_argument("--file", default=None, metavar="PATH", help="read the prompt from a file")
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--no-stream", action="store_true",
                      help="print the completion once, after one compiled decode call")
  parser.add_argument("--chat", default=None, metavar="TEXT",
                      help="a user message: apply the model's chat template and print the reply")
  parser.add_argument("--system", default=None, metavar="TEXT",
                      help="a system prompt for --chat")
  parser.add_argument("--ignore-eos", action="store_true",
                      help="do not stop at the model's end-of-sequence / end-of-turn tokens")
  add_pair_arguments(parser)
  add_sampling_arguments(parser, temperature=0.0)
  parser.set_defaults(func=_run_generate)


def _run_generate(args):
  import time

  import jax
  import numpy as np

  import specjax as sj

  if args.chat is not None and (args.prompt is not None or args.file is not None):
    raise CliError("give either --chat TEXT or a prompt (text or --file), not both")
  if args.system is not None and args.chat is None:
    raise CliError("--system needs --chat")
  text = args.chat if args.chat is not None else _prompt_text(args)
  sampling = sampling_from(args)
  target, draft, tokenizer = load_pair(args)
  if args.chat is not None:
    ids, lengths = _chat_ids(tokenizer, target, args.system, args.chat)
  else:
    ids, lengths = tokenizer.encode_batch([text])
  eos_ids = tuple(tokenizer.eos_ids) or (
      () if target.config.eos_id is None else (target.config.eos_id,))
  eos = None if args.ignore_eos or not eos_ids else eos_ids
  rng = jax.random.key(args.seed)
  start = time.perf_counter()
  if args.chat is None:
    sys.stdout.write(text)
    sys.stdout.flush()
  if args.no_stream:
    out = sj.decode(target, draft, ids, rng, lengths=lengths, max_new_tokens=args.max_new_tokens,
                    num_draft=args.num_draft, sampling=sampling, eos_id=eos)
    new = np.asarray(out.tokens[0, :int(out.num_tokens[0])])
    sys.stdout.write(tokenizer.decode(new))
    stats = out.stats
  else:
    from specjax.loop.stream import decode_stream
    new, printed, stats = [], "", None
    for tokens, state in decode_stream(target, draft, ids, rng, lengths=lengths,
                                       max_new_tokens=args.max_new_tokens,
                                       num_draft=args.num_draft, sampling=sampling, eos_id=eos):
      new += tokens[0].tolist()
      stats = state.stats
      completion = tokenizer.decode(new)
      if completion.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its bytes
        continue
      sys.stdout.write(completion[len(printed):])
      sys.stdout.flush()
      printed = completion
    sys.stdout.write(tokenizer.decode(new)[len(printed):])
  sys.stdout.write("\n")
  summary = stats.summary()
  print(f"[{len(new)} tokens in {summary['rounds']} rounds, acceptance rate "
        f"{summary['acceptance_rate']:.1%}, {summary['tokens_per_round']:.2f} tokens per target "
        f"pass, {time.perf_counter() - start:.1f}s incl. compile]", file=sys.stderr)
  from specjax.cli.nonfinite import NONFINITE_EXIT, nonfinite_rows, warning
  broken = nonfinite_rows(stats)
  if broken:
    print(warning(broken), file=sys.stderr)
    return NONFINITE_EXIT
  return 0


def _chat_ids(tokenizer, target, system, message):
  """`(ids [1, T], lengths [1])` of a one-turn chat under the model's template (a built-in one,
  announced on stderr, when the model files carry none)."""
  import numpy as np

  from specjax.io import chat

  template = tokenizer.chat_template
  if not template:
    family = getattr(getattr(target, "config", None), "family", "")
    template = chat.default_template_for(family)
    name = "gemma" if family.startswith("gemma") else "chatml"
    print(f"[no chat template in the model files: using the built-in {name} template]",
          file=sys.stderr)
  messages = ([{"role": "system", "content": system}] if system else []) + [
      {"role": "user", "content": message}]
  ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=template)
  return np.asarray([ids], np.int32), np.asarray([len(ids)], np.int32)


AUDIT_EXIT = {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}  # 2 is the exit status of usage errors


def _add_audit(subparsers):
  parser = subparsers.add_parser(
      "audit", help="check that speculative decoding reproduces the target (exit 0 PASS, 1 FAIL, "
      "3 INCONCLUSIVE)",
      description="Exactness audit of a target/draft pair under your sampling settings: greedy "
      "token identity between specjax.decode and specjax.generate (first divergence and whether "
      "it is a float32 near-tie), and per-position chi-square goodness of fit of sampled tokens "
      "against the target's own distribution, Bonferroni-corrected, with a negative control: a "
      "known-broken rule (corrections from p instead of the residual) run on the same draws must "
      "be rejected, or the sample size was too small to see it. Exit status 0 = PASS, 1 = FAIL, "
      "3 = INCONCLUSIVE (nothing rejected, but the control was not rejected either: the report "
      "estimates how many --samples would be needed).")
  parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                      help="a prompt (repeatable; default: a few Python snippets)")
  parser.add_argument("--file", default=None, metavar="PATH",
                      help="prompts, one per line")
  parser.add_argument("--samples", type=int, default=2000,
                      help="sampled continuations per prompt (default 2000)")
  parser.add_argument("--positions", type=int, default=3,
                      help="first positions tested per prompt (default 3)")
  parser.add_argument("--max-new-tokens", type=int, default=32,
                      help="tokens per prompt in the greedy identity check (default 32)")
  parser.add_argument("--alpha", type=float, default=1e-3,
                      help="family-wise significance level (default 1e-3)")
  parser.add_argument("--no-control", action="store_true",
                      help="skip the negative control (half the sampled decoding; PASS then "
                      "does not show that the sample size had the power to see an error)")
  add_pair_arguments(parser)
  add_sampling_arguments(parser, temperature=1.0)
  parser.set_defaults(func=_run_audit)


def _run_audit(args):
  import pathlib

  import specjax as sj

  prompts = list(args.prompt or [])
  if args.file is not None:
    path = pathlib.Path(args.file)
    if not path.is_file():
      raise CliError(f"no prompt file at {args.file}")
    prompts += [line.replace("\\n", "\n") for line in path.read_text().splitlines() if line]
  prompts = prompts or list(DEFAULT_AUDIT_PROMPTS)
  sampling = sampling_from(args)
  target, draft, tokenizer = load_pair(args)
  report = sj.audit(target, draft, prompts, tokenizer=tokenizer, sampling=sampling,
                    num_draft=args.num_draft, max_new_tokens=args.max_new_tokens,
                    num_samples=args.samples, num_positions=args.positions, seed=args.seed,
                    alpha=args.alpha, control=not args.no_control)
  print(report)
  return AUDIT_EXIT[report.verdict]


def _add_bench(subparsers):
  # The suites' own parser (benchmarks/cli.py) reads the arguments, so nothing is imported here;
  # '+' as the prefix makes every argument, `--suite` and `--help` included, one of `args`.
  parser = subparsers.add_parser(
      "bench", help="measure the speedup of speculative decoding (JSON, plots, README table)",
      description="Speedup of specjax.decode over specjax.generate and a peer, against the "
      "analytic bound; the suites live in the benchmarks/ package of a source checkout (see "
      "benchmarks/README.md).", prefix_chars="+", add_help=False)
  parser.add_argument("args", nargs="*", help="`specjax bench --help` lists them")
  parser.set_defaults(func=_run_bench)


def _benchmarks_cli():
  """`benchmarks.cli` of the source checkout this specjax comes from (not part of the wheel).

  Raises:
    CliError: outside a checkout (an installed wheel), or without the bench dependencies.
  """
  import importlib
  import pathlib

  root = pathlib.Path(__file__).resolve().parents[2]
  if not (root / "benchmarks" / "__init__.py").is_file():
    raise CliError("specjax bench needs a source checkout: the benchmarks/ package is not part "
                   "of the installed wheel; clone the repository, `pip install -e '.[bench]'` and "
                   "run `specjax bench` (or `python -m benchmarks`) there")
  if str(root) not in sys.path:
    sys.path.insert(0, str(root))
  try:
    package = importlib.import_module("benchmarks")
    if not getattr(package, "SPECJAX_BENCHMARKS", False):
      raise CliError(f"another package named 'benchmarks' ({package.__file__}) shadows the "
                     f"specjax benchmarks in {root / 'benchmarks'}")
    return importlib.import_module("benchmarks.cli")
  except ImportError as error:
    raise CliError(f"the benchmark suite cannot be imported ({error}); install the bench "
                   "dependencies: pip install -e '.[bench]'") from None


def _run_bench(args):
  return _benchmarks_cli().main(args.args)


SUBCOMMANDS += [_add_generate, _add_audit, _add_bench, calibrate.add_subcommand]


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
