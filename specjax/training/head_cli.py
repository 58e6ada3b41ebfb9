"""`specjax train head-data` and `specjax train head`: self-distillation data and head training.

```
specjax train head-data --target smollm2 --data runs/selfdistill --conversations 6400
specjax train head --target smollm2 --data runs/selfdistill --run-dir runs/eagle3 \
    --kind eagle3 --steps 2000 --chunks 0:40 --eval-chunks 40
```
The same commands run on a GPU with larger `--conversations`, `--steps`, `--batch-size`.
Both resume: finished chunks are skipped, and a run directory continues from its newest state.
"""

from __future__ import annotations

import argparse
import pathlib


def load_target(spec: str, dtype: str = "float32"):
  """A target from "smollm2" (the packaged GGUF), a `.gguf` file, a Hugging Face directory or a
  specjax checkpoint directory, in the layer layout that runs fastest on this platform."""
  return _read_target(spec, dtype).for_platform()


def _read_target(spec: str, dtype: str):
  import jax.numpy as jnp
  dtype = jnp.dtype(dtype)
  path = pathlib.Path(_resolve(spec))
  if path.suffix == ".gguf":
    from specjax.io.gguf import from_gguf
    return from_gguf(path, dtype=dtype)
  if (path / "config.json").is_file():
    from specjax.io.hf import from_hf
    return from_hf(path, dtype=dtype)
  from specjax.io.orbax import load
  return load(path, dtype=dtype)


def _resolve(spec: str) -> str:
  """"smollm2" -> the packaged GGUF file's path; any other spec is a path already."""
  if spec == "smollm2":
    from specjax.io.gguf import find_packaged_gguf
    return str(find_packaged_gguf("smollm2"))
  return spec


def chat_encoder(spec: str):
  """`messages -> ids` with the target's chat template (generation prompt added)."""
  from transformers import AutoTokenizer
  path = pathlib.Path(_resolve(spec))
  if path.suffix == ".gguf":
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  else:
    tokenizer = AutoTokenizer.from_pretrained(str(path))

  def encode(messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]

  return encode


TASKS = {
    "head-data": "self-distillation data: the target answers generated chat prompts; its "
                 "features and top-k logits are recorded",
    "head": "train an EAGLE-3, MTP or Medusa head on that data (resumable)",
}


def _span(text: str) -> list[int]:
  """"0:40" -> [0, ..., 39]; "3,5,7" -> [3, 5, 7]."""
  if ":" in text:
    start, stop = text.split(":")
    return list(range(int(start), int(stop)))
  return [int(x) for x in text.split(",") if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--target", default="smollm2",
                      help="smollm2 (packaged GGUF), a .gguf file, a HF or specjax directory")
  parser.add_argument("--tokenizer", help="tokenizer source for head-data (default: --target)")
  parser.add_argument("--data", default="runs/selfdistill", help="self-distillation chunk folder")
  parser.add_argument("--conversations", type=int, default=6400, help="head-data: prompts")
  parser.add_argument("--prompts", choices=("templates", "self"), default="templates",
                      help="head-data: prompts from word-list templates, or user turns the target "
                           "writes itself (specjax.training.self_prompts)")
  parser.add_argument("--gen-batch", type=int, default=64, help="head-data: rows per chunk")
  parser.add_argument("--max-new-tokens", type=int, default=128, help="head-data: answer budget")
  parser.add_argument("--write-chunks", help="head-data: write only these chunks, e.g. 50:90")
  parser.add_argument("--run-dir", default="runs/eagle3", help="head: the run's folder")
  parser.add_argument("--kind", choices=("eagle3", "mtp", "medusa"), default="eagle3")
  parser.add_argument("--parallel", action="store_true",
                      help="eagle3/mtp: a parallel-drafting head (ttt-steps - 2 placeholder slots; "
                           "drafts up to ttt-steps tokens in one forward)")
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--stop-at", type=int, help="stop after this step (resume later)")
  parser.add_argument("--batch-size", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=320)
  parser.add_argument("--ttt-steps", type=int, default=4,
                      help="training-time-test unroll depth (Medusa: number of heads)")
  parser.add_argument("--draft-vocab", type=int, default=8192)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--warmup", type=int, default=50)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--chunks", default="1:40", help="training chunks, e.g. 1:40 or 1,2,3")
  parser.add_argument("--eval-chunks", default="0", help="held-out chunks (greedy ones)")
  parser.add_argument("--vocab-chunks", help="chunks that pick the draft vocabulary")
  parser.add_argument("--checkpoint-every", type=int, default=50, help="steps")
  parser.add_argument("--eval-every", type=int, default=100, help="steps")
  parser.add_argument("--eval-batches", type=int, default=4)
  parser.add_argument("--train-on-prompts", action="store_true",
                      help="head: also train on prompt positions")
  parser.add_argument("--context", type=int,
                      help="head: windows start this many tokens before the answer")
  parser.add_argument("--init-from", help="head: start from this saved head")
  parser.add_argument("--no-progress", action="store_true")


def run(args) -> int:
  """Runs `specjax train head-data` or `specjax train head` (`args.task`)."""
  from specjax.drafters.eagle import network as eagle
  from specjax.training import head_run, heads, prompts, self_prompts, selfdistill
  target = load_target(args.target)
  if args.task == "head-data":
    if args.prompts == "self":
      from specjax.io.tokenizer import load_tokenizer
      conversations = self_prompts.SelfWrittenConversations(
          target, load_tokenizer(_resolve(args.tokenizer or args.target)),
          args.conversations, batch_size=args.gen_batch, seed=args.seed)
    else:
      conversations = prompts.training_conversations(args.conversations, seed=args.seed)
    encode = chat_encoder(args.tokenizer or args.target)
    selfdistill.generate_chunks(target, encode, conversations, args.data,
                                batch_size=args.gen_batch, max_new_tokens=args.max_new_tokens,
                                eos_id=target.config.eos_id, seed=args.seed,
                                only=_span(args.write_chunks) if args.write_chunks else None,
                                taps=eagle.head_config_for(target.config, draft_vocab_size=1)
                                .taps,
                                log=lambda line: print(line, flush=True))
    return 0
  config = heads.HeadTrainConfig(kind=args.kind, steps=args.steps, batch_size=args.batch_size,
                                 seq_len=args.seq_len, ttt_steps=args.ttt_steps,
                                 parallel=args.parallel, draft_vocab_size=args.draft_vocab,
                                 learning_rate=args.lr, warmup_steps=args.warmup, seed=args.seed)
  chunks = _span(args.chunks)
  head_run.train_head(target, args.data, args.run_dir, config, chunks=chunks,
                      eval_chunks=_span(args.eval_chunks),
                      vocab_chunks=_span(args.vocab_chunks) if args.vocab_chunks else None,
                      rows_per_chunk=args.gen_batch, eval_every=args.eval_every,
                      eval_batches=args.eval_batches, checkpoint_every=args.checkpoint_every,
                      max_steps=args.stop_at, progress=not args.no_progress,
                      train_on_prompts=args.train_on_prompts, context=args.context,
                      init_from=args.init_from,
                      log=lambda line: print(line, flush=True))
  print(f"head saved under {pathlib.Path(args.run_dir) / head_run.HEAD_DIR}")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="specjax train head")
  parser.add_argument("task", choices=tuple(TASKS))
  add_arguments(parser)
  return run(parser.parse_args(argv))


if __name__ == "__main__":
  raise SystemExit(main())
