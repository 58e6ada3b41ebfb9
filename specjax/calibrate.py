"""`specjax calibrate`: measure the cost table and the acceptance profile beside a checkpoint.

    specjax calibrate --out DIR [--target DIR --draft DIR|ngram] [--max-width 9] [--batch 1]

writes `DIR/cost_table_<backend>.json` (`specjax.costs.measure_costs`) and
`DIR/acceptance_profile.json` (`measure_acceptance`: greedy by default, or the given sampling),
then prints what `num_draft="auto"` would pick from them. Heavy imports happen inside the
handlers, so `specjax --help` stays instant.
"""

from __future__ import annotations

DEFAULT_PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef ", "class Stack:\n    def ",
                   "The capital of France is", "Once upon a time,", "for i in range(")


def measure_acceptance(target, drafter, tokens, lengths, *, num_draft: int, sampling,
                       max_new_tokens: int = 64, seed: int = 0):
  """The drafter's `AcceptanceProfile` over `num_draft` positions on the given prompts.

  A confidence stop, if the drafter has one, is switched off, so that every position is drafted
  and `alpha_j` is measured for every `j`.
  """
  import dataclasses

  import jax
  import numpy as np

  from specjax.costs import AcceptanceProfile
  from specjax.decode import decode
  from specjax.drafters import as_drafter

  drafter = as_drafter(drafter)
  if getattr(drafter, "confidence", None) is not None:
    drafter = dataclasses.replace(drafter, confidence=None)
  out = decode(target, drafter, tokens, jax.random.key(seed), lengths=lengths,
               max_new_tokens=max_new_tokens, num_draft=num_draft, sampling=sampling)
  return AcceptanceProfile.from_counts(
      int(np.sum(out.stats.rounds)), np.asarray(out.stats.accepted_per_position).sum(0),
      sampling=sampling, prompts=int(tokens.shape[0]))


def profile_prompts(tokenizer, prompts=None, count: int = 6):
  """`(tokens, lengths)` of the acceptance-profile prompts: the given texts; else, for a chat
  model (a tokenizer with a chat template), `count` conversations of the training templates
  (`specjax.training.prompts`, never the held-out benchmark prompts), chat-templated; else
  `DEFAULT_PROMPTS`."""
  import numpy as np

  if prompts or getattr(tokenizer, "chat_template", None) is None:
    return tokenizer.encode_batch(list(prompts or DEFAULT_PROMPTS))
  from specjax.training.prompts import training_conversations
  conversations = training_conversations(count * 50, seed=123)[::50]  # spread over templates
  rows = [tokenizer.apply_chat_template(c) for c in conversations]
  tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  return tokens, np.asarray([len(r) for r in rows], np.int32)


def add_subcommand(subparsers):
  """Registers `calibrate` (called by `specjax.cli`)."""
  from specjax import cli
  parser = subparsers.add_parser(
      "calibrate", help="measure the backend's cost table and the drafter's acceptance profile "
      "(for num_draft='auto')",
      description="Measure, on this backend, the target's forward cost over 1..W positions, the "
      "drafter's cost per draft step and one plain generate step (cost_table_<backend>.json), "
      "and the drafter's per-position acceptance on a few prompts (acceptance_profile.json); "
      "both go to --out, where specjax.decode(..., num_draft='auto', calibration=DIR) reads "
      "them.")
  parser.add_argument("--out", required=True, metavar="DIR",
                      help="where to write the JSON files (e.g. the checkpoint directory)")
  parser.add_argument("--max-width", type=int, default=9,
                      help="widest verify block timed; the profile covers max-width - 1 drafts")
  parser.add_argument("--batch", type=int, default=1, help="rows per timed forward")
  parser.add_argument("--context", type=int, default=64, help="prompt length of the timings")
  parser.add_argument("--repeats", type=int, default=5, help="timed calls per cost (best kept)")
  parser.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                      help="a profile prompt (repeatable; default: a few built-in ones)")
  parser.add_argument("--max-new-tokens", type=int, default=64,
                      help="tokens per prompt for the profile")
  cli._add_pair_arguments(parser)
  sampling = parser.add_argument_group("sampling of the acceptance profile")
  sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  sampling.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
  sampling.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
  sampling.add_argument("--seed", type=int, default=0, help="PRNG seed")
  parser.set_defaults(func=run)


def run(args) -> int:
  import pathlib

  from specjax import cli, costs
  from specjax.drafters import as_drafter

  if args.max_width < 2:
    raise cli.CliError(f"--max-width must be >= 2, got {args.max_width}")
  sampling = cli._sampling(args)
  target, draft, tokenizer = cli._load_pair(args)
  drafter = as_drafter(draft)
  table = costs.measure_costs(target, drafter, batch=args.batch, max_width=args.max_width,
                              context=args.context, repeats=args.repeats, sampling=sampling,
                              seed=args.seed)
  tokens, lengths = profile_prompts(tokenizer, args.prompt)
  profile = measure_acceptance(target, drafter, tokens, lengths, num_draft=args.max_width - 1,
                               sampling=sampling, max_new_tokens=args.max_new_tokens,
                               seed=args.seed)
  out = pathlib.Path(args.out)
  for path in (table.save(out), profile.save(out)):
    print(f"wrote {path}")
  choice = costs.choose_num_draft(table, profile, max_draft=getattr(drafter, "max_draft", None),
                                  confidence_stop=getattr(drafter, "confidence", None) is not None)
  verify = ", ".join(f"{w}: {ms:.2f}" for w, ms in enumerate(table.verify_ms, 1))
  print(f"verify ms by width: {verify}; draft step {table.draft_step_ms:.2f} ms; generate step "
        f"{table.generate_step_ms:.2f} ms")
  print(f"alpha: {', '.join(f'{a:.3f}' for a in profile.alpha)}")
  print(f"num_draft='auto' picks k = {choice.num_draft} (widths {choice.widths}): "
        f"{choice.expected_tokens:.2f} tokens per {choice.round_ms:.2f} ms round, predicted "
        f"speedup {choice.speedup:.2f}x over generate")
  return 0
