"""specjax and two peers on the Qwen2.5-Coder pair: each side's speculative run over its own plain.

    python -m benchmarks.peers_qwen [--new 64] [--reps 2] [--k 5]
                                    [--sides specjax,transformers,llamacpp] [--out PATH]

The pair: Qwen2.5-Coder-1.5B-Instruct as the target, Qwen2.5-Coder-0.5B-Instruct as the draft
model, from the Q4_K_M GGUF files that `specjax.io.packages.packaged_gguf` assembles from their
chunk packages. Batch 1, greedy, `--new` new tokens, `--k` drafts per round, on the coding
questions of `benchmarks/self_draft.py` (CODE_QUESTIONS), each chat-templated with the model's
own template (generation prompt added); every side gets the same templated prompt:

  * specjax: `sj.load_pair("qwen2.5-coder")` (the 1.5B dequantized to float32, the 0.5B
    quantized to int8), `sj.generate` against `sj.decode(..., num_draft=k)`.
  * transformers: both GGUF files loaded with `AutoModelForCausalLM.from_pretrained(dir,
    gguf_file=...)`, dequantized to float32; plain greedy `generate` against assisted generation
    with the 0.5B. transformers reads the draft settings from the assistant's own
    `generation_config` (not from `generate`'s keywords), so they are set there:
    `num_assistant_tokens=k`, constant schedule, `assistant_confidence_threshold=0` (exactly k
    drafts a round). Torch threads: the faster of its default and 1
    (`benchmarks.peer.fastest_torch_threads`).
  * llama.cpp: the Q4_K_M files as shipped, run by the llama.cpp that the `llama-cpp-python`
    sdist vendors, built here once (CPU, Release, GGML_NATIVE) into
    `$SPECJAX_CACHE_DIR/llama.cpp/<version>/` (default `~/.cache/specjax`): `llama-completion
    -no-cnv` (plain) against `llama-speculative-simple --spec-type draft-simple
    --spec-draft-n-max k --spec-draft-p-min 0` (the draft model, exactly k drafts a round), both
    `--temp 0 --top-k 1`, the prompt passed as text (`-p`) and its token ids checked against the
    other sides' (`llama-tokenize`). Threads: the faster of the host's cores and 1 in a short
    probe (`fastest_llamacpp_threads`).

EOS rule, the same on every side: none. Each call produces `--new` new tokens (specjax:
`eos_id=None`; transformers: `eos_token_id=None`; llama.cpp: `--ignore-eos`, which also keeps
it from choosing its end-of-generation tokens; `llama-speculative-simple` may run up to k tokens
past, see `seconds_for`).

Timing. The three sides run one after another in one process, each loaded, timed and freed before
the next (the two float32 pairs do not fit in memory together with other work). Within a side,
its plain and speculative calls are timed alternately (`benchmarks.timing.time_alternately`:
one untimed warm-up each, then `--reps` repeats, order flipped each repeat), prompt by prompt; the
statistic is the min (`--statistic median` for the median). specjax and transformers: wall time
of the whole call (prefill + new tokens). llama.cpp: a fresh process per call, timed by its own
clocks around the prompt and the generation loop (model load and process start-up excluded; the
process's wall time is recorded beside it); its generation-only ratio is recorded too. A side's
ratio is its speculative tokens/s over its own plain tokens/s, summed over the prompts. tau is a
side's tokens per target verify round, as it counts them. Load averages are recorded before and
after each side.

Precision: the sides do not draft at one precision. specjax's draft is the 0.5B in int8 (per 128,
through its own kernels), transformers' the 0.5B in float32, llama.cpp's the Q4_K_M file; the
target is float32 on the first two, Q4_K_M on llama.cpp. A cheaper draft raises a side's ratio,
so the specjax / transformers comparison is not one at equal precision: `PRECISION` records each
side's, the JSON's summary carries it beside every side and a `precision_notes` entry beside the
checks, and the printed side lines and the plot's labels name it.

Greedy identity: each side's speculative tokens against its own plain tokens, and the three
sides' plain streams against each other (noted, not required: llama.cpp runs the Q4_K_M weights
through its own kernels; specjax and transformers compute on the same dequantized weights, but in
float32 with different kernels, and specjax's draft is int8).

Writes `benchmarks/results/peers_qwen.json` (`--out`) and a `.png` beside it (tokens/s of the six
calls, the three ratios) when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.timing import first_divergence, time_alternately  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
SIDES = ("specjax", "transformers", "llamacpp")
# What each side computes with: its target's and its draft's weights.
PRECISION = {
    "specjax": {"target": "float32", "draft": "int8 per 128"},
    "transformers": {"target": "float32", "draft": "float32"},
    "llamacpp": {"target": "Q4_K_M", "draft": "Q4_K_M"},
}
LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python sdist whose vendored llama.cpp is built
LLAMA_TOOLS = ("llama-completion", "llama-speculative-simple", "llama-tokenize")


# ----------------------------------------------------------------------------------------------
# llama.cpp: build from the llama-cpp-python sdist, run, parse


def cache_dir() -> pathlib.Path:
  """`$SPECJAX_CACHE_DIR`, else `$XDG_CACHE_HOME/specjax`, else `~/.cache/specjax`."""
  base = os.environ.get("SPECJAX_CACHE_DIR")
  if base:
    return pathlib.Path(base)
  return pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "specjax"


def _fetch_sdist(version: str, into: pathlib.Path) -> pathlib.Path:
  """The `llama-cpp-python==version` sdist, downloaded with pip into `into` unless there."""
  into.mkdir(parents=True, exist_ok=True)
  found = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
  if found:
    return found[0]
  command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={version}", "-d", str(into)]
  done = subprocess.run(command, capture_output=True, text=True)
  found = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
  if done.returncode != 0 or not found:
    raise RuntimeError(f"could not download the llama-cpp-python {version} sdist ("
                       f"{' '.join(command)}):\n{done.stderr[-2000:]}")
  return found[0]


def build_llamacpp(version: str = LLAMA_CPP_PYTHON, sdist: str | os.PathLike | None = None,
                   jobs: int = 2, log=print) -> pathlib.Path:
  """Builds llama.cpp's `LLAMA_TOOLS` from the `llama-cpp-python` sdist's vendored source, once.

  The sdist (`sdist`, else `pip download --no-deps --no-binary :all: llama-cpp-python==version`)
  is unpacked into `<cache>/llama.cpp/<version>/src` and built with CMake (Release, CPU only,
  `GGML_NATIVE=ON`, static libraries, no OpenSSL, no tests / server) into `.../build`; the build
  log goes to `.../build.log`. A later call finds the tools there and returns at once. (This
  llama.cpp has no CURL dependency to turn off: `LLAMA_CURL` is deprecated, downloads go through
  its vendored cpp-httplib, whose OpenSSL use `LLAMA_OPENSSL=OFF` turns off.)

  Returns:
    The directory holding the tools (`.../build/bin`).

  Raises:
    RuntimeError: the download, configure or build failed (the log's tail is in the message).
  """
  root = cache_dir() / "llama.cpp" / version
  bin_dir = root / "build" / "bin"
  if all((bin_dir / tool).is_file() for tool in LLAMA_TOOLS):
    return bin_dir
  source = root / "src" / "vendor" / "llama.cpp"
  if not (source / "CMakeLists.txt").is_file():
    archive = pathlib.Path(sdist) if sdist else _fetch_sdist(version, root / "sdist")
    log(f"llama.cpp: unpacking {archive}")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
      with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="tar")
      top = next(pathlib.Path(tmp).iterdir())
      if not (top / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{archive} has no vendor/llama.cpp/CMakeLists.txt")
      shutil.rmtree(root / "src", ignore_errors=True)
      shutil.move(str(top), root / "src")
  build = root / "build"
  configure = ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
               "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF"]
  compile_ = ["cmake", "--build", str(build), "--config", "Release", f"-j{jobs}", "--target",
              *LLAMA_TOOLS]
  log_path = root / "build.log"
  log(f"llama.cpp: building {', '.join(LLAMA_TOOLS)} in {build} (log: {log_path}); this takes "
      "a while")
  with open(log_path, "w") as out:
    for command in (configure, compile_):
      out.write("$ " + " ".join(command) + "\n")
      out.flush()
      try:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
      except FileNotFoundError as error:
        raise RuntimeError(f"llama.cpp build: {error} (cmake and a C++ compiler are needed)")
      if done.returncode != 0:
        tail = log_path.read_text()[-3000:]
        raise RuntimeError(f"llama.cpp build failed ({' '.join(command[:3])} ...), see "
                           f"{log_path}:\n{tail}")
  missing = [tool for tool in LLAMA_TOOLS if not (bin_dir / tool).is_file()]
  if missing:
    raise RuntimeError(f"llama.cpp build finished without {', '.join(missing)} in {bin_dir}")
  return bin_dir


def llamacpp_version(bin_dir: pathlib.Path) -> dict:
  """What `llama-completion --version` prints, and the upstream commit that the sdist's CHANGELOG
  names for its version (`feat: update llama.cpp to ggml-org/llama.cpp@<commit>`)."""
  done = subprocess.run([str(bin_dir / "llama-completion"), "--version"], capture_output=True,
                        text=True)
  text = (done.stdout + done.stderr).strip()
  record = {"llama_cpp_python": bin_dir.parent.parent.name, "version_output": text}
  match = re.search(r"version:\s*(\S+)\s*\(build (\d+), commit ([0-9a-f]+)\)", text)
  if match:
    record.update(version=match.group(1), build_number=int(match.group(2)),
                  commit=match.group(3))
  changelog = bin_dir.parent.parent / "src" / "CHANGELOG.md"
  if changelog.is_file():
    section = changelog.read_text().split(f"## [{record['llama_cpp_python']}]", 1)[-1]
    found = re.search(r"ggml-org/llama\.cpp@([0-9a-f]+)", section.split("\n## [", 1)[0])
    if found:
      record["changelog_commit"] = found.group(1)
  return record


_FLOAT = r"([0-9.]+|nan|inf)"


def _finder(tool: str, text: str):
  def find(pattern):
    match = re.search(pattern, text)
    if not match:
      raise ValueError(f"{tool}'s output lacks /{pattern}/:\n{text[-3000:]}")
    return match
  return find


def parse_completion(stderr: str) -> dict:
  """Timings from `llama-completion`'s performance report (its stderr, `--perf`).

  Returns:
    `{"prompt_tokens", "prompt_ms", "eval_runs", "eval_ms", "sampling_ms", "load_ms",
    "total_ms", "generated", "seconds"}`: `generated` = eval runs + 1 (the first new token comes
    from the prompt's logits), `seconds` = its total time (prompt eval, eval, sampling and the
    rest of the loop, after the model load and warm-up).

  Raises:
    ValueError: the report's lines are missing (the message holds stderr's tail).
  """
  find = _finder("llama-completion", stderr)
  prompt = find(r"prompt eval time =\s*" + _FLOAT + r" ms /\s*(\d+) tokens")
  evals = find(r"\s eval time =\s*" + _FLOAT + r" ms /\s*(\d+) runs")
  record = {"prompt_tokens": int(prompt.group(2)), "prompt_ms": float(prompt.group(1)),
            "eval_runs": int(evals.group(2)), "eval_ms": float(evals.group(1)),
            "sampling_ms": float(find(r"sampling time =\s*" + _FLOAT + r" ms").group(1)),
            "load_ms": float(find(r"load time =\s*" + _FLOAT + r" ms").group(1)),
            "total_ms": float(find(r"total time =\s*" + _FLOAT + r" ms").group(1))}
  record["generated"] = record["eval_runs"] + 1
  record["seconds"] = record["total_ms"] / 1e3
  return record


def parse_speculative(stderr: str) -> dict:
  """Timings and acceptance from `llama-speculative-simple`'s report (its stderr).

  Returns:
    `{"prompt_tokens", "prompt_s", "generated", "decode_s", "seconds" (encoded + decoded time:
    the tool's own clock around the prompt and the loop, after the model loads), "num_draft",
    "drafted", "accepted", "acceptance", "rounds", "tau"}`; rounds = generated - accepted (a
    round yields its accepted drafts and one token of the target's), tau = generated / rounds.

  Raises:
    ValueError: the report's lines are missing (the message holds stderr's tail).
  """
  find = _finder("llama-speculative-simple", stderr)
  encoded = find(r"encoded\s+(\d+) tokens in\s+" + _FLOAT + r" seconds")
  decoded = find(r"decoded\s+(\d+) tokens in\s+" + _FLOAT + r" seconds")
  record = {"prompt_tokens": int(encoded.group(1)), "prompt_s": float(encoded.group(2)),
            "generated": int(decoded.group(1)), "decode_s": float(decoded.group(2)),
            "num_draft": int(find(r"n_draft\s*=\s*(\d+)").group(1)),
            "drafted": int(find(r"n_drafted\s*=\s*(\d+)").group(1)),
            "accepted": int(find(r"n_accept\s*=\s*(\d+)").group(1))}
  record["seconds"] = record["prompt_s"] + record["decode_s"]
  record["acceptance"] = record["accepted"] / record["drafted"] if record["drafted"] else 0.0
  record["rounds"] = record["generated"] - record["accepted"]
  record["tau"] = record["generated"] / record["rounds"] if record["rounds"] else float("nan")
  return record


def seconds_for(record: dict, new: int) -> float:
  """A llama.cpp call's time for exactly `new` new tokens.

  `llama-completion` produces exactly `-n`. `llama-speculative-simple` can run past `-n`: its
  draft cap is the tokens still wanted minus one, and where that reaches zero the draft is
  uncapped (up to k), so it ends with `new` .. `new + k` tokens; its decode time is then taken at
  its own rate for `new` tokens (prompt time + decode time * new / generated).
  """
  if "decode_s" not in record:
    return record["seconds"]
  return record["prompt_s"] + record["decode_s"] * new / record["generated"]


def llamacpp_plain_args(bin_dir, model, prompt: str, new: int, threads: int, ctx: int) -> list:
  """`llama-completion`, plain greedy on the raw prompt (`-no-cnv`: the text is templated).

  The prompt goes in as `-p` text: `-f` would drop the file's last newline, which the chat
  template's generation prompt ends with.
  """
  return [str(bin_dir / "llama-completion"), "-m", str(model), "-p", prompt,
          "-n", str(new), "--temp", "0", "--top-k", "1", "--ignore-eos", "-t", str(threads),
          "-tb", str(threads), "-c", str(ctx), "-ngl", "0", "-no-cnv", "--no-display-prompt",
          "--perf"]


def llamacpp_spec_args(bin_dir, model, draft, prompt: str, new: int, k: int, threads: int,
                       ctx: int) -> list:
  """`llama-speculative-simple` with the draft model (`--spec-type draft-simple`), `k` drafts a
  round and no confidence stop (`--spec-draft-p-min 0`, `--spec-draft-n-min 0`), greedy.

  `-n new - 1`: the loop stops once it has more than `-n` tokens (see `seconds_for`).
  """
  return [str(bin_dir / "llama-speculative-simple"), "-m", str(model), "-md", str(draft),
          "-p", prompt, "-n", str(new - 1), "--temp", "0", "--top-k", "1",
          "--ignore-eos", "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
          "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-t", str(threads),
          "-tb", str(threads), "-td", str(threads), "-tbd", str(threads), "-c", str(ctx),
          "-ngl", "0", "-ngld", "0"]


def run_tool(args: list, timeout: float | None = None) -> tuple[str, str, float]:
  """Runs a llama.cpp tool; returns (stdout, stderr, wall seconds of the process)."""
  start = time.perf_counter()
  done = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout)
  wall = time.perf_counter() - start
  if done.returncode != 0:
    raise RuntimeError(f"{pathlib.Path(args[0]).name} exited with {done.returncode}:\n"
                       f"{' '.join(args)}\n{done.stderr[-3000:]}")
  return done.stdout, done.stderr, wall


def fastest_llamacpp_threads(bin_dir, model, prompt: str, ctx: int, tries: int = 2,
                             new: int = 16, timeout: float = 120.0) -> tuple[int, dict]:
  """Whichever of (the host's cores, 1) threads runs `llama-completion` faster here.

  The counterpart of `benchmarks.peer.fastest_torch_threads`: on a shared CPU llama.cpp's threads,
  which meet at a barrier after every operation, can be many times slower with all cores than
  with one. Best of `tries` short plain runs (`new` tokens, its own clock) each; a run past
  `timeout` seconds counts as infinitely slow.
  """
  probe = {}
  for threads in dict.fromkeys((os.cpu_count() or 1, 1)):
    best = float("inf")
    for _ in range(tries):
      try:
        _, err, _ = run_tool(llamacpp_plain_args(bin_dir, model, prompt, new, threads, ctx),
                             timeout)
        best = min(best, parse_completion(err)["seconds"])
      except subprocess.TimeoutExpired:
        pass
    probe[threads] = new / best if best > 0 else 0.0
  return max(probe, key=probe.get), {str(k): v for k, v in probe.items()}


# ----------------------------------------------------------------------------------------------
# prompts, the three sides


def gguf_paths() -> tuple[pathlib.Path, pathlib.Path]:
  """The target's and the draft's GGUF files (assembled from their chunk packages on first use).

  Raises:
    FileNotFoundError: the chunk packages are missing; the message gives the pip command.
  """
  from specjax.io.packages import packaged_gguf
  paths = []
  for name in (TARGET, DRAFT):
    try:
      paths.append(packaged_gguf(name))
    except FileNotFoundError as error:
      raise FileNotFoundError(f"the {name} GGUF file is not available: {error}") from None
  return paths[0], paths[1]


def build_prompts(tokenizer, questions) -> list[dict]:
  """Each question under the model's chat template: the text and its token ids."""
  prompts = []
  for question in questions:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.render_chat(messages)
    ids = tokenizer.encode(text, add_bos=False)
    if ids != tokenizer.apply_chat_template(messages):
      raise AssertionError("render_chat + encode differs from apply_chat_template")
    prompts.append({"question": question, "text": text, "ids": ids})
  return prompts


def _side_record(per_prompt: list[dict], new: int) -> dict:
  """Totals over the prompts: tokens/s of the plain and the speculative calls, the ratio."""
  plain_s = sum(p["plain_s"] for p in per_prompt)
  spec_s = sum(p["speculative_s"] for p in per_prompt)
  produced = new * len(per_prompt)
  plain, spec = produced / plain_s, produced / spec_s
  return {"plain_tokens_per_s": plain, "speculative_tokens_per_s": spec, "ratio": spec / plain,
          "paired_ratio_median": statistics.median(
              [a / b for p in per_prompt for a, b in zip(p["plain_times_s"],
                                                        p["speculative_times_s"])]),
          "speculative_identical_to_plain": all(
              p["speculative_first_divergence"] is None for p in per_prompt),
          "per_prompt": per_prompt}


def _pick(times: list[float], statistic: str) -> float:
  return min(times) if statistic == "min" else statistics.median(times)


def run_specjax(prompts, args, log=print) -> dict:
  """`sj.generate` against `sj.decode(num_draft=k)` on `sj.load_pair("qwen2.5-coder")`."""
  import jax
  import numpy as np

  import specjax as sj

  start = time.perf_counter()
  pair = sj.load_pair("qwen2.5-coder")
  load_s = time.perf_counter() - start
  target, drafter = pair.target, pair.draft
  key = jax.random.key(0)
  per_prompt = []
  for prompt in prompts:
    ids = np.asarray([prompt["ids"]], np.int32)
    common = dict(lengths=np.asarray([ids.shape[1]], np.int32), max_new_tokens=args.new,
                  eos_id=None)
    calls = {"plain": lambda: sj.generate(target, ids, key, **common),
             "speculative": lambda: sj.decode(target, drafter, ids, key, num_draft=args.k,
                                              **common)}
    timed = time_alternately(calls, args.reps, args.statistic)
    plain = np.asarray(timed["plain"]["result"].tokens[0]).tolist()
    spec_out = timed["speculative"]["result"]
    spec = np.asarray(spec_out.tokens[0]).tolist()
    stats = spec_out.stats.summary()
    if int(spec_out.num_tokens[0]) != args.new or len(plain) != args.new:
      raise AssertionError(f"specjax produced {int(spec_out.num_tokens[0])} tokens, not {args.new}")
    row = {"plain_s": timed["plain"]["seconds"], "speculative_s": timed["speculative"]["seconds"],
           "plain_times_s": timed["plain"]["times_s"],
           "speculative_times_s": timed["speculative"]["times_s"],
           "compile_s": {name: entry["compile_s"] for name, entry in timed.items()},
           "tau": stats["tokens_per_round"], "acceptance": stats["acceptance_rate"],
           "rounds": stats["rounds"], "drafted": stats["drafted"], "accepted": stats["accepted"],
           "speculative_first_divergence": first_divergence(plain, spec),
           "plain_tokens": plain, "speculative_tokens": spec}
    per_prompt.append(row)
    log(f"  specjax {prompt['question'][:40]!r}: plain {args.new / row['plain_s']:.2f} tok/s, "
        f"decode {args.new / row['speculative_s']:.2f} tok/s, tau {row['tau']:.2f}, same "
        f"{row['speculative_first_divergence'] is None}")
  record = _side_record(per_prompt, args.new)
  record.update(
      plain_call="specjax.generate", speculative_call=f"specjax.decode(num_draft={args.k})",
      pair=pair.description, load_s=load_s, cpu_kernel=getattr(target, "cpu_kernel", None),
      tau=_mean(per_prompt, "tau"), acceptance=_ratio(per_prompt, "accepted", "drafted"),
      threads={"cpu_count": os.cpu_count(), "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")})
  del pair, target, drafter, calls, timed, spec_out
  return record


