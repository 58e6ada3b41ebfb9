"""Grammar-constrained speculative decoding on a real pair: tool-call arguments from JSON schemas.

    python -m benchmarks.constrained [--pair qwen2.5-coder] [--phases tables validity speed]

Prompts: `benchmarks/prompts/tool_calls.json`, 25 tool schemas in the style of function-calling
APIs (nested objects, enums, arrays, string patterns, numbers), two requests each (50 pairs),
written for this benchmark. Each request asks the chat model for the call's JSON arguments; the
schema constrains them (`specjax.constrain.json_schema`).

Phases (results in `benchmarks/results/constrained_<pair>.json` after each, and a plot):

  * `tables`: every schema's automaton over the pair's tokenizer at the model's vocabulary:
    build seconds, states, transitions, device bytes (`Constraint.nbytes`);
  * `validity`: all 50 requests in ragged batches of 10 (each row its own schema), greedy and
    at T = 0.7 (top-k 50, top-p 0.9), by `decode(constraint=)`; every row must end with a stop id,
    and its text must parse as JSON and validate against its schema (`jsonschema`). The greedy
    tokens are compared with `generate(constraint=)`'s;
  * `speed`: one request (the first) of each of the first `--speed-tools` tools (12), batch 1,
    greedy and T = 0.7: `decode(constraint=)`
    against `generate(constraint=)`, and the same pair unconstrained (`decode` against
    `generate`) on the same prompts, each pair of calls alternating its order
    (`specjax.cli.demo.time_pairs`), summed over the prompts as the real suite sums them. Tau
    (emitted tokens per target pass), the free-token share (`stats.forced` / emitted) and the
    analytic bound's efficiency are recorded beside each speedup. The same calls with
    `max_new_tokens=1` time the prompt (prefill and first token), the same work in both modes and
    a large share of a short answer; the speedup past the prompt takes it out of both sides.

Timing is valid only on a quiet machine: the load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import time

import jax
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent
PROMPTS = ROOT / "prompts" / "tool_calls.json"
RESULTS = ROOT / "results"
SYSTEM = ("You call tools for the user. Reply with only the JSON object of the tool's arguments, "
          "nothing else.")
VALIDITY_TOKENS = 192
SPEED_TOKENS = 128
SAMPLED = dict(temperature=0.7, top_k=50, top_p=0.9)


def load_tools() -> list[dict]:
  return json.loads(PROMPTS.read_text())["tools"]


def messages(tool: dict, request: str) -> list[dict]:
  schema = json.dumps(tool["schema"], separators=(",", ":"))
  return [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": f"Tool `{tool['name']}`, arguments schema: {schema}\n\n"
                                      f"Request: {request}"}]


def batch(tokenizer, conversations) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded `[B, T]` prompt ids (T a multiple of 32) and their lengths."""
  ids = [tokenizer.apply_chat_template(c) for c in conversations]
  width = -(-max(len(i) for i in ids) // 32) * 32
  tokens = np.zeros((len(ids), width), np.int32)
  for row, i in enumerate(ids):
    tokens[row, :len(i)] = i
  return tokens, np.asarray([len(i) for i in ids], np.int32)


def check_rows(out, tokenizer, constraints, schemas) -> list[dict]:
  """Per row: ended with a stop id, parsed, validated (with the error where it did not)."""
  import jsonschema
  rows = []
  tokens, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)
  for row, (constraint, schema) in enumerate(zip(constraints, schemas)):
    ids = tokens[row, :counts[row]].tolist()
    ended = bool(ids) and ids[-1] in constraint.eos_ids
    text = tokenizer.decode(np.asarray(ids[:-1] if ended else ids, np.int32))
    record = dict(row=row, tokens=len(ids), ended=ended, text=text, parsed=False, valid=False)
    try:
      value = json.loads(text)
      record["parsed"] = True
      jsonschema.validate(value, schema)
      record["valid"] = True
    except (ValueError, jsonschema.ValidationError) as error:
      record["error"] = str(error).splitlines()[0][:200]
    rows.append(record)
  return rows


def suite_costs(pair, name: str) -> dict | None:
  """The real suite's measured step costs for this pair on this machine (target step, the draft
  model's round of `k` drafts, the `k + 1` verify), for the analytic bound; None where the suite
  has not run the pair."""
  path = RESULTS / "real_qwen" / "real_qwen2.5-coder-1.5b.json"
  if not path.exists() or name != "qwen2.5-coder":  # the suite's "draft-int8" drafter
    return None
  costs = json.loads(path.read_text())["costs"]
  verify = costs["verify_s"].get(str(pair.num_draft + 1))
  draft = costs["draft_round_s"].get("draft-int8")
  if verify is None or draft is None:
    return None
  return dict(source=str(path.relative_to(ROOT.parent)), target_step_s=costs["target_step_s"],
              draft_round_s=draft, verify_s=verify)


