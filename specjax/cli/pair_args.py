"""Command-line arguments of the subcommands that run a target/draft pair, and the pair they name.

`specjax generate`, `audit` (`specjax.cli.main`) and `calibrate` (`specjax.tuning.calibrate`) share
them: `add_pair_arguments` declares `--target/--gguf/--draft/--tokenizer/--dtype` and `load_pair`
loads what they name; `add_sampling_arguments` and `sampling_from` do the same for the sampling
settings. Errors the user can fix are `CliError`s (printed as one line, exit status 2). Heavy
imports happen inside the functions, so declaring the arguments stays instant.
"""

from __future__ import annotations

__all__ = ["CliError", "add_pair_arguments", "add_sampling_arguments", "is_gguf", "load_model",
           "load_pair", "sampling_from"]


DEFAULT_NUM_DRAFT = 4  # k for a pair nobody measured


class CliError(Exception):
  """A user-facing error: printed as one line, exit status 2."""


def is_gguf(path: str) -> bool:
  """Whether `path` is a file that starts with GGUF's magic bytes."""
  import pathlib
  file = pathlib.Path(path)
  if not file.is_file():
    return False
  with open(file, "rb") as stream:
    return stream.read(4) == b"GGUF"


def add_pair_arguments(parser):
  models = parser.add_argument_group(
      "models", "a specjax (Orbax) or Hugging Face checkpoint directory, or a GGUF file, each; "
      "no target = the shipped default pair")
  models.add_argument("--target", "--model", dest="target", default=None, metavar="DIR|FILE",
                      help="target model: a specjax or Hugging Face directory, or a .gguf file")
  models.add_argument("--gguf", default=None, metavar="FILE",
                      help="target model from a GGUF file (its tokenizer and chat template too)")
  models.add_argument("--draft", default=None, metavar="DIR|FILE|ngram",
                      help="draft model directory or .gguf file, or 'ngram' for prompt-lookup "
                      "drafting (the default when a target is given)")
  models.add_argument("--tokenizer", default=None, metavar="PATH",
                      help="tokenizer.json, its directory, or a .gguf file (default: the "
                      "target's)")
  models.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="compute dtype of the loaded weights (default float32)")


def add_sampling_arguments(parser, temperature: float):
  sampling = parser.add_argument_group("sampling")
  sampling.add_argument("--temperature", type=float, default=temperature,
                        help=f"0 = greedy (default {temperature:g})")
  sampling.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
  sampling.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
  sampling.add_argument("--num-draft", type=int, default=None,
                        help="draft tokens per round (k; default: the shipped pair's measured "
                        f"best k when it runs, else {DEFAULT_NUM_DRAFT})")
  sampling.add_argument("--seed", type=int, default=0, help="PRNG seed")


def sampling_from(args):
  """The `specjax.Sampling` of `--temperature/--top-k/--top-p`."""
  import specjax as sj
  return sj.Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def load_model(path: str, dtype: str):
  """A model from a specjax (Orbax) or Hugging Face checkpoint directory, or a GGUF file."""
  import pathlib

  import jax

  from specjax.io import gguf, hf, orbax

  directory = pathlib.Path(path)
  # The platform's layout: per-layer weights on CPU, the stacked lax.scan elsewhere (same
  # numerics); a GGUF file's is built as the file is read.
  if is_gguf(path):
    return gguf.from_gguf(path, dtype=dtype, platform=jax.default_backend())
  if not directory.is_dir():
    raise CliError(f"no checkpoint directory or GGUF file at {path}")
  if (directory / orbax.CONFIG_FILE).is_file():
    return orbax.load(directory, dtype=dtype).for_platform()
  if (directory / "config.json").is_file():
    return hf.from_hf(directory, dtype=dtype).for_platform()
  raise CliError(f"{path} is neither a specjax checkpoint ({orbax.CONFIG_FILE}) nor a "
                 "Hugging Face one (config.json)")


def load_pair(args):
  """`(target, draft or drafter, tokenizer)` from `--target/--draft/--tokenizer`; sets
  `args.num_draft` where it is None: the shipped pair's measured best k when the shipped pair runs
  with its own drafter, else `DEFAULT_NUM_DRAFT`."""
  import pathlib

  import specjax as sj
  from specjax.io import load_tokenizer

  if getattr(args, "gguf", None) is not None:
    if args.target is not None:
      raise CliError("give the target once: --gguf FILE or --model/--target, not both")
    if not is_gguf(args.gguf):
      raise CliError(f"no GGUF file at {args.gguf}")
    args.target = args.gguf
  if args.target is None:
    if args.draft not in (None, "ngram"):
      raise CliError("--draft DIR needs --target DIR (only the shipped pair needs neither)")
    try:
      pair = sj.load_default()
    except FileNotFoundError as error:
      raise CliError(f"{error}; pass --target and --draft checkpoint directories") from None
    draft = sj.NGramDrafter() if args.draft == "ngram" else pair.draft
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else pair.tokenizer
    if getattr(args, "num_draft", 0) is None:
      args.num_draft = (pair.num_draft if args.draft != "ngram" and pair.num_draft is not None
                        else DEFAULT_NUM_DRAFT)
    return pair.target, draft, tokenizer
  if getattr(args, "num_draft", 0) is None:
    args.num_draft = DEFAULT_NUM_DRAFT
  target = load_model(args.target, args.dtype)
  draft = (sj.NGramDrafter() if args.draft in (None, "ngram")
           else load_model(args.draft, args.dtype))
  source = args.tokenizer or args.target
  if (not args.tokenizer and not is_gguf(source)
      and not (pathlib.Path(source) / "tokenizer.json").is_file()):
    raise CliError(f"no tokenizer.json in {source}: pass --tokenizer PATH")
  return target, draft, load_tokenizer(source)