def _mean(rows, key) -> float:
  return float(statistics.mean(r[key] for r in rows))


def _ratio(rows, num, den) -> float:
  total = sum(r[den] for r in rows)
  return sum(r[num] for r in rows) / total if total else 0.0


def run_transformers(prompts, args, target_gguf, draft_gguf, log=print) -> dict:
  """transformers' greedy `generate` against its assisted generation with the 0.5B, both GGUF
  files dequantized to float32 on load."""
  import numpy as np
  import torch
  import transformers
  from transformers import AutoModelForCausalLM

  from benchmarks.peer import fastest_torch_threads

  start = time.perf_counter()
  load = lambda path: AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
  hf_target, hf_draft = load(target_gguf), load(draft_gguf)
  load_s = time.perf_counter() - start
  for model in (hf_target, hf_draft):
    model.generation_config.eos_token_id = None  # no EOS stop, as on the other sides
    if model.generation_config.pad_token_id is None:
      model.generation_config.pad_token_id = model.config.eos_token_id
  # The candidate generator reads the draft settings from the assistant's generation config:
  # exactly k drafts per round (constant schedule, no confidence stop), as on the other sides.
  hf_draft.generation_config.num_assistant_tokens = args.k
  hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
  hf_draft.generation_config.assistant_confidence_threshold = 0.0
  threads, probe = fastest_torch_threads(hf_target)
  forwards = {"target": 0, "draft": 0}
  hooks = [hf_target.register_forward_hook(lambda *_: forwards.__setitem__(
               "target", forwards["target"] + 1)),
           hf_draft.register_forward_hook(lambda *_: forwards.__setitem__(
               "draft", forwards["draft"] + 1))]
  per_prompt = []
  for prompt in prompts:
    input_ids = torch.tensor([prompt["ids"]], dtype=torch.long)
    mask = torch.ones_like(input_ids)
    counted = {}

    def call(assisted):
      def run():
        forwards.update(target=0, draft=0)
        kwargs = dict(assistant_model=hf_draft) if assisted else {}
        with torch.no_grad():
          out = hf_target.generate(input_ids, attention_mask=mask, max_new_tokens=args.new,
                                   do_sample=False, **kwargs)
        counted["speculative" if assisted else "plain"] = dict(forwards)
        return np.asarray(out[0, input_ids.shape[1]:])
      return run

    timed = time_alternately({"plain": call(False), "speculative": call(True)}, args.reps,
                             args.statistic)
    plain = timed["plain"]["result"].tolist()
    spec = timed["speculative"]["result"].tolist()
    if len(plain) != args.new or len(spec) != args.new:
      raise AssertionError(f"transformers produced {len(plain)} / {len(spec)} tokens")
    rounds = counted["speculative"]["target"]
    row = {"plain_s": timed["plain"]["seconds"], "speculative_s": timed["speculative"]["seconds"],
           "plain_times_s": timed["plain"]["times_s"],
           "speculative_times_s": timed["speculative"]["times_s"],
           "first_call_s": {name: entry["first_call_s"] for name, entry in timed.items()},
           "target_forwards": rounds, "draft_forwards": counted["speculative"]["draft"],
           "tau": args.new / rounds,
           "accepted": args.new - rounds, "drafted": counted["speculative"]["draft"],
           "speculative_first_divergence": first_divergence(plain, spec),
           "plain_tokens": plain, "speculative_tokens": spec}
    per_prompt.append(row)
    log(f"  transformers {prompt['question'][:40]!r}: plain {args.new / row['plain_s']:.2f} "
        f"tok/s, assisted {args.new / row['speculative_s']:.2f} tok/s, tau {row['tau']:.2f}, "
        f"same {row['speculative_first_divergence'] is None}")
  for hook in hooks:
    hook.remove()
  record = _side_record(per_prompt, args.new)
  record.update(
      plain_call="generate(do_sample=False)",
      speculative_call="generate(assistant_model=<0.5B>), the 0.5B's generation_config: "
                       f"num_assistant_tokens={args.k}, num_assistant_tokens_schedule='constant',"
                       " assistant_confidence_threshold=0",
      transformers=transformers.__version__, torch=torch.__version__, load_s=load_s,
      weights="both GGUF files dequantized to float32 by transformers",
      tau=_mean(per_prompt, "tau"), acceptance=_ratio(per_prompt, "accepted", "drafted"),
      acceptance_note="(new tokens - target forwards) / draft-model forwards",
      threads={"torch": threads, "probe_tokens_per_s": probe})
  del hf_target, hf_draft, hooks
  return record


