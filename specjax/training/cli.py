"""`specjax train {tokenizer,lm,distill,evaluate,export}`: the command line of LM/draft training."""

from __future__ import annotations

import json
import pathlib

import numpy as np

from specjax.training import corpus
from specjax.training.data import corpus_stream, train_tokenizer
from specjax.training.evaluate import acceptance, evaluate
from specjax.training.loop import train
from specjax.training.state import TrainConfig, load_run, model_preset


TASKS = {
    "tokenizer": "train the byte-level BPE tokenizer",
    "lm": "cross-entropy on the corpus (target or data-only draft)",
    "distill": "train a draft to match a trained target",
    "evaluate": "held-out perplexity of --target-run and of each --run-dir draft, and their "
                "greedy acceptance",
    "export": "write --target-run and --run-dir as a toy pair into --out",
}

def add_arguments(parser) -> None:
  """Declares the arguments of `specjax train {tokenizer,lm,distill,evaluate,export}` (the task
  itself is the subcommand)."""
  parser.add_argument("--tokenizer", default="checkpoints/toy/tokenizer.json",
                      help="tokenizer.json to read (or, for the tokenizer task, to write)")
  parser.add_argument("--vocab-size", type=int, default=8192)
  parser.add_argument("--model", default="target", help="architecture preset: target, draft, tiny")
  parser.add_argument("--run-dir", action="append",
                      help="train-state checkpoints; an existing run is resumed (evaluate: may be "
                      "repeated, one per draft)")
  parser.add_argument("--out", default="checkpoints/toy",
                      help="export: destination directory")
  parser.add_argument("--eval-windows", type=int, default=64,
                      help="evaluate: held-out windows of --seq-len tokens for perplexity")
  parser.add_argument("--eval-prompts", type=int, default=32,
                      help="evaluate: held-out prompts for the acceptance measurement")
  parser.add_argument("--target-run", help="run directory of the target (distill)")
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--stop-at", type=int, help="stop after this step (resume later)")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=256)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--warmup", type=int, default=100)
  parser.add_argument("--weight-decay", type=float, default=0.1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--loss", choices=("tv", "fkl"), default="tv", help="distillation loss")
  parser.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
  parser.add_argument("--on-policy", type=float, default=0.0,
                      help="share of each distillation batch sampled by the draft")
  parser.add_argument("--checkpoint-every", type=float, default=300.0, help="seconds")
  parser.add_argument("--no-progress", action="store_true")

def run_cli(args) -> int:
  """Runs `specjax train` with parsed arguments."""
  if args.task == "tokenizer":
    train_tokenizer(corpus.load("train"), args.vocab_size, args.tokenizer)
    print(f"wrote {args.tokenizer}")
    return 0
  if not args.run_dir:
    raise ValueError("--run-dir is required")
  if args.task == "evaluate":
    return _evaluate_cli(args)
  if args.task == "export":
    from specjax.pretrained.pairs import export
    target, _, _ = load_run(args.target_run)
    draft, _, _ = load_run(args.run_dir[0])
    print(f"wrote {export(target, draft, args.tokenizer, args.out)}")
    return 0
  run_dir = args.run_dir[0]
  stream = corpus_stream(args.tokenizer, "train", cache_dir=pathlib.Path(run_dir) / "cache")
  from tokenizers import Tokenizer
  vocab_size = Tokenizer.from_file(str(args.tokenizer)).get_vocab_size()
  model_config = model_preset(args.model, vocab_size)
  config = TrainConfig(task=args.task, steps=args.steps, batch_size=args.batch_size,
                       seq_len=args.seq_len, learning_rate=args.lr, warmup_steps=args.warmup,
                       weight_decay=args.weight_decay, seed=args.seed, distill_loss=args.loss,
                       distill_temperature=args.temperature, on_policy=args.on_policy)
  target = None
  if args.task == "distill":
    if not args.target_run:
      raise ValueError("distill needs --target-run")
    target, _, _ = load_run(args.target_run)
  print(f"{args.task}: {args.model} ({model_config.num_params() / 1e6:.2f}M params), "
        f"{len(stream):,} training tokens, {config.steps} steps of "
        f"{config.batch_size}x{config.seq_len}", flush=True)
  train(model_config, config, stream, target=target, checkpoint_dir=run_dir,
        checkpoint_every_s=args.checkpoint_every, stop_at=args.stop_at,
        progress=not args.no_progress, log_path=pathlib.Path(run_dir) / "log.jsonl")
  return 0

def _evaluate_cli(args) -> int:
  heldout = corpus_stream(args.tokenizer, "heldout")
  windows = corpus.eval_windows(heldout, args.seq_len, args.eval_windows)
  # Acceptance prompts: evenly spaced held-out windows, not the perplexity windows.
  spaced = corpus.eval_windows(heldout, args.seq_len)
  prompts = spaced[np.linspace(0, len(spaced) - 1, args.eval_prompts).astype(int)]
  target = load_run(args.target_run)[0] if args.target_run else None
  report = {"heldout_tokens": int(len(heldout)), "eval_tokens": int(windows[:, 1:].size),
            "acceptance_prompts": len(prompts)}
  print(json.dumps(report), flush=True)
  if target is not None:
    report["target"] = evaluate(target, windows)
    print(json.dumps({"target": report["target"]}), flush=True)
  for run_dir in args.run_dir:
    draft = load_run(run_dir)[0]
    result = evaluate(draft, windows, target=target)
    if target is not None:
      result["greedy_k4"] = acceptance(target, draft, prompts, num_draft=4, check_generate=True)
    report[str(run_dir)] = result
    print(json.dumps({str(run_dir): result}), flush=True)
  return 0
