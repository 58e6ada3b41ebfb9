"""Constrained generation of tool-call arguments: transformers + outlines beside specjax.

    pip install outlines==1.3.3   # the peer; not in any extra
    python -m benchmarks.constrained_peer [--tools 12] [--new 128]

The same model (Qwen2.5-Coder-1.5B-Instruct, its Q4_K_M GGUF dequantized to float32 on both
sides), the same chat-templated requests and schemas (`benchmarks/prompts/tool_calls.json`, the
first request of each of the first `--tools` tools, as `benchmarks.constrained`'s speed phase),
greedy, batch 1, stopping at the end of the JSON:

  * outlines: `outlines.from_transformers(model, tokenizer)` and `outlines.Generator(model,
    JsonSchema(schema))`, transformers' greedy `generate` with outlines' logits processor; torch
    threads the faster of its default and 1 (`benchmarks.peer.fastest_torch_threads`);
  * specjax: `sj.generate(constraint=)` and `sj.decode(constraint=)` with the 0.5B int8 draft.

Each side is timed per request (one untimed call first, then one timed call); the figure is
generated tokens (without the stop token) per second of wall time. Both sides' texts are checked
against the schema with `jsonschema`, and the greedy texts compared. Results:
`benchmarks/results/constrained_peer.json`. Timing is valid only on a quiet machine: the load
average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import jax
import numpy as np

from benchmarks.constrained import SPEED_TOKENS, batch, load_tools, messages

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def run_specjax(tools, requests, new: int) -> list[dict]:
  import specjax as sj
  pair = sj.load_pair("qwen2.5-coder")
  tokenizer = pair.tokenizer
  eos = tuple(tokenizer.eos_ids)
  rows = []
  for tool, request in zip(tools, requests):
    constraint = sj.constrain.json_schema(tool["schema"], tokenizer,
                                          vocab_size=pair.target.vocab_size)
    tokens, lengths = batch(tokenizer, [messages(tool, request)])
    common = dict(lengths=lengths, max_new_tokens=new, eos_id=eos, constraint=constraint)
    calls = {"generate": lambda: sj.generate(pair.target, tokens, jax.random.key(0), **common),
             "decode": lambda: sj.decode(pair.target, pair.draft, tokens, jax.random.key(0),
                                         num_draft=pair.num_draft, **common)}
    row = dict(tool=tool["name"])
    for name, call in calls.items():
      jax.block_until_ready(call())
      start = time.perf_counter()
      out = jax.block_until_ready(call())
      seconds = time.perf_counter() - start
      count = int(out.num_tokens[0])
      ids = np.asarray(out.tokens)[0, :count].tolist()
      ended = bool(ids) and ids[-1] in eos
      generated = count - int(ended)
      row[name] = dict(seconds=seconds, tokens=generated, ended=ended,
                       tokens_per_s=generated / seconds,
                       text=tokenizer.decode(np.asarray(ids[:generated], np.int32)))
    rows.append(row)
    print(f"  specjax {tool['name']}: generate {row['generate']['tokens_per_s']:.2f} tok/s, "
          f"decode {row['decode']['tokens_per_s']:.2f} tok/s", flush=True)
  return rows


def run_outlines(tools, requests, new: int) -> tuple[list[dict], dict]:
  import outlines
  import torch
  from outlines.types import JsonSchema
  from transformers import AutoModelForCausalLM, AutoTokenizer

  from benchmarks.peer import fastest_torch_threads
  from specjax.io.packages import packaged_gguf

  path = packaged_gguf("qwen2.5-coder-1.5b-instruct")
  hf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
  hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
  threads, probe = fastest_torch_threads(hf_model)
  model = outlines.from_transformers(hf_model, hf_tokenizer)
  rows = []
  for tool, request in zip(tools, requests):
    generator = outlines.Generator(model, JsonSchema(json.dumps(tool["schema"])))
    prompt = hf_tokenizer.apply_chat_template(messages(tool, request), tokenize=False,
                                              add_generation_prompt=True)
    call = lambda: generator(prompt, max_new_tokens=new, do_sample=False)
    call()
    start = time.perf_counter()
    text = call()
    seconds = time.perf_counter() - start
    generated = len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])
    rows.append(dict(tool=tool["name"], outlines=dict(seconds=seconds, tokens=generated,
                                                      tokens_per_s=generated / seconds,
                                                      text=text)))
    print(f"  outlines {tool['name']}: {generated / seconds:.2f} tok/s", flush=True)
  return rows, dict(torch_threads=threads, probe_tokens_per_s=probe)


def main(argv=None) -> None:
  import jsonschema
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tools", type=int, default=12)
  parser.add_argument("--new", type=int, default=SPEED_TOKENS)
  args = parser.parse_args(argv)
  tools = load_tools()[:args.tools]
  requests = [tool["requests"][0] for tool in tools]
  load_before = [round(x, 2) for x in os.getloadavg()]
  ours = run_specjax(tools, requests, args.new)
  theirs, torch_info = run_outlines(tools, requests, args.new)
  load_after = [round(x, 2) for x in os.getloadavg()]
  rows = []
  for tool, mine, peer in zip(tools, ours, theirs):
    row = dict(tool=tool["name"], **{k: v for k, v in mine.items() if k != "tool"},
               outlines=peer["outlines"])
    for side in ("generate", "decode", "outlines"):
      try:
        jsonschema.validate(json.loads(row[side]["text"]), tool["schema"])
        row[side]["valid"] = True
      except (ValueError, jsonschema.ValidationError) as error:
        row[side]["valid"] = False
        row[side]["error"] = str(error).splitlines()[0][:200]
    row["same_text_greedy"] = row["generate"]["text"] == row["outlines"]["text"]
    rows.append(row)
  total = lambda side: (sum(r[side]["tokens"] for r in rows)
                        / sum(r[side]["seconds"] for r in rows))
  summary = {side: dict(tokens_per_s=total(side), valid=sum(r[side]["valid"] for r in rows))
             for side in ("generate", "decode", "outlines")}
  summary["same_text_greedy"] = sum(r["same_text_greedy"] for r in rows)
  data = dict(model="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, float32)", prompts=len(rows),
              max_new_tokens=args.new, load_before=load_before, load_after=load_after,
              torch=torch_info, summary=summary, rows=rows)
  (RESULTS / "constrained_peer.json").write_text(json.dumps(data, indent=1) + "\n")
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  main()
