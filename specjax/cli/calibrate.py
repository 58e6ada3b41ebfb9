"""`specjax calibrate`: measure the cost table and the acceptance profile beside a checkpoint.

    specjax calibrate --out DIR [--target DIR --draft DIR|ngram] [--max-width 9] [--batch 1]

writes `DIR/cost_table_<backend>.json` and `DIR/acceptance_profile.json`
(`specjax.tuning.calibrate`), then prints what `specjax.drafters.adaptive.auto_num_draft` picks
from them (`specjax.adaptive_drafter` reads the same files). Heavy imports happen inside the
handler, so `specjax --help` stays instant.
"""

from __future__ import annotations

from specjax.cli.pair_args import CliError, add_pair_arguments, load_pair, sampling_from


def add_subcommand(subparsers):
  """Registers `calibrate` (called by `specjax.cli.main`)."""
  parser = subparsers.add_parser(
      "calibrate", help="measure the backend's cost table and the drafter's acceptance profile "
      "(for specjax.drafters.adaptive.auto_num_draft and specjax.adaptive_drafter)",
      description="Measure, on this backend, the target's forward cost over 1..W positions, the "
      "drafter's cost per draft step and one plain generate step (cost_table_<backend>.json), "
      "and the drafter's per-position acceptance on a few prompts (acceptance_profile.json); "
      "both go to --out, where specjax.drafters.adaptive.auto_num_draft(drafter, "
      "calibration=DIR) and specjax.adaptive_drafter(drafter, calibration=DIR) read them.")
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
  add_pair_arguments(parser)
  sampling = parser.add_argument_group("sampling of the acceptance profile")
  sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  sampling.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
  sampling.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
  sampling.add_argument("--seed", type=int, default=0, help="PRNG seed")
  parser.set_defaults(func=run)


def run(args) -> int:
  import pathlib

  from specjax.drafters import as_drafter
  from specjax.drafters.adaptive import costs
  from specjax.tuning.calibrate import measure_acceptance, measure_costs, profile_prompts

  if args.max_width < 2:
    raise CliError(f"--max-width must be >= 2, got {args.max_width}")
  sampling = sampling_from(args)
  target, draft, tokenizer = load_pair(args)
  drafter = as_drafter(draft)
  table = measure_costs(target, drafter, batch=args.batch, max_width=args.max_width,
                        context=args.context, repeats=args.repeats, sampling=sampling,
                        seed=args.seed)
  tokens, lengths = profile_prompts(tokenizer, args.prompt)
  profile = measure_acceptance(target, drafter, tokens, lengths, num_draft=args.max_width - 1,
                               sampling=sampling, max_new_tokens=args.max_new_tokens,
                               seed=args.seed)
  out = pathlib.Path(args.out)
  for path in (table.save(out), profile.save(out)):
    print(f"wrote {path}")
  choice = costs.auto_num_draft(drafter, costs.Calibration(table, profile))
  verify = ", ".join(f"{w}: {ms:.2f}" for w, ms in enumerate(table.verify_ms, 1))
  print(f"verify ms by width: {verify}; draft step {table.draft_step_ms:.2f} ms; generate step "
        f"{table.generate_step_ms:.2f} ms; per-round overhead {table.round_overhead_ms:.2f} ms")
  for name, part in (("alpha", profile), ("head alpha", profile.head),
                     ("lookup alpha", profile.lookup)):
    if part is not None:
      print(f"{name}: {', '.join(f'{a:.3f}' for a in part.alpha)}")
  print(f"specjax.drafters.adaptive.auto_num_draft picks k = {choice.num_draft} (widths "
        f"{choice.widths}): {choice.expected_tokens:.2f} tokens per {choice.round_ms:.2f} ms "
        f"round, predicted speedup {choice.speedup:.2f}x over generate")
  return 0