def load_average() -> list[float]:
  return [round(x, 2) for x in os.getloadavg()]


def phase_tables(tools, tokenizer, vocab_size) -> tuple[dict, list]:
  import specjax as sj
  records, constraints = [], []
  for tool in tools:
    start = time.perf_counter()
    constraint = sj.constrain.json_schema(tool["schema"], tokenizer, vocab_size=vocab_size)
    records.append(dict(tool=tool["name"], build_seconds=round(time.perf_counter() - start, 3),
                        states=constraint.num_states, transitions=constraint.num_transitions,
                        padded_states=constraint.tables.num_states,
                        token_classes=int(np.asarray(constraint.tables.classes).max()) + 1,
                        padded_classes=constraint.tables.num_classes,
                        nbytes=constraint.nbytes))
    constraints.append(constraint)
  nbytes = [r["nbytes"] for r in records]
  summary = dict(vocab_size=vocab_size, schemas=len(records), max_mib=max(nbytes) / 2**20,
                 median_mib=float(np.median(nbytes)) / 2**20,
                 within_64_mib=sum(b <= 64 * 2**20 for b in nbytes))
  return dict(summary=summary, schemas=records), constraints


def phase_validity(pair, tools, constraints, data: dict, save, rows_per_batch: int = 10,
                   settings=("greedy", "t0.7")) -> None:
  """All requests, in ragged batches of `rows_per_batch` rows (each row its own schema), greedy
  and at T = 0.7; per batch the greedy tokens are compared with `generate(constraint=)`'s.

  Results go to `data["validity"]`, saved after every batch (`save()`); a rerun skips the
  batches already there (same `rows_per_batch`)."""
  import specjax as sj
  target, draft, tokenizer = pair.target, pair.draft, pair.tokenizer
  conversations, row_constraints, schemas = [], [], []
  for tool, constraint in zip(tools, constraints):
    for request in tool["requests"]:
      conversations.append(messages(tool, request))
      row_constraints.append(constraint)
      schemas.append(tool["schema"])
  eos = tuple(tokenizer.eos_ids) or None
  out = data.setdefault("validity", {})
  for name, sampling in (("greedy", sj.Sampling()), ("t0.7", sj.Sampling(**SAMPLED))):
    if name not in settings:
      continue
    if out.get(name, {}).get("rows_per_batch") != rows_per_batch:
      out[name] = dict(rows_per_batch=rows_per_batch, batches={})
    record = out[name]
    for first in range(0, len(conversations), rows_per_batch):
      if str(first) in record["batches"]:
        continue
      part = slice(first, first + rows_per_batch)
      tokens, lengths = batch(tokenizer, conversations[part])
      start = time.perf_counter()
      got = sj.decode(target, draft, tokens, jax.random.key(first), lengths=lengths,
                      max_new_tokens=VALIDITY_TOKENS, num_draft=pair.num_draft,
                      sampling=sampling, eos_id=eos, constraint=row_constraints[part])
      jax.block_until_ready(got.tokens)
      seconds = time.perf_counter() - start
      checked = check_rows(got, tokenizer, row_constraints[part], schemas[part])
      for row in checked:
        row["row"] += first
      summary = got.stats.summary()
      done = dict(rows=checked, seconds=round(seconds, 1), load=load_average(),
                  **{key: summary[key] for key in ("emitted", "rounds", "forced",
                                                   "constraint_dead")})
      if sampling.greedy:
        want = sj.generate(target, tokens, jax.random.key(first), lengths=lengths,
                           max_new_tokens=VALIDITY_TOKENS, eos_id=eos,
                           constraint=row_constraints[part])
        done["identical_to_generate"] = bool(
            np.array_equal(np.asarray(got.tokens), np.asarray(want.tokens)))
      record["batches"][str(first)] = done
      save()
      print(f"validity {name} rows {first}..{first + len(checked) - 1}: "
            f"{sum(r['valid'] for r in checked)}/{len(checked)} valid", flush=True)
    batches = list(record["batches"].values())
    rows = [row for b in batches for row in b["rows"]]
    total = lambda key: int(sum(b[key] for b in batches))
    record.update(emitted=total("emitted"), rounds=total("rounds"), forced=total("forced"),
                  constraint_dead=total("constraint_dead"),
                  tau=total("emitted") / max(total("rounds"), 1),
                  ended=sum(r["ended"] for r in rows), parsed=sum(r["parsed"] for r in rows),
                  valid=sum(r["valid"] for r in rows), total=len(rows))
    if sampling.greedy:
      record["identical_to_generate"] = all(b["identical_to_generate"] for b in batches)
    save()
    print(f"validity {name}: {record['valid']}/{record['total']} valid, {record['ended']} ended",
          flush=True)


