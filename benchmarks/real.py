"""`specjax bench --suite real`: pretrained models on the project's own prompts, every drafter.

For each prompt of `benchmarks/prompts/real.json` (Spec-Bench's categories, written for this
benchmark and never used for training), chat-templated with the model's own template, at batch 1
and stopping at the model's own EOS ids:

* `specjax.generate` and `specjax.decode` with each drafter of the library (a drafter is
  one `DrafterEntry` of `library_drafters`), timed alternately in one process (the order flips from
  prompt to prompt), greedy and one sampled setting, same prompt, same `max_new_tokens`, same key;
* acceptance `a` per token (from `accepted_per_position`), tokens per round `tau`, the speedup
  (greedy: decode tokens/s over generate tokens/s, the same text, summed over the prompts:
  time-weighted; sampled: generate's ms per token over decode's, each over its own emitted
  tokens, mean over the prompts: `benchmarks.real_summary`), the analytic bound from the measured
  `a`, `k` and the measured cost of a `(k + 1)`-token verify over one target step (and the
  drafter's step, for drafters with a forward of their own), and efficiency = speedup / bound;
  per category and overall. A tree drafter's (`DrafterEntry.tree`) bound
  is its measured tau over a round priced at its full node budget (the verify runs narrower
  where the round's trees are smaller);
* the same prompt ids through `transformers` on the same weights: plain greedy `generate` and
  `prompt_lookup_num_tokens=k`, with its tokens/s beside specjax's.

Prompts are padded to a multiple of 32 tokens (one compile per width; both calls pay the same
prefill). Writes `real.json`, `real_speedup.png`, `real_peer.png` and `real_table.md`.
The summary (the rows of the JSON and the tables) is `benchmarks.real_summary`. `json_default`
encodes the NumPy values of this suite's JSON and of the others' (`benchmarks.suites`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.drafters import (CORPUS, DrafterEntry, base_names, library_drafters,
                                 with_adaptive, with_corpus)
from specjax.core.sequence import padded_prompt, prompt_width
from specjax.drafters import as_drafter
from specjax.drafters.adaptive.drafter import AdaptiveDrafter
from benchmarks.models import environment
from benchmarks.real_summary import summarize
from benchmarks.timing import first_divergence, measure_costs, time_alternately

PROMPTS_DIR = pathlib.Path(__file__).resolve().parent / "prompts"
PROMPTS_FILE = PROMPTS_DIR / "real.json"


@dataclasses.dataclass(frozen=True)
class PromptCase:
  """One chat-templated prompt."""

  category: str
  id: str
  ids: tuple[int, ...]


def load_prompts(path: pathlib.Path = PROMPTS_FILE, *, categories=(), per_category: int = 6):
  """`{category: [messages, ...]}` from the prompt file, the first `per_category` of each."""
  data = json.loads(pathlib.Path(path).read_text())
  known = data["categories"]
  unknown = [c for c in categories if c not in known]
  if unknown:
    raise ValueError(f"unknown categories {unknown}; the prompt file has {', '.join(known)}")
  if per_category < 1:
    raise ValueError(f"prompts per category must be >= 1, got {per_category}")
  chosen = categories or tuple(known)
  return {c: known[c][:per_category] for c in chosen}


def history_corpus(target, tokenizer, prompt_file, template, prompts, *, eos, max_new_tokens,
                   log=print):
  """The `suffix+corpus` drafter's corpus: the target's greedy answers to the prompt file's
  `history` conversations of the chosen categories (earlier requests of the same kind, never a
  timed prompt), generated before any timed call."""
  import specjax as sj
  from specjax.drafters import SuffixCorpus
  from benchmarks.real_models import chat_ids

  history = json.loads(pathlib.Path(prompt_file).read_text()).get("history", {})
  conversations = [h["messages"] for category in prompts for h in history.get(category, [])]
  if not conversations:
    raise ValueError(f"{prompt_file} has no history conversations for {list(prompts)}: the "
                     "suffix+corpus drafter needs earlier answers")
  answers = []
  for messages in conversations:
    case = PromptCase("history", "history", tuple(chat_ids(tokenizer, messages, template)))
    tokens, lengths = _padded(case, 0)
    out = sj.generate(target, tokens, jax.random.key(0), lengths=lengths,
                      max_new_tokens=max_new_tokens, eos_id=eos)
    answers.append(np.asarray(out.tokens[0, :int(out.num_tokens[0])]))
  log(f"suffix corpus: {len(answers)} earlier answers, {sum(map(len, answers))} tokens")
  return SuffixCorpus.from_sequences(answers, capacity=max(4096, 2 * sum(map(len, answers))))


def _bucket(length: int) -> int:
  """The padded prompt width: the next multiple of 32 (one compile per width; a power of two
  made a 146-token prompt's prefill, which both calls pay, a 256-token one)."""
  return prompt_width(length, 32)


def _padded(case: PromptCase, pad_id: int):
  tokens, lengths = padded_prompt(case.ids, 32, pad_id)
  return jnp.asarray(tokens), jnp.asarray(lengths)


def _specjax_calls(target, drafters, tokens, lengths, rng, sampling, max_new_tokens, eos):
  import specjax as sj
  calls = {"generate": lambda: sj.generate(target, tokens, rng, lengths=lengths,
                                           max_new_tokens=max_new_tokens, sampling=sampling,
                                           eos_id=eos)}
  for entry in drafters:
    calls[entry.name] = (lambda e: lambda: sj.decode(
        target, e.drafter, tokens, rng, lengths=lengths, max_new_tokens=max_new_tokens,
        sampling=sampling, eos_id=eos, **e.decode_kwargs()))(entry)
  return calls


def _ordered(calls: dict, flip: bool) -> dict:
  return dict(reversed(list(calls.items()))) if flip else calls


def measure_prompts(target, cases: list[PromptCase], drafters: list[DrafterEntry], *,
                    samplings: dict, max_new_tokens: int, eos: tuple[int, ...], repeats: int = 1,
                    seed: int = 0, statistic: str = "min", log=print) -> list[dict]:
  """specjax `generate` vs `decode` (each drafter), prompt by prompt, for each sampling.

  Returns:
    One record per (sampling, prompt): per call `seconds`, `new_tokens`; per drafter its stats
    (`rounds`, `accepted`, `accepted_per_position`) and, greedy, whether its tokens equal
    `generate`'s.
  """
  pad_id = target.config.pad_id
  warm = None  # the (sampling, width) whose programs are compiled
  records = []
  # Prompts of one width run together and each new width drops the compiled programs of the
  # last: every compiled program holds its own mappings of JIT code, and a suite of tree drafters
  # over several widths and samplings ran past the kernel's map limit (vm.max_map_count 65530;
  # LLVM: "Cannot allocate memory"). Records keep the prompts' order.
  order = sorted(range(len(cases)), key=lambda i: _bucket(len(cases[i].ids)))
  for sampling_name, sampling in samplings.items():
    by_index = {}
    for index in order:
      case = cases[index]
      tokens, lengths = _padded(case, pad_id)
      rng = jax.random.key(seed + index)
      calls = _specjax_calls(target, drafters, tokens, lengths, rng, sampling, max_new_tokens,
                             eos)
      # The prefill both calls pay is timed beside them, in the same alternation, so that the
      # machine's drift hits it as it hits them (timed apart, it could exceed a short call).
      calls["prefill"] = _prefill_call(target, tokens, max_new_tokens)
      shape = (sampling_name, tokens.shape[1])
      if shape != warm:  # compile each call once per prompt width, untimed
        jax.clear_caches()
        warm = shape
        for call in calls.values():
          jax.block_until_ready(call())
      timed = time_alternately(_ordered(calls, index % 2 == 1), repeats, statistic,
                               warmup=False)
      prefill_s = timed.pop("prefill")["seconds"]
      plain = timed["generate"]["result"]
      plain_tokens = np.asarray(plain.tokens[0, :int(plain.num_tokens[0])])
      record = {"sampling": sampling_name, "category": case.category, "id": case.id,
                "prompt_tokens": len(case.ids), "width": int(tokens.shape[1]),
                "prefill_s": prefill_s, "calls": {}}
      for name, entry in timed.items():
        out = entry["result"]
        call = {"seconds": entry["seconds"], "times_s": entry["times_s"],
                "new_tokens": int(out.num_tokens[0])}
        if name != "generate":
          stats = out.stats.summary()
          call.update(rounds=stats["rounds"], accepted=stats["accepted"],
                      accepted_per_position=stats["accepted_per_position"])
          if sampling_name == "greedy":
            call["first_divergence_from_generate"] = first_divergence(
                plain_tokens, np.asarray(out.tokens[0, :int(out.num_tokens[0])]))
        record["calls"][name] = call
      record["generate_tokens"] = plain_tokens.tolist() if sampling_name == "greedy" else None
      by_index[index] = record
      log(f"  {sampling_name:7s} {case.id:16s} " + ", ".join(
          f"{n} {c['new_tokens'] / c['seconds']:.1f} tok/s" for n, c in record["calls"].items()))
    records += [by_index[index] for index in range(len(cases))]
  return records


def measure_peer(peer_model, cases: list[PromptCase], *, num_draft: int, max_new_tokens: int,
                 eos: tuple[int, ...], pad_id: int, repeats: int = 1, statistic: str = "min",
                 log=print) -> list[dict]:
  """`transformers` greedy `generate` and `prompt_lookup_num_tokens=k`, prompt by prompt."""
  import torch

  from benchmarks.peer import fastest_torch_threads

  fastest_torch_threads(peer_model)
  records = []
  for index, case in enumerate(cases):
    input_ids = torch.tensor([list(case.ids)], dtype=torch.long)

    def call(lookup):
      def run():
        kwargs = dict(prompt_lookup_num_tokens=num_draft) if lookup else {}
        with torch.no_grad():
          out = peer_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=list(eos), pad_token_id=pad_id, **kwargs)
        return out[0, input_ids.shape[1]:].numpy()
      return run

    calls = {"hf_generate": call(False), "hf_prompt_lookup": call(True)}
    timed = time_alternately(_ordered(calls, index % 2 == 1), repeats, statistic,
                             warmup=index == 0)
    record = {"category": case.category, "id": case.id, "calls": {
        name: {"seconds": e["seconds"], "times_s": e["times_s"],
               "new_tokens": int(len(e["result"])), "tokens": e["result"].tolist()}
        for name, e in timed.items()}}
    records.append(record)
    log(f"  peer    {case.id:16s} " + ", ".join(
        f"{n} {c['new_tokens'] / c['seconds']:.1f} tok/s" for n, c in record["calls"].items()))
  return records