def run_llamacpp(prompts, args, target_gguf, draft_gguf, tokenizer, log=print) -> dict:
  """llama.cpp's plain greedy run (`llama-completion`) against its draft-model speculation
  (`llama-speculative-simple`), a fresh process per call, on the Q4_K_M files as shipped."""
  bin_dir = build_llamacpp(sdist=args.llama_sdist, log=log)
  version = llamacpp_version(bin_dir)
  ctx = 1 << max(9, (max(len(p["ids"]) for p in prompts) + args.new + 2 * args.k).bit_length())
  per_prompt = []
  for index, prompt in enumerate(prompts):
    ids = llamacpp_tokenize(bin_dir, target_gguf, prompt["text"])
    if ids != prompt["ids"]:
      raise AssertionError(f"llama.cpp tokenizes prompt {index} differently: {ids} vs "
                           f"{prompt['ids']}")
  if args.threads:
    threads, probe = args.threads, None
  else:
    threads, probe = fastest_llamacpp_threads(bin_dir, target_gguf, prompts[0]["text"], ctx)
    log(f"  llama.cpp threads: {threads} (probe, tokens/s: {probe})")
  for prompt in prompts:
    runs = {"plain": [], "speculative": []}
    plain_args = llamacpp_plain_args(bin_dir, target_gguf, prompt["text"], args.new, threads,
                                     ctx)
    spec_args = llamacpp_spec_args(bin_dir, target_gguf, draft_gguf, prompt["text"], args.new,
                                   args.k, threads, ctx)

    def plain():
      out, err, wall = run_tool(plain_args)
      runs["plain"].append({**parse_completion(err), "wall_s": wall,
                            "text": completion_text(out)})

    def speculative():
      out, err, wall = run_tool(spec_args)
      runs["speculative"].append({**parse_speculative(err), "wall_s": wall,
                                  "text": speculative_text(out, prompt["text"])})

    timed = time_alternately({"plain": plain, "speculative": speculative}, args.reps)
    for name, entries in runs.items():
      del entries[0]  # the warm-up call
      if {e["prompt_tokens"] for e in entries} != {len(prompt["ids"])}:
        raise AssertionError(f"llama.cpp {name} read a prompt of "
                             f"{[e['prompt_tokens'] for e in entries]} tokens, not "
                             f"{len(prompt['ids'])}")
      produced = [e["generated"] for e in entries]
      if not all(args.new <= n <= args.new + (args.k if name == "speculative" else 0)
                 for n in produced):
        raise AssertionError(f"llama.cpp {name} produced {produced} tokens for {args.new}")
      for entry in entries:
        entry["seconds_for_new"] = seconds_for(entry, args.new)
    plain_text, spec_text = runs["plain"][-1]["text"], runs["speculative"][-1]["text"]
    plain = tokenizer.encode(plain_text, add_bos=False)
    spec = tokenizer.encode(spec_text, add_bos=False)
    last = runs["speculative"][-1]
    plain_times = [e["seconds_for_new"] for e in runs["plain"]]
    spec_times = [e["seconds_for_new"] for e in runs["speculative"]]
    row = {"plain_s": _pick(plain_times, args.statistic),
           "speculative_s": _pick(spec_times, args.statistic),
           "plain_times_s": plain_times, "speculative_times_s": spec_times,
           # generation alone (the prompt's forward left out), for reference
           "plain_decode_only_s": _pick([(e["total_ms"] - e["prompt_ms"]) / 1e3
                                         for e in runs["plain"]], args.statistic),
           "speculative_decode_only_s": _pick([e["decode_s"] * args.new / e["generated"]
                                               for e in runs["speculative"]], args.statistic),
           "process_wall_s": {name: entry["times_s"] for name, entry in timed.items()},
           "plain_runs": [_strip(e) for e in runs["plain"]],
           "speculative_runs": [_strip(e) for e in runs["speculative"]],
           "tau": last["tau"], "acceptance": last["acceptance"], "rounds": last["rounds"],
           "drafted": last["drafted"], "accepted": last["accepted"],
           # the speculative run may go past `new` tokens: its text must start with plain's
           "speculative_first_divergence": None if spec_text.startswith(plain_text)
           else first_divergence(plain, spec[:len(plain)]),
           "plain_text": plain_text, "speculative_text": spec_text,
           "plain_tokens": plain, "speculative_tokens": spec[:len(plain)]}
    per_prompt.append(row)
    log(f"  llama.cpp {prompt['question'][:40]!r}: plain {args.new / row['plain_s']:.2f} tok/s,"
        f" speculative {args.new / row['speculative_s']:.2f} tok/s, tau {row['tau']:.2f}, "
        f"same {row['speculative_first_divergence'] is None}")
  record = _side_record(per_prompt, args.new)
  decode_only = [sum(p[f"{n}_decode_only_s"] for p in per_prompt) for n in ("plain", "speculative")]
  record.update(
      plain_call=_command(plain_args), speculative_call=_command(spec_args),
      version=version, build_dir=str(bin_dir.parent), weights="Q4_K_M as shipped (both models)",
      timing="llama.cpp's own clocks, model load excluded: llama-completion's total time; "
             "llama-speculative-simple's encoded + decoded time, its decode part taken at its "
             "rate for exactly new_tokens (it may run up to k tokens past them)",
      decode_only_ratio=decode_only[0] / decode_only[1],
      tokens_note="llama.cpp's output text re-tokenized with the model's tokenizer",
      tau=_mean(per_prompt, "tau"), acceptance=_ratio(per_prompt, "accepted", "drafted"),
      threads={"threads": threads, "threads_batch": threads, "draft_threads": threads,
               "probe_tokens_per_s": probe},
      ctx=ctx)
  return record