def phase_speed(pair, name_of_pair: str, tools, constraints, repeats: int,
                results: dict | None = None, save=lambda: None,
                names=("greedy", "t0.7")) -> dict:
  """Timed `decode` against `generate`, constrained and not, on each tool's first request."""
  import specjax as sj
  from specjax.cli.demo import time_pairs
  from benchmarks.bound import expected_tokens_per_round, per_token_acceptance
  target, draft, tokenizer = pair.target, pair.draft, pair.tokenizer
  eos = tuple(tokenizer.eos_ids) or None
  rng = jax.random.key(0)
  settings = (("greedy", sj.Sampling()), ("t0.7", sj.Sampling(**SAMPLED)))
  costs = suite_costs(pair, name_of_pair)
  results = {} if results is None else results
  results.update(load_before=load_average(), bound_costs=costs)
  for name, sampling in settings:
    if name not in names:
      continue
    for mode in ("constrained", "unconstrained"):
      totals = dict(decode=0.0, generate=0.0, prompt_decode=0.0, prompt_generate=0.0,
                    emitted=0, rounds=0, forced=0, accepted=0, drafted=0)
      positions = np.zeros(pair.num_draft, np.int64)
      per_prompt, index = [], 0
      for tool, constraint in zip(tools, constraints):
        tokens, lengths = batch(tokenizer, [messages(tool, tool["requests"][0])])
        extra = dict(constraint=constraint) if mode == "constrained" else {}
        common = dict(lengths=lengths, max_new_tokens=SPEED_TOKENS, sampling=sampling,
                      eos_id=eos, **extra)
        calls = {"decode": lambda: sj.decode(target, draft, tokens, rng,
                                             num_draft=pair.num_draft, **common),
                 "generate": lambda: sj.generate(target, tokens, rng, **common)}
        first = dict(common, max_new_tokens=1)  # the prompt's cost: prefill and first token
        prompt_calls = {"decode": lambda: sj.decode(target, draft, tokens, rng,
                                                    num_draft=pair.num_draft, **first),
                        "generate": lambda: sj.generate(target, tokens, rng, **first)}
        for call in (*calls.values(), *prompt_calls.values()):  # compile outside the timing
          jax.block_until_ready(call())
        timed = time_pairs(calls, repeats, first=index)
        prompt = time_pairs(prompt_calls, repeats, first=index)
        index += repeats
        stats = timed["results"]["decode"].stats.summary()
        decode_s, generate_s = float(np.sum(timed["decode"])), float(np.sum(timed["generate"]))
        prompt_decode_s = float(np.sum(prompt["decode"]))
        prompt_generate_s = float(np.sum(prompt["generate"]))
        totals["decode"] += decode_s
        totals["generate"] += generate_s
        totals["prompt_decode"] += prompt_decode_s
        totals["prompt_generate"] += prompt_generate_s
        for key in ("emitted", "rounds", "forced", "accepted", "drafted"):
          totals[key] += stats[key]
        positions += np.asarray(stats["accepted_per_position"], np.int64)
        per_prompt.append(dict(tool=tool["name"], decode_s=round(decode_s, 3),
                               generate_s=round(generate_s, 3),
                               prompt_decode_s=round(prompt_decode_s, 3),
                               prompt_generate_s=round(prompt_generate_s, 3),
                               prompt_tokens=int(lengths[0]), emitted=stats["emitted"],
                               rounds=stats["rounds"], forced=stats["forced"]))
      acceptance = per_token_acceptance(positions.tolist(), totals["rounds"])
      bound = None
      if costs is not None:  # tokens per round / (a round's drafting + verify, in target steps)
        bound = expected_tokens_per_round(acceptance, pair.num_draft) * costs["target_step_s"] / (
            costs["draft_round_s"] + costs["verify_s"])
      record = dict(
          speedup=totals["generate"] / totals["decode"],
          per_token_acceptance=acceptance, bound=bound,
          efficiency=None if bound is None else totals["generate"] / totals["decode"] / bound,
          tau=totals["emitted"] / max(totals["rounds"], 1),
          free_share=totals["forced"] / max(totals["emitted"], 1),
          acceptance_rate=totals["accepted"] / max(totals["drafted"], 1),
          decode_s=round(totals["decode"], 2), generate_s=round(totals["generate"], 2),
          tokens=totals["emitted"], per_prompt=per_prompt)
      # The prompt is the same work in both modes and a large share of short answers; past it,
      # seconds per token. `generate` with one new token is the prompt and the first token, so
      # past it each further token costs (generate - that) / (tokens - 1). `decode` with one
      # new token is the prompt and one round (emitting one token), so past it a round costs
      # (decode - that) / (rounds - 1) and a token that over tau.
      per_round = (totals["decode"] - totals["prompt_decode"]) / max(
          totals["rounds"] - len(tools), 1)
      decode_per_token = per_round / record["tau"]
      generate_per_token = (totals["generate"] - totals["prompt_generate"]) / max(
          totals["emitted"] - len(tools), 1)
      after = generate_per_token / decode_per_token
      record.update(prompt_decode_s=round(totals["prompt_decode"], 2),
                    prompt_generate_s=round(totals["prompt_generate"], 2),
                    decode_round_s=per_round,
                    decode_s_per_token_after_prompt=decode_per_token,
                    generate_s_per_token_after_prompt=generate_per_token,
                    speedup_after_prompt=after,
                    efficiency_after_prompt=None if bound is None else after / bound)
      record["load_after"] = load_average()
      results[f"{name}/{mode}"] = record
      save()
      print(f"speed {name} {mode}: {record['speedup']:.2f}x, past the prompt "
            f"{record['speedup_after_prompt']:.2f}x "
            f"({record['decode_s_per_token_after_prompt'] * 1e3:.0f} ms/token), tau "
            f"{record['tau']:.2f}, free {record['free_share']:.1%}, bound {bound}", flush=True)
  results["load_after"] = load_average()
  return results