@jax.jit
def _prefill(model, tokens, cache):
  # As `generate` and `decode` run it: the output projection reads only the last prompt row.
  last = jnp.full((tokens.shape[0], 1), tokens.shape[1] - 1, jnp.int32)
  return model(tokens, jnp.zeros((tokens.shape[0],), jnp.int32), cache, logits_at=last).logits


def _prefill_call(target, tokens, max_new_tokens: int):
  """A zero-argument call: one target forward over the padded prompt on a fresh cache, scoring
  one row (as the loops' prefill does: `logits_at`)."""
  from specjax.loop.generate import NEW_TOKEN_BUCKET
  from specjax.core.validation import round_up
  buffer_len = tokens.shape[1] + round_up(max_new_tokens, NEW_TOKEN_BUCKET)
  cache = target.init_cache(tokens.shape[0], buffer_len)
  return lambda: _prefill(target, tokens, cache)


def measure_suite(target, cases, drafters, *, samplings, max_new_tokens, eos, repeats=1, seed=0,
                  statistic="min", peer_model=None, log=print) -> dict:
  """The suite on any target (a real one, or a tiny random one in the tests); no files."""
  widths = sorted(_bucket(len(c.ids)) for c in cases)
  width = widths[len(widths) // 2]
  num_drafts = tuple(sorted({e.verify_k for e in drafters}))
  from specjax.core.validation import round_up
  from specjax.loop.generate import NEW_TOKEN_BUCKET
  costs = measure_costs(target, None, batch=1,
                        buffer_len=width + round_up(max_new_tokens, NEW_TOKEN_BUCKET)
                        + max(num_drafts) + 1,
                        position=int(np.median([len(c.ids) for c in cases])) + max_new_tokens // 2,
                        num_drafts=num_drafts, repeats=5, statistic=statistic)
  from benchmarks.drafter_cost import draft_round_seconds
  costs["draft_round_s"] = {}
  probe = min(cases, key=lambda c: abs(_bucket(len(c.ids)) - width))
  tokens, lengths = _padded(probe, target.config.pad_id)
  for entry in drafters:
    # An adaptive entry's round is priced as its inner drafter's fixed-K chain.
    drafter = as_drafter(entry.drafter.drafter if isinstance(entry.drafter, AdaptiveDrafter)
                         else entry.round_drafter(target))
    # The buffer the loop allocates (`specjax.loop.state.init_state`): the new tokens' bucket and
    # the scratch slots one round writes.
    costs["draft_round_s"][entry.name] = draft_round_seconds(
        target, drafter, tokens, lengths,
        buffer_len=width + round_up(max_new_tokens, NEW_TOKEN_BUCKET)
        + drafter.extra_slots(entry.verify_k),
        num_draft=entry.num_draft, sampling=next(iter(samplings.values())),
        statistic=statistic)
  log(f"costs: target step {costs['target_step_s'] * 1e3:.1f} ms, verify " + ", ".join(
      f"k={k} {s * 1e3:.1f} ms" for k, s in costs["verify_s"].items()) + "; drafting per round "
      + ", ".join(f"{n} {s * 1e3:.2f} ms" for n, s in costs["draft_round_s"].items()))
  records = measure_prompts(target, cases, drafters, samplings=samplings,
                            max_new_tokens=max_new_tokens, eos=eos, repeats=repeats, seed=seed,
                            statistic=statistic, log=log)
  peer_records = None
  if peer_model is not None:
    peer_records = measure_peer(peer_model, cases, num_draft=num_drafts[0],
                                max_new_tokens=max_new_tokens, eos=eos,
                                pad_id=target.config.pad_id, repeats=repeats,
                                statistic=statistic, log=log)
    for record, peer in zip([r for r in records if r["sampling"] == "greedy"], peer_records):
      peer["first_divergence_from_specjax_generate"] = {
          name: first_divergence(record["generate_tokens"], call["tokens"])
          for name, call in peer["calls"].items()}
  return {"costs": costs, "records": records, "peer_records": peer_records,
          "summary": summarize(records, drafters, costs, peer_records),
          "drafters": [{"name": e.name, "num_draft": e.num_draft, "draft_ratio": e.draft_ratio,
                        "description": e.description,
                        "tree": None if e.tree is None else dataclasses.asdict(e.tree)}
                       for e in drafters]}


def _samplings(temperatures) -> dict:
  import specjax as sj
  out = {}
  for t in temperatures:
    out["greedy" if t == 0 else f"T={t:g}"] = sj.Sampling(temperature=float(t))
  return out


def shipped_vocab(model, target, names, log):
  """The draft vocabulary shipped for `model` (a `RealModel`) where a `+vocab` drafter is asked
  for and its file has the suite's size (`draft_vocab_size`), else None (the suite counts it)."""
  from benchmarks.drafters import draft_vocab_size
  if model.draft_vocab is None or not any(n.endswith("+vocab") for n in base_names(names)):
    return None
  from specjax.pretrained.pairs import shipped_draft_vocab
  ids = shipped_draft_vocab(model.draft_vocab, target.config.vocab_size)
  if len(ids) != draft_vocab_size(target.config.vocab_size):
    return None
  log(f"draft vocabulary: the shipped draft_vocab/{model.draft_vocab}.json ({len(ids)} ids, made "
      "by frequent_vocab as the suite counts it)")
  return ids


def _draft_models(model_name: str, names) -> dict:
  """`{name: (ModelDrafter, description)}`: the model's separate draft model at each width of
  `DRAFT_MODELS` that `names` asks for (every width where `names` is empty; `+vocab` needs
  int8's), or {} where the model has none."""
  from benchmarks.drafters import DRAFT_MODEL, DRAFT_MODEL_FP8, DRAFT_MODELS, FP8_CACHE
  from benchmarks.real_models import REAL_MODELS, load_draft_model
  model = REAL_MODELS[model_name]
  if model.draft is None:
    return {}
  asked = set(base_names(names))
  widths = {8: "int8 per 128", 4: "asymmetric int4 per 32 (output projection included)"}
  built = {}
  for name, bits in DRAFT_MODELS.items():
    if not asked or name in asked or (bits == 8 and (name + "+vocab" in asked
                                                      or DRAFT_MODEL_FP8 in asked)):
      built[name] = (load_draft_model(model_name, bits),
                     f"{model.draft_description}, quantized to {widths[bits]}")
  if DRAFT_MODEL_FP8 in asked:
    drafter, description = built[DRAFT_MODEL]
    built[DRAFT_MODEL_FP8] = (dataclasses.replace(drafter, cache_dtype=FP8_CACHE),
                              f"{description}, its KV cache in {FP8_CACHE}")
  return built


def run_real(settings, out: pathlib.Path, *, plots: bool = True, log=print) -> dict:
  """Loads the model, runs `measure_suite` on the prompt file, writes JSON, PNGs and the table."""
  from benchmarks.real_models import (REAL_MODELS, chat_ids, chat_template, gguf_path,
                                      load_peer, load_specjax, load_tokenizer)

  model_name = settings.model
  if model_name not in REAL_MODELS:
    raise ValueError(f"--suite real takes --model {' or '.join(REAL_MODELS)}, got {model_name!r}")
  if len(settings.num_drafts) != 1:  # every drafter runs at one k: a second one would be ignored
    raise ValueError(f"--suite real runs one draft length per run (e.g. --k 6), got --k "
                     f"{','.join(map(str, settings.num_drafts))}: run it once per k")
  start, cpu_start = time.perf_counter(), time.process_time()
  out.mkdir(parents=True, exist_ok=True)
  path = gguf_path(model_name)
  log(f"{REAL_MODELS[model_name].description}: {path}")
  import specjax as sj
  # transformers' model only where it runs (or converts the weights): a 1.5B in float32 is 6 GB.
  peer_model, peer_tokenizer = load_peer(path, with_model=settings.peer
                                         or not hasattr(sj, "from_gguf"))
  # In the layout `decode` and `generate` run fastest in on this backend, as `specjax demo` and
  # `load_pair` load it; the drafters below (the quantized self-drafts) inherit it.
  target, how = load_specjax(path, peer_model)
  draft_models = _draft_models(model_name, settings.drafters)
  tokenizer = load_tokenizer(path)
  eos = tuple(int(i) for i in tokenizer.eos_ids)
  loaded_s = time.perf_counter() - start
  log(f"loaded in {loaded_s:.0f}s ({how}); {target.config.num_params() / 1e6:.0f}M params, "
      f"EOS ids {eos}")
  prompt_file = PROMPTS_DIR / f"{settings.prompt_set}.json"
  prompts = load_prompts(prompt_file, categories=settings.categories,
                         per_category=settings.prompts_per_category)
  template, template_source = chat_template(tokenizer, target.config.family)
  cases = [PromptCase(category, p["id"], tuple(chat_ids(tokenizer, p["messages"], template)))
           for category, items in prompts.items() for p in items]
  conversations = [p["messages"] for items in prompts.values() for p in items]
  template_mismatch = [case.id for case, messages in zip(cases, conversations)
                       if list(case.ids) != chat_ids(peer_tokenizer, messages, template)]
  if template_mismatch:
    log(f"WARNING: transformers' chat template gives other ids for {template_mismatch}")
  vocab_ids = shipped_vocab(REAL_MODELS[model_name], target, settings.drafters, log)
  drafters = library_drafters(target, num_draft=settings.num_drafts[0],
                              names=base_names(settings.drafters), heads=settings.heads,
                              tokenizer=tokenizer, log=log, vocab_ids=vocab_ids,
                              draft_model=draft_models)
  drafters = with_adaptive(target, tokenizer, drafters, settings.drafters,
                           calibration=settings.calibration, log=log)
  if any(entry.name.endswith(CORPUS) for entry in drafters):
    corpus = history_corpus(target, tokenizer, prompt_file, template, prompts, eos=eos,
                            max_new_tokens=settings.max_new_tokens, log=log)
    drafters = [with_corpus(entry, corpus) if entry.name.endswith(CORPUS) else entry
                for entry in drafters]
  measured = measure_suite(target, cases, drafters, samplings=_samplings(settings.temperatures),
                           max_new_tokens=settings.max_new_tokens, eos=eos,
                           repeats=settings.repeats, seed=settings.seed,
                           statistic=settings.statistic,
                           peer_model=peer_model if settings.peer else None, log=log)
  result = {
      "suite": "real", "model": model_name, "model_description": REAL_MODELS[model_name].description,
      "gguf_file": path.name, "loaded_with": how, "dtype": "float32", "eos_ids": list(eos),
      "chat_template": template_source, "chat_ids_differ_from_transformers": template_mismatch,
      "settings": {"max_new_tokens": settings.max_new_tokens, "batch": 1,
                   "prompts_per_category": settings.prompts_per_category,
                   "categories": list(prompts), "prompts": len(cases),
                   "temperatures": list(settings.temperatures), "repeats": settings.repeats,
                   "statistic": settings.statistic, "seed": settings.seed,
                   "prompt_file": str(prompt_file.relative_to(PROMPTS_DIR.parents[1])),
                   "prompt_widths": "padded to a multiple of 32 (one compile per width)"},
      "environment": environment(), "load_s": loaded_s, **measured, "files": []}
  result["wall_s"] = time.perf_counter() - start
  result["process_cpu_s"] = time.process_time() - cpu_start
  stem = "real" if model_name == "smollm2-135m" else f"real_{model_name}"
  if plots:
    from benchmarks.plots import plot_real
    result["files"] += plot_real(result, out, stem)
  from benchmarks.report import real_table
  result["files"] += [f"{stem}_table.md", f"{stem}.json"]
  (out / f"{stem}_table.md").write_text(real_table(result))
  (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=json_default) + "\n")
  log(f"wrote {', '.join(result['files'])} to {out} in {result['wall_s']:.0f}s")
  return result


def json_default(value):
  """`json.dumps(default=...)` for NumPy scalars and arrays."""
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (np.floating,)):
    return float(value)
  if isinstance(value, np.ndarray):
    return value.tolist()
  raise TypeError(f"not JSON-serialisable: {type(value).__name__}")