def _command(args: list) -> str:
  """A tool's command line as recorded: the tool's name, the prompt as <prompt>."""
  words = [pathlib.Path(args[0]).name] + args[1:]
  return " ".join("<prompt>" if words[i - 1] == "-p" else word for i, word in enumerate(words))


def _strip(entry: dict) -> dict:
  return {key: value for key, value in entry.items() if key != "text"}


def llamacpp_tokenize(bin_dir, model, prompt: str) -> list[int]:
  """The prompt's token ids as llama.cpp tokenizes it (specials parsed; Qwen2.5 adds no BOS)."""
  out, _, _ = run_tool([str(bin_dir / "llama-tokenize"), "-m", str(model), "-p", prompt, "--ids",
                        "--log-disable"])
  return [int(i) for i in re.findall(r"-?\d+", out.strip().splitlines()[-1])]


def completion_text(stdout: str) -> str:
  """The generated text of `llama-completion --no-display-prompt`: its stdout less the "\n\n"
  it prints after the loop."""
  if not stdout.endswith("\n\n"):
    raise ValueError(f"llama-completion's output does not end as expected:\n{stdout[-500:]!r}")
  return stdout[:-2]


def speculative_text(stdout: str, prompt_text: str) -> str:
  """The generated text of `llama-speculative-simple`: its stdout is "\n\n", the prompt, the
  new text, "\n\n" after the loop and "\n\n" after the report."""
  head, tail = "\n\n" + prompt_text, "\n\n\n\n"
  if not stdout.startswith(head) or not stdout.endswith(tail):
    raise ValueError(f"llama-speculative-simple's output is not prompt + text as expected:\n"
                     f"{stdout[:300]!r} ... {stdout[-300:]!r}")
  return stdout[len(head):-len(tail)]


