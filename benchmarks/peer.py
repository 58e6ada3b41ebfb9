"""The `transformers` peer on the same weights: export, thread choice, four-way timing."""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.models import prompts_for
from benchmarks.timing import first_divergence, time_alternately
from specjax.loop.decode import decode
from specjax.loop.generate import generate
from specjax.core.sampling import Sampling


def fastest_torch_threads(model) -> tuple[int, dict]:
  """Sets torch's intra-op threads to whichever of (its default, 1) generates faster here.

  On a shared or oversubscribed CPU torch's spinning thread pool can be several times slower with
  all cores than with one; the peer gets its better setting.
  """
  import torch

  ids = torch.ones((1, 8), dtype=torch.long)
  probe = {}
  for threads in dict.fromkeys((torch.get_num_threads(), 1)):
    torch.set_num_threads(threads)
    best = float("inf")
    with torch.no_grad():
      for _ in range(3):
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                       do_sample=False)
        best = min(best, time.perf_counter() - start)
    probe[threads] = 16 / best
  chosen = max(probe, key=probe.get)
  torch.set_num_threads(chosen)
  return chosen, {str(k): v for k, v in probe.items()}


def run_peer(pair, settings, *, num_draft: int, workdir: str | None = None,
             log=print) -> dict:
  """specjax vs `transformers` on the same weights, batch 1, greedy, prompt by prompt.

  The pair is exported with `specjax.io.export_hf` and loaded with
  `LlamaForCausalLM.from_pretrained` in float32. Four calls per prompt are timed alternately:
  `transformers` greedy `generate`, its assisted generation (`assistant_model=`, the assistant's
  generation config set to `k` drafts, a constant schedule and no confidence cut-off, so both
  sides draft `k` per round), specjax
  `generate` and specjax `decode`. No EOS stop: each produces exactly `max_new_tokens` tokens.

  Returns:
    A record with tokens/s of each, each side's speculative speedup, the specjax/`transformers`
    ratio, and per prompt whether the four greedy streams are identical (first divergence).
  """
  import torch
  from transformers import LlamaForCausalLM

  from specjax.io.export_hf import export_hf

  target, draft, _, description = pair
  own_dir = workdir is None
  workdir = workdir or tempfile.mkdtemp(prefix="specjax_peer_")
  target_dir = export_hf(target.astype(jnp.float32), pathlib.Path(workdir) / "target",
                         overwrite=True)
  draft_dir = export_hf(draft.astype(jnp.float32), pathlib.Path(workdir) / "draft",
                        overwrite=True)
  hf_target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
  hf_draft = LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
  for model in (hf_target, hf_draft):
    model.generation_config.eos_token_id = None  # no EOS stop, as on the specjax side
    model.generation_config.pad_token_id = target.config.pad_id
  # transformers (5.x) takes the draft settings from the assistant's own generation config and
  # ignores them as `generate` keywords: exactly k drafts a round, as on the specjax side.
  hf_draft.generation_config.num_assistant_tokens = num_draft
  hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
  hf_draft.generation_config.assistant_confidence_threshold = 0.0
  new = settings.max_new_tokens
  greedy = Sampling()
  threads, thread_probe = fastest_torch_threads(hf_target)
  rng = jax.random.key(settings.seed)

  tokens, lengths = prompts_for(pair, dataclasses.replace(settings, peer_prompts=max(
      settings.peer_prompts, 1)), settings.peer_prompts)
  totals = {name: 0.0 for name in ("hf_generate", "hf_assisted", "specjax_generate",
                                   "specjax_decode")}
  compile_s = dict.fromkeys(totals, 0.0)
  prompts = []
  for row in range(tokens.shape[0]):
    ids, length = tokens[row:row + 1], lengths[row:row + 1]
    input_ids = torch.tensor(np.asarray(ids), dtype=torch.long)
    mask = torch.ones_like(input_ids)

    def hf_call(assisted):
      def call():
        kwargs = dict(assistant_model=hf_draft) if assisted else {}
        with torch.no_grad():
          out = hf_target.generate(input_ids, attention_mask=mask, max_new_tokens=new,
                                   do_sample=False, **kwargs)
        return np.asarray(out[0, input_ids.shape[1]:])
      return call

    calls = {
        "hf_generate": hf_call(False),
        "hf_assisted": hf_call(True),
        "specjax_generate": lambda: generate(target, ids, rng, lengths=length,
                                             max_new_tokens=new, sampling=greedy).tokens,
        "specjax_decode": lambda: decode(target, draft, ids, rng, lengths=length,
                                         max_new_tokens=new, num_draft=num_draft,
                                         sampling=greedy).tokens,
    }
    timed = time_alternately(calls, settings.repeats, settings.statistic)
    streams = {name: np.asarray(entry["result"]).reshape(-1) for name, entry in timed.items()}
    for name, entry in timed.items():
      totals[name] += entry["seconds"]
      compile_s[name] += entry["compile_s"]
    reference = streams["specjax_generate"]
    prompts.append({
        "row": row,
        "new_tokens": {name: int(s.size) for name, s in streams.items()},
        "first_divergence_from_specjax_generate": {
            name: first_divergence(reference, s) for name, s in streams.items()
            if name != "specjax_generate"},
    })
    log(f"  peer prompt {row}: " + ", ".join(
        f"{name} {new / timed[name]['seconds']:.1f} tok/s" for name in calls))
  produced = new * tokens.shape[0]
  speed = {name: produced / seconds for name, seconds in totals.items()}
  identical = all(all(d is None for d in p["first_divergence_from_specjax_generate"].values())
                  for p in prompts)
  if own_dir:
    import shutil
    shutil.rmtree(workdir, ignore_errors=True)
  return {
      "pair": description,
      "num_draft": num_draft,
      "batch": 1,
      "prompts": int(tokens.shape[0]),
      "prompt_tokens": int(tokens.shape[1]),
      "max_new_tokens": new,
      "torch_threads": threads,
      "torch_threads_probe_tokens_per_s": thread_probe,
      "tokens_per_s": speed,
      "compile_s": compile_s,
      "hf_speculative_speedup": speed["hf_assisted"] / speed["hf_generate"],
      "specjax_speculative_speedup": speed["specjax_decode"] / speed["specjax_generate"],
      "specjax_decode_over_hf_assisted": speed["specjax_decode"] / speed["hf_assisted"],
      "specjax_generate_over_hf_generate": speed["specjax_generate"] / speed["hf_generate"],
      "greedy_streams_identical": identical,
      "per_prompt": prompts,
  }
