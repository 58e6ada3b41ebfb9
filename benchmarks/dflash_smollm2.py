"""A DFlash drafter trained here for SmolLM2-135M-Instruct, end to end: data, training, tau.

```
python -m benchmarks.dflash_smollm2 data  --out runs/dflash_data --conversations 256
python -m benchmarks.dflash_smollm2 train --data runs/dflash_data --out runs/dflash --minutes 30
python -m benchmarks.dflash_smollm2 bench --drafter runs/dflash/drafter \
    --json benchmarks/results/dflash_smollm2.json
```

* `data`: the target's own answers (greedy and T = 0.7, alternating chunks) to the training
  template's conversations (`specjax.training.prompts`, never the real suite's prompts), with
  its taps at layers (2, 15, 27) and final normed hidden state at every position
  (`specjax.training.selfdistill.generate_chunks`).
* `train`: a 2-layer DFlash drafter reading `target_layer_ids = (1, 14, 26, 29)` (the outputs of
  layers 1, 14, 26 and the final normed state), block 8, initialised from the target's last two
  layers, trained with `specjax.training.dflash` within a wall-clock budget; saved in the
  published layout and loaded back with `load_dflash` exactly as z-lab's files are.
* `bench`: the real suite's prompts (`benchmarks/prompts/real.json`), `generate` against the
  DFlash argmax chain, sampled chain and DDTree, the shipped EAGLE-3 head and any `--head`,
  greedy and T = 0.7, measured as the real suite measures (`benchmarks.real.measure_suite`: the
  costs of a target step, a verify and each drafter's round, then the calls alternating prompt
  by prompt): acceptance per token, tau (emitted tokens per round), speedup (the suite's: greedy
  over the same text, sampled per token), the loop speedup (prefill out of both), the analytic
  bound and efficiency (loop speedup / bound), greedy identity with `generate`, and the load
  average.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

TAPS = (2, 15, 27)  # the EAGLE-3 head's taps: outputs of layers 1, 14, 26
LAYER_IDS = (1, 14, 26, 29)  # + the last layer (29): the final normed hidden state


def _target(raw: bool = False):
  from specjax.training.head_cli import _read_target, load_target
  return _read_target("smollm2", "float32") if raw else load_target("smollm2")


def data(args) -> None:
  from specjax.training import prompts, selfdistill
  from specjax.training.head_cli import chat_encoder
  target = _target()
  conversations = prompts.training_conversations(args.conversations, seed=args.seed)
  selfdistill.generate_chunks(target, chat_encoder("smollm2"), conversations, args.out,
                              batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                              eos_id=target.config.eos_id, taps=TAPS, seed=args.seed,
                              log=lambda line: print(line, flush=True))


def train(args) -> None:
  import jax
  from specjax.drafters.dflash import network as dflash
  from specjax.training import dflash as training
  target = _target(raw=True)
  c = target.config
  config = dflash.DFlashConfig(
      embed_dim=c.embed_dim, num_layers=args.layers, num_heads=c.num_heads,
      num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, mlp_dim=c.mlp_dim,
      vocab_size=c.vocab_size, block_size=args.block_size, mask_token_id=args.mask_token_id,
      target_layer_ids=LAYER_IDS, num_target_layers=c.num_layers, norm_eps=c.norm_eps,
      rope_theta=c.rope_theta)
  chunks = sorted(int(p.name.split("_")[-1]) for p in pathlib.Path(args.data).glob("chunk_*"))
  if not chunks:
    raise SystemExit(f"no chunks in {args.data}")
  network = training.init_from_target(config, target, jax.random.key(args.seed))
  batches = training.DFlashBatches(args.data, chunks, config, rows=args.rows,
                                   anchors=args.anchors, seq_len=args.seq_len, gamma=args.gamma,
                                   seed=args.seed)
  training.train_dflash(network, target, batches, args.out, steps=args.steps,
                        minutes=args.minutes, learning_rate=args.learning_rate,
                        log=lambda line: print(line, flush=True))


def bench(args) -> None:
  import jax
  import numpy as np

  import specjax as sj
  from benchmarks.drafters import DrafterEntry, load_head_drafter
  from benchmarks.real import PromptCase, load_prompts, measure_suite
  from benchmarks.real_models import chat_ids
  from specjax.drafters import load_dflash

  pair = sj.load_pair("smollm2-head")
  target, tokenizer = pair.target, pair.tokenizer
  eagle = pair.draft.drafter  # the shipped EAGLE-3 head, without prompt lookup
  prompts = load_prompts(per_category=args.per_category)
  cases = [PromptCase(category, conv["id"], tuple(chat_ids(tokenizer, conv["messages"])))
           for category, convs in prompts.items() for conv in convs]
  k = args.k
  tree = sj.TreeSpec(builder="ddtree", depth=k, width=args.width, num_nodes=args.nodes)
  entries = [
      DrafterEntry("dflash-argmax", load_dflash(args.drafter, target, mode="argmax"), k),
      DrafterEntry("dflash-sampled", load_dflash(args.drafter, target, mode="sampled"), k),
      DrafterEntry("dflash-ddtree", load_dflash(args.drafter, target), k, tree=tree),
      DrafterEntry("eagle3", eagle, 4),
  ]
  for head in args.head:  # another trained head (e.g. a parallel one), named by its kind
    entries.append(load_head_drafter(target, head, num_draft=k))
  samplings = {"greedy": sj.Sampling()}
  if args.temperature > 0:
    samplings["t0.7"] = sj.Sampling(temperature=args.temperature)
  load_before = os.getloadavg()
  began = time.perf_counter()
  # The real suite's own measurement: the costs of a target step, a verify and each drafter's
  # round (for the analytic bound and efficiency), then the calls, alternating prompt by prompt.
  measured = measure_suite(target, cases, entries, samplings=samplings,
                           max_new_tokens=args.max_new_tokens, eos=tuple(tokenizer.eos_ids),
                           repeats=args.repeats, log=lambda line: print(line, flush=True))
  records = measured["records"]
  summary = {}
  for row in measured["summary"]:
    if row["category"] != "all":
      continue
    calls = [r["calls"][row["drafter"]] for r in records if r["sampling"] == row["sampling"]]
    plain = sum(r["calls"]["generate"]["seconds"] for r in records
                if r["sampling"] == row["sampling"])
    seconds = sum(c["seconds"] for c in calls)
    item = dict(tau=row["tokens_per_round"], acceptance_per_token=row["acceptance_per_token"],
                speedup=row["speedup"], speedup_whole_calls=plain / seconds,
                speedup_excl_prefill=row["speedup_excl_prefill"], bound=row["bound"],
                efficiency=row["efficiency"], draft_ratio=row["draft_ratio"],
                verify_ratio=row["verify_ratio"], seconds=seconds, generate_seconds=plain,
                new_tokens=row["new_tokens"], rounds=sum(c["rounds"] for c in calls))
    if row["sampling"] == "greedy":
      item["identical_to_generate"] = sum(c["first_divergence_from_generate"] is None
                                          for c in calls)
      item["prompts"] = len(calls)
    summary[f"{row['drafter']}/{row['sampling']}"] = item
  result = dict(command="python -m benchmarks.dflash_smollm2 bench " + " ".join(
      f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("command",)),
      drafter=str(args.drafter), k=k, ddtree=dict(depth=tree.depth, width=tree.width,
                                                    num_nodes=tree.size),
      load_average_before=load_before, load_average_after=os.getloadavg(),
      wall_seconds=round(time.perf_counter() - began, 1), summary=summary,
      costs=measured["costs"], by_category=measured["summary"], records=records,
      train=json.loads((pathlib.Path(args.drafter).parent / "train.json").read_text())
      if (pathlib.Path(args.drafter).parent / "train.json").is_file() else None)
  out = pathlib.Path(args.json)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1, default=lambda v: v.tolist()
                            if isinstance(v, np.ndarray) else float(v)))
  for name, item in summary.items():
    print(f"{name:24s} a {item['acceptance_per_token']:.2f}  tau {item['tau']:.2f}  speedup "
          f"{item['speedup']:.2f}x  loop {item['speedup_excl_prefill']:.2f}x  bound "
          f"{item['bound']:.2f}x  efficiency {item['efficiency']:.2f}"
          + (f"  identical {item['identical_to_generate']}/{item['prompts']}"
             if "identical_to_generate" in item else ""))
  print(f"load average before {load_before}, after {os.getloadavg()}")
  del jax


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("data")
  p.add_argument("--out", required=True)
  p.add_argument("--conversations", type=int, default=256)
  p.add_argument("--batch-size", type=int, default=32)
  p.add_argument("--max-new-tokens", type=int, default=128)
  p.add_argument("--seed", type=int, default=0)
  p = sub.add_parser("train")
  p.add_argument("--data", required=True)
  p.add_argument("--out", required=True)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--block-size", type=int, default=8)
  p.add_argument("--mask-token-id", type=int, default=0)  # SmolLM2's <|endoftext|>
  p.add_argument("--rows", type=int, default=8)
  p.add_argument("--anchors", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=192)
  p.add_argument("--gamma", type=float, default=4.0)
  p.add_argument("--steps", type=int, default=3000)
  p.add_argument("--minutes", type=float, default=30.0)
  p.add_argument("--learning-rate", type=float, default=1e-3)
  p.add_argument("--seed", type=int, default=0)
  p = sub.add_parser("bench")
  p.add_argument("--drafter", required=True)
  p.add_argument("--json", required=True)
  p.add_argument("--per-category", type=int, default=2)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--k", type=int, default=4)
  p.add_argument("--width", type=int, default=3)
  p.add_argument("--nodes", type=int, default=12)
  p.add_argument("--temperature", type=float, default=0.7)
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--head", action="append", default=[],
                 help="another trained head's checkpoint directory (e.g. a parallel EAGLE head)")
  args = parser.parse_args(argv)
  {"data": data, "train": train, "bench": bench}[args.command](args)


if __name__ == "__main__":
  main()