# ----------------------------------------------------------------------------------------------
# summary, plot, command line


def host_info() -> dict:
  model = ""
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        model = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return {"cpu_model": model, "cpu_count": os.cpu_count(), "machine": os.uname().machine,
          "system": f"{os.uname().sysname} {os.uname().release}"}


def side_label(name: str) -> str:
  """A side's name with its precision (`PRECISION`): "specjax (target float32, draft int8 per
  128)"."""
  precision = PRECISION.get(name)
  if precision is None:
    return name
  return f"{name} (target {precision['target']}, draft {precision['draft']})"


def precision_note(ours: str, peer: str) -> str | None:
  """A sentence where the two sides' drafts differ in precision, else None."""
  a, b = PRECISION[ours]["draft"], PRECISION[peer]["draft"]
  if a == b:
    return None
  return (f"not at equal draft precision: {ours} drafts in {a}, {peer} in {b} (a cheaper draft "
          "raises a side's ratio)")


def summarize(sides: dict) -> dict:
  """The six calls' tokens/s, the three ratios, each side's precision, and the comparisons the
  issue asks for (with `precision_notes` where the drafts' precisions differ)."""
  summary = {name: {**{key: side[key] for key in (
      "plain_tokens_per_s", "speculative_tokens_per_s", "ratio", "paired_ratio_median", "tau",
      "acceptance", "speculative_identical_to_plain")}, "precision": PRECISION.get(name),
      "label": side_label(name)} for name, side in sides.items()}
  checks, notes = {}, {}
  if "specjax" in sides:
    ours = sides["specjax"]
    for peer in ("transformers", "llamacpp"):
      if peer in sides:
        note = precision_note("specjax", peer)
        if note:
          notes[f"specjax_vs_{peer}"] = note
        checks[f"specjax_ratio_above_{peer}"] = ours["ratio"] > sides[peer]["ratio"]
        checks[f"specjax_speculative_tokens_per_s_over_{peer}"] = (
            ours["speculative_tokens_per_s"] / sides[peer]["speculative_tokens_per_s"])
        checks[f"specjax_plain_tokens_per_s_over_{peer}"] = (
            ours["plain_tokens_per_s"] / sides[peer]["plain_tokens_per_s"])
    if "transformers" in sides:
      checks["specjax_speculative_tokens_per_s_above_transformers"] = (
          ours["speculative_tokens_per_s"] > sides["transformers"]["speculative_tokens_per_s"])
  # Greedy streams across sides (noted, not required to match): plain against plain.
  names = list(sides)
  across = {}
  for i, a in enumerate(names):
    for b in names[i + 1:]:
      pairs = list(zip(sides[a]["per_prompt"], sides[b]["per_prompt"]))
      across[f"{a}_vs_{b}"] = {
          "first_divergence": [first_divergence(p["plain_tokens"], q["plain_tokens"])
                               for p, q in pairs],
          "same_text": [p["plain_text"] == q["plain_text"] for p, q in pairs]}
  return {"sides": summary, "checks": checks, "precision_notes": notes,
          "plain_streams_across_sides": across}