def plot(data: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  speed = data.get("speed")
  tables = data.get("tables")
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  if speed:
    names = [k for k in speed if "/" in k]
    x = np.arange(len(names))
    axes[0].bar(x - 0.2, [speed[k]["speedup"] for k in names], 0.4, label="whole call",
                color=["tab:blue" if "/constrained" in k else "tab:gray" for k in names])
    after = [speed[k].get("speedup_after_prompt") for k in names]
    if all(a is not None for a in after):
      axes[0].bar(x + 0.2, after, 0.4, label="past the prompt", hatch="//",
                  color=["tab:blue" if "/constrained" in k else "tab:gray" for k in names])
      axes[0].legend(fontsize=8)
    for i, k in enumerate(names):
      top = max(speed[k]["speedup"], after[i] or 0)
      axes[0].text(i, top, f"tau {speed[k]['tau']:.2f}\nfree "
                   f"{speed[k]['free_share']:.0%}", ha="center", va="bottom", fontsize=8)
    axes[0].set_xticks(x, [k.replace("/", "\n") for k in names], fontsize=8)
    axes[0].set_ylabel("speedup over generate (same constraint)")
    axes[0].set_title(f"{data['pair']}: tool-call arguments, CPU, load {speed['load_before']}",
                      fontsize=9)
  if tables:
    mib = [r["nbytes"] / 2**20 for r in tables["schemas"]]
    axes[1].bar(range(len(mib)), mib)
    axes[1].axhline(64, color="tab:red", linestyle="--", label="64 MiB")
    axes[1].set_ylabel("tables on device (MiB)")
    axes[1].set_xlabel(f"schema (V = {tables['summary']['vocab_size']:,})")
    axes[1].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv=None) -> None:
  import specjax as sj
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--pair", default="qwen2.5-coder")
  parser.add_argument("--phases", nargs="+", default=["tables", "validity", "speed"])
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--speed-tools", type=int, default=12)
  parser.add_argument("--validity-batch", type=int, default=10,
                      help="rows per ragged batch in the validity phase")
  parser.add_argument("--validity-settings", nargs="+", default=["greedy", "t0.7"])
  parser.add_argument("--speed-settings", nargs="+", default=["greedy", "t0.7"],
                      help="a subset reruns those settings into the saved speed results")
  args = parser.parse_args(argv)
  path = RESULTS / f"constrained_{args.pair}.json"
  data = json.loads(path.read_text()) if path.exists() else {}
  data.update(pair=args.pair, updated=datetime.datetime.now(datetime.timezone.utc).isoformat(
      timespec="seconds"), jax=jax.__version__)
  pair = sj.load_pair(args.pair)
  tools = load_tools()
  if not {"tables", "validity"} & set(args.phases):  # the speed phase needs only its own
    tools = tools[:args.speed_tools]
  tables, constraints = phase_tables(tools, pair.tokenizer, pair.target.vocab_size)
  if "tables" in args.phases:
    data["tables"] = tables
    print("tables:", tables["summary"], flush=True)
  save = lambda: path.write_text(json.dumps(data, indent=1) + "\n")
  save()
  if "validity" in args.phases:
    phase_validity(pair, tools, constraints, data, save, args.validity_batch,
                   args.validity_settings)
  if "speed" in args.phases:
    subset = sorted(args.speed_settings) != ["greedy", "t0.7"]
    data["speed"] = (data.get("speed") or {}) if subset else {}
    phase_speed(pair, args.pair, tools[:args.speed_tools], constraints[:args.speed_tools],
                args.repeats, data["speed"], save, args.speed_settings)
    save()
  plot(data, path.with_suffix(".png"))


if __name__ == "__main__":
  main()