def plot(record: dict, path: pathlib.Path):
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return
  sides = record["summary"]["sides"]
  names = list(sides)
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  x = range(len(names))
  width = 0.38
  left.bar([i - width / 2 for i in x], [sides[n]["plain_tokens_per_s"] for n in names], width,
           label="plain")
  left.bar([i + width / 2 for i in x], [sides[n]["speculative_tokens_per_s"] for n in names],
           width, label=f"speculative (k = {record['k']})")
  left.set_xticks(list(x), [f"{n}\n(draft {PRECISION[n]['draft']})" for n in names])
  left.set_ylabel("new tokens / s")
  left.legend()
  right.bar(list(x), [sides[n]["ratio"] for n in names])
  right.set_xticks(list(x), [f"{n}\n(draft {PRECISION[n]['draft']})" for n in names])
  right.axhline(1.0, color="grey", lw=0.8)
  right.set_ylim(0, max(1.0, *(sides[n]["ratio"] for n in names)) * 1.15)
  right.set_ylabel("speculative / own plain")
  for i, n in enumerate(names):
    right.text(i, sides[n]["ratio"], f"{sides[n]['ratio']:.2f}x", ha="center", va="bottom")
  fig.suptitle(f"Qwen2.5-Coder 1.5B + 0.5B draft, batch 1, greedy, {record['new_tokens']} new "
               "tokens", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--new", type=int, default=64, help="new tokens per call")
  parser.add_argument("--reps", type=int, default=2, help="timed calls of each, after a warm-up")
  parser.add_argument("--k", type=int, default=5, help="drafts per round on every side")
  parser.add_argument("--sides", default=",".join(SIDES))
  parser.add_argument("--statistic", default="min", choices=["min", "median"])
  parser.add_argument("--prompts", type=int, default=None, help="use the first N questions")
  parser.add_argument("--threads", type=int, default=None,
                      help="llama.cpp threads (default: the faster of the host's cores and 1)")
  parser.add_argument("--llama-sdist", default=None,
                      help=f"a llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz (default: pip download)")
  parser.add_argument("--build-only", action="store_true",
                      help="build the llama.cpp tools and print where they are")
  parser.add_argument("--out", default=None, help="JSON path (default results/peers_qwen.json)")
  args = parser.parse_args(argv)
  if args.build_only:
    print(build_llamacpp(sdist=args.llama_sdist))
    return
  sides = [s.strip() for s in args.sides.split(",") if s.strip()]
  if set(sides) - set(SIDES) or not sides or len(set(sides)) != len(sides):
    parser.error(f"--sides takes some of {', '.join(SIDES)}; got {args.sides!r}")
  if args.new < 2 or args.k < 1 or args.reps < 1:
    parser.error("--new must be >= 2, --k and --reps >= 1")

  from benchmarks.self_draft import CODE_QUESTIONS
  from specjax.io.tokenizer import load_tokenizer

  target_gguf, draft_gguf = gguf_paths()
  if "llamacpp" in sides:  # fail early, before the long Python sides, if the build fails
    build_llamacpp(sdist=args.llama_sdist)
  tokenizer = load_tokenizer(target_gguf)
  prompts = build_prompts(tokenizer, CODE_QUESTIONS[:args.prompts])
  out_path = pathlib.Path(args.out or RESULTS / "peers_qwen.json")
  record = {"benchmark": "peers_qwen", "target": TARGET, "draft": DRAFT,
            "target_gguf": str(target_gguf), "draft_gguf": str(draft_gguf),
            "k": args.k, "new_tokens": args.new, "batch": 1, "greedy": True, "reps": args.reps,
            "statistic": args.statistic,
            "eos_rule": "none: every call produces exactly new_tokens tokens (llama.cpp: "
                        "--ignore-eos, which also bans its end-of-generation tokens)",
            "prompts": [{"question": p["question"], "text": p["text"], "ids": p["ids"]}
                        for p in prompts],
            "host": host_info(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "sides": {}}
  for side in sides:
    before, start = os.getloadavg(), time.perf_counter()
    print(f"{side}: load average {before}", flush=True)
    if before[0] >= 1.0:
      print(f"  warning: load average {before[0]:.1f}: other work is running, the timings will "
            "not be those of a quiet machine", flush=True)
    if side == "specjax":
      result = run_specjax(prompts, args)
    elif side == "transformers":
      result = run_transformers(prompts, args, target_gguf, draft_gguf)
    else:
      result = run_llamacpp(prompts, args, target_gguf, draft_gguf, tokenizer)
    result.update(load_before=before, load_after=os.getloadavg(),
                  side_seconds=time.perf_counter() - start, precision=PRECISION[side])
    for row in result["per_prompt"]:
      row.setdefault("plain_text", tokenizer.decode(row["plain_tokens"], skip_special_tokens=False))
    record["sides"][side] = result
    del result
    gc.collect()  # free this side's models before the next side loads its own
    if side == "specjax":
      import jax
      jax.clear_caches()
    done = record["sides"][side]
    print(f"{side_label(side)}: {done['plain_tokens_per_s']:.2f} tok/s plain, "
          f"{done['speculative_tokens_per_s']:.2f} tok/s speculative, ratio {done['ratio']:.2f} "
          f"({done['side_seconds']:.0f} s)", flush=True)
    record["summary"] = summarize(record["sides"])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(record, indent=1))  # after each side: a crash keeps the rest
  record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
  out_path.write_text(json.dumps(record, indent=1))
  print(json.dumps(record["summary"], indent=1))
  for note in record["summary"]["precision_notes"].values():
    print(f"note: {note}")
  plot(record, out_path.with_suffix(".png"))
  print(f"wrote {out_path}")


if __name__ == "__main__":
  main()
