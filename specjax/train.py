"""Training with optax: target pretraining, draft distillation and the byte-level BPE tokenizer.

Three jobs share one loop (`train`):

- `"lm"`: next-token cross-entropy on the corpus (the target, and the data-only baseline draft).
- `"distill"`: the draft learns the target's next-token distribution on the same windows. The loss
  targets acceptance: `"tv"` is the total-variation distance `1 - sum_x min(p(x), q(x))`, which is
  exactly one minus the probability that speculative sampling accepts the draft token at that
  position; `"fkl"` is the forward KL `KL(p || q)`. Both use the target's distribution warped by
  `distill_temperature`. With `on_policy > 0` that share of each batch is replaced by sequences the
  draft samples itself from a data prefix (DistillSpec), so the draft is taught where it goes.

The train state (params, optimizer state, step, rng) is one pytree, updated by a `jax.jit` step that
donates it. The batch of a step is a pure function of the step (`corpus.batch_at`), so a run resumed
from an Orbax checkpoint reaches bitwise the same state as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import time
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import corpus
from specjax.models.config import ModelConfig
from specjax.models.transformer import Model, forward, init_params

Task = Literal["lm", "distill"]
DistillLoss = Literal["tv", "fkl"]

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2


def model_preset(name: str, vocab_size: int, max_len: int = 1024) -> ModelConfig:
  """Named architectures: "target" (the shipped target), "draft" (its draft), "tiny" (tests)."""
  common = dict(vocab_size=vocab_size, max_len=max_len, tie_embeddings=True, pad_id=0, bos_id=1,
                eos_id=2, family="llama")
  presets = {
      "target": dict(embed_dim=256, num_layers=6, num_heads=4, num_kv_heads=4, head_dim=64,
                     mlp_dim=768),
      "target_large": dict(embed_dim=384, num_layers=6, num_heads=6, num_kv_heads=6, head_dim=64,
                           mlp_dim=1024),
      "draft": dict(embed_dim=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32,
                    mlp_dim=256),
      "tiny": dict(embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   mlp_dim=64),
  }
  if name not in presets:
    raise ValueError(f"unknown model preset {name!r}; choose from {sorted(presets)}")
  return ModelConfig(**common, **presets[name])


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Hyperparameters of one run.

  Attributes:
    task: "lm" (cross-entropy on data) or "distill" (match a frozen target).
    steps: optimizer steps in the whole run (the schedule's length).
    batch_size: windows per step.
    seq_len: tokens per window (the loss is on `seq_len` next-token predictions).
    learning_rate: peak AdamW learning rate.
    warmup_steps: linear warmup, then cosine decay to `learning_rate * final_lr_ratio`.
    final_lr_ratio: the schedule's floor as a share of the peak.
    weight_decay: AdamW decoupled weight decay (matrices only, not norms).
    clip_norm: global gradient-norm clipping.
    seed: initialisation, data order and on-policy sampling.
    distill_loss: "tv" or "fkl".
    distill_temperature: warping temperature of both distributions in the distillation loss.
    on_policy: share of each distillation batch made of draft-sampled continuations.
    on_policy_prefix: data tokens kept as the prompt of an on-policy sequence.
  """

  task: Task = "lm"
  steps: int = 1000
  batch_size: int = 16
  seq_len: int = 256
  learning_rate: float = 1e-3
  warmup_steps: int = 100
  final_lr_ratio: float = 0.1
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  seed: int = 0
  distill_loss: DistillLoss = "tv"
  distill_temperature: float = 1.0
  on_policy: float = 0.0
  on_policy_prefix: int = 32

  def __post_init__(self):
    if self.task not in ("lm", "distill"):
      raise ValueError(f"task must be 'lm' or 'distill', got {self.task!r}")
    if self.distill_loss not in ("tv", "fkl"):
      raise ValueError(f"distill_loss must be 'tv' or 'fkl', got {self.distill_loss!r}")
    if not 0.0 <= self.on_policy <= 1.0:
      raise ValueError(f"on_policy must be in [0, 1], got {self.on_policy}")
    if self.on_policy and not 0 < self.on_policy_prefix < self.seq_len:
      raise ValueError("on_policy_prefix must be in (0, seq_len)")

  @property
  def num_on_policy(self) -> int:
    return int(round(self.on_policy * self.batch_size))


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """Gradient clipping, then AdamW on a warmup + cosine schedule (no decay on vectors)."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=config.warmup_steps,
      decay_steps=max(config.steps, config.warmup_steps + 1),
      end_value=config.learning_rate * config.final_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  return optax.chain(
      optax.clip_by_global_norm(config.clip_norm),
      optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=config.weight_decay,
                  mask=decay_mask))


def init_state(model_config: ModelConfig, config: TrainConfig) -> dict:
  """A fresh train state: `{"params", "opt_state", "step", "rng"}` (a plain pytree)."""
  init_rng, run_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  params = init_params(model_config, init_rng).params
  return {"params": params, "opt_state": make_optimizer(config).init(params),
          "step": jnp.zeros((), jnp.int32), "rng": run_rng}


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats). logits `[B, T, V]` float32, labels `[B, T]`."""
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(log_probs, labels[..., None], axis=-1))


def tv_distance(target_logits: jax.Array, draft_logits: jax.Array,
                temperature: float = 1.0) -> jax.Array:
  """Per-position `1 - sum_x min(p(x), q(x))`: `[...]`, one minus the acceptance probability."""
  p = jax.nn.softmax(target_logits / temperature, axis=-1)
  q = jax.nn.softmax(draft_logits / temperature, axis=-1)
  return 1.0 - jnp.sum(jnp.minimum(p, q), axis=-1)


def forward_kl(target_logits: jax.Array, draft_logits: jax.Array,
               temperature: float = 1.0) -> jax.Array:
  """Per-position `KL(p || q)` of the warped distributions: `[...]`."""
  log_p = jax.nn.log_softmax(target_logits / temperature, axis=-1)
  log_q = jax.nn.log_softmax(draft_logits / temperature, axis=-1)
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def _logits(params, model_config, tokens):
  starts = jnp.zeros((tokens.shape[0],), jnp.int32)
  return forward(Model(params, model_config), tokens, starts).logits


def sample_continuations(model: Model, prefix: jax.Array, length: int, rng: jax.Array,
                         temperature: float = 1.0) -> jax.Array:
  """Samples `length` tokens after each row of `prefix` ([B, P]) with the model's KV cache.

  Returns:
    `[B, P + length]` int32: the prefix followed by the sampled tokens.
  """
  b, p = prefix.shape
  cache = model.init_cache(b, p + length, jnp.float32)
  out = forward(model, prefix, jnp.zeros((b,), jnp.int32), cache)

  def step(carry, key):
    logits, cache, position = carry
    token = jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)  # [B]
    out = forward(model, token[:, None], jnp.full((b,), position, jnp.int32), cache)
    return (out.logits[:, 0], out.cache, position + 1), token

  keys = jax.random.split(rng, length)
  _, sampled = jax.lax.scan(step, (out.logits[:, -1], out.cache, jnp.int32(p)), keys)
  return jnp.concatenate([prefix, sampled.T], axis=1)


@functools.partial(jax.jit, static_argnames=("model_config", "config"), donate_argnums=(0,))
def lm_step(state: dict, batch: jax.Array, *, model_config: ModelConfig,
            config: TrainConfig) -> tuple[dict, dict]:
  """One cross-entropy step on a `[B, T + 1]` batch; donates and returns the state."""
  def loss_fn(params):
    return cross_entropy(_logits(params, model_config, batch[:, :-1]), batch[:, 1:])

  loss, grads = jax.value_and_grad(loss_fn)(state["params"])
  return _apply(state, grads, config), {"loss": loss, "grad_norm": optax.tree.norm(grads)}


@functools.partial(jax.jit, static_argnames=("model_config", "config"), donate_argnums=(0,))
def distill_step(state: dict, batch: jax.Array, target: Model, *, model_config: ModelConfig,
                 config: TrainConfig) -> tuple[dict, dict]:
  """One distillation step: the draft matches the frozen `target` on `batch` ([B, T + 1]).

  With `config.on_policy`, the first `num_on_policy` rows keep `on_policy_prefix` data tokens and
  continue with tokens the current draft samples (no gradient through sampling).
  """
  rng, sample_rng = jax.random.split(state["rng"])
  tokens = batch[:, :-1]
  n = config.num_on_policy
  if n:
    prefix = tokens[:n, :config.on_policy_prefix]
    sampled = sample_continuations(Model(state["params"], model_config), prefix,
                                   tokens.shape[1] - config.on_policy_prefix, sample_rng)
    tokens = jnp.concatenate([sampled, tokens[n:]], axis=0)
  target_logits = jax.lax.stop_gradient(_logits(target.params, target.config, tokens))
  divergence = tv_distance if config.distill_loss == "tv" else forward_kl

  def loss_fn(params):
    draft_logits = _logits(params, model_config, tokens)
    per_position = divergence(target_logits, draft_logits, config.distill_temperature)
    return jnp.mean(per_position), draft_logits

  (loss, draft_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
  state = _apply(dict(state, rng=rng), grads, config)
  agree = jnp.mean(jnp.argmax(draft_logits, -1) == jnp.argmax(target_logits, -1))
  return state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "greedy_agreement": agree}


def _apply(state: dict, grads, config: TrainConfig) -> dict:
  updates, opt_state = make_optimizer(config).update(grads, state["opt_state"], state["params"])
  return dict(state, params=optax.apply_updates(state["params"], updates), opt_state=opt_state,
              step=state["step"] + 1)


# ----------------------------------------------------------------------------------------------
# Checkpoints of the train state.


def _manager(directory: str | os.PathLike, max_to_keep: int = 2):
  import orbax.checkpoint as ocp
  return ocp.CheckpointManager(
      pathlib.Path(directory).absolute(),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))


def save_state(directory: str | os.PathLike, state: dict, model_config: ModelConfig,
               config: TrainConfig) -> None:
  """Saves the full train state at its step (Orbax) plus the run's configs as JSON."""
  import orbax.checkpoint as ocp
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  meta = {"model_config": _config_dict(model_config), "train_config": dataclasses.asdict(config)}
  (directory / "run.json").write_text(json.dumps(meta, indent=2))
  manager = _manager(directory)
  manager.save(int(state["step"]), args=ocp.args.StandardSave(state))
  manager.wait_until_finished()
  manager.close()


def restore_state(directory: str | os.PathLike, model_config: ModelConfig,
                  config: TrainConfig) -> dict | None:
  """The latest saved train state in `directory`, or None if there is none."""
  import orbax.checkpoint as ocp
  if not pathlib.Path(directory).exists():
    return None
  manager = _manager(directory)
  step = manager.latest_step()
  if step is None:
    manager.close()
    return None
  abstract = jax.eval_shape(lambda: init_state(model_config, config))
  state = manager.restore(step, args=ocp.args.StandardRestore(abstract))
  manager.close()
  return state


def _config_dict(model_config: ModelConfig) -> dict:
  return {k: v for k, v in dataclasses.asdict(model_config).items()}


def config_from_dict(values: dict) -> ModelConfig:
  values = dict(values)
  if values.get("rope_scaling"):
    from specjax.models.config import RopeScaling
    values["rope_scaling"] = RopeScaling(**values["rope_scaling"])
  return ModelConfig(**values)


# ----------------------------------------------------------------------------------------------
# The loop.


def train(model_config: ModelConfig, config: TrainConfig, stream: np.ndarray, *,
          target: Model | None = None, checkpoint_dir: str | os.PathLike | None = None,
          checkpoint_every_s: float = 300.0, stop_at: int | None = None, progress: bool = True,
          log_path: str | os.PathLike | None = None) -> dict:
  """Runs (or resumes) training until `config.steps` (or `stop_at`) steps are done.

  Args:
    model_config: the architecture being trained.
    config: hyperparameters; `config.steps` fixes the schedule.
    stream: `[N]` int32 training tokens (`corpus.token_stream`).
    target: the frozen target, for `task="distill"`.
    checkpoint_dir: where to save and resume the train state; None = no checkpoints.
    checkpoint_every_s: wall-clock seconds between checkpoints (and one at the end).
    stop_at: stop after this many steps (a partial run, e.g. to test resuming).
    progress: show a rich progress bar with loss and tokens/s.
    log_path: append one JSON line of metrics per logged step.

  Returns:
    The final train state.
  """
  if config.task == "distill":
    if target is None:
      raise ValueError("task='distill' needs the target model")
    if target.vocab_size != model_config.vocab_size:
      raise ValueError("draft and target vocabularies differ")
    target = target.astype(jnp.float32)
  state = restore_state(checkpoint_dir, model_config, config) if checkpoint_dir else None
  if state is None:
    state = init_state(model_config, config)
  end = config.steps if stop_at is None else min(stop_at, config.steps)
  first = int(state["step"])
  tokens_per_step = config.batch_size * config.seq_len

  if config.task == "lm":
    step_fn = functools.partial(lm_step, model_config=model_config, config=config)
  else:
    step_fn = functools.partial(distill_step, target=target, model_config=model_config,
                                config=config)

  log = open(log_path, "a") if log_path else None
  bar = _Progress(first, end, enabled=progress)
  last_save = time.monotonic()
  start_time = time.monotonic()
  try:
    for step in range(first, end):
      batch = jnp.asarray(corpus.batch_at(stream, step, config.batch_size, config.seq_len,
                                          config.seed))
      state, metrics = step_fn(state, batch)
      done = step + 1
      if done % 10 == 0 or done == end:
        metrics = {k: float(v) for k, v in metrics.items()}
        elapsed = time.monotonic() - start_time
        rate = (done - first) * tokens_per_step / max(elapsed, 1e-9)
        bar.update(done, metrics["loss"], rate)
        if log:
          log.write(json.dumps({"step": done, "time": round(elapsed, 1),
                                "tokens_per_s": round(rate, 1), **metrics}) + "\n")
          log.flush()
      if checkpoint_dir and (time.monotonic() - last_save > checkpoint_every_s or done == end):
        save_state(checkpoint_dir, state, model_config, config)
        last_save = time.monotonic()
  finally:
    bar.close()
    if log:
      log.close()
  return state


class _Progress:
  """A rich progress bar showing loss and tokens/s (a no-op when disabled)."""

  def __init__(self, first: int, total: int, enabled: bool):
    self._bar = None
    if not enabled:
      return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                         TextColumn("loss {task.fields[loss]:.4f}"),
                         TextColumn("{task.fields[rate]:,.0f} tok/s"), TimeElapsedColumn(),
                         TimeRemainingColumn())
    self._bar.start()
    self._task = self._bar.add_task("train", total=total, completed=first, loss=float("nan"),
                                    rate=0.0)

  def update(self, step: int, loss: float, rate: float):
    if self._bar is not None:
      self._bar.update(self._task, completed=step, loss=loss, rate=rate)

  def close(self):
    if self._bar is not None:
      self._bar.stop()


# ----------------------------------------------------------------------------------------------
# Evaluation.


def evaluate(model: Model, windows: np.ndarray, target: Model | None = None,
             batch_size: int = 8) -> dict[str, float]:
  """Held-out metrics over `[W, T + 1]` windows.

  Returns:
    `{"loss", "perplexity"}` of the model on the data; with a `target`, also the mean
    total-variation distance to it (`tv`, one minus the sampling acceptance rate per position) and
    the share of positions where both argmaxes agree (`greedy_agreement`).
  """
  model = model.astype(jnp.float32)
  target = target.astype(jnp.float32) if target is not None else None

  @jax.jit
  def scores(model, target, batch):
    logits = _logits(model.params, model.config, batch[:, :-1])
    log_probs = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(log_probs, batch[:, 1:, None], -1)[..., 0]
    out = {"nll": jnp.sum(nll)}
    if target is not None:
      target_logits = _logits(target.params, target.config, batch[:, :-1])
      out["tv"] = jnp.sum(tv_distance(target_logits, logits))
      out["agree"] = jnp.sum(jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1))
    return out

  totals: dict[str, float] = {}
  count = 0
  for i in range(0, len(windows), batch_size):
    batch = jnp.asarray(windows[i:i + batch_size])
    for key, value in scores(model, target, batch).items():
      totals[key] = totals.get(key, 0.0) + float(value)
    count += batch.shape[0] * (batch.shape[1] - 1)
  loss = totals["nll"] / count
  result = {"loss": loss, "perplexity": math.exp(loss)}
  if target is not None:
    result["tv"] = totals["tv"] / count
    result["greedy_agreement"] = totals["agree"] / count
  return result


def acceptance(target: Model, draft: Model, windows: np.ndarray, *, prompt_len: int = 64,
               max_new_tokens: int = 64, num_draft: int = 4, batch_size: int = 8,
               check_generate: bool = False) -> dict:
  """Greedy speculative decoding from the first `prompt_len` tokens of each window.

  Returns:
    `{"acceptance_rate", "tokens_per_round", "accepted_per_position", "rounds", "drafted",
    "accepted"}` summed over all prompts, plus `"matches_generate"` (every row's tokens equal
    `specjax.generate`'s) when `check_generate`.
  """
  from specjax.decode import decode
  from specjax.generate import generate
  from specjax.sampling import Sampling
  greedy = Sampling(temperature=0.0)
  target, draft = target.astype(jnp.float32), draft.astype(jnp.float32)
  rng = jax.random.PRNGKey(0)
  totals = {"rounds": 0, "drafted": 0, "accepted": 0}
  per_position = np.zeros((num_draft,), np.int64)
  matches = True
  for i in range(0, len(windows), batch_size):
    prompts = jnp.asarray(windows[i:i + batch_size, :prompt_len])
    out = decode(target, draft, prompts, rng, max_new_tokens=max_new_tokens,
                 num_draft=num_draft, sampling=greedy)
    summary = out.stats.summary()
    for key in totals:
      totals[key] += summary[key]
    per_position += np.asarray(summary["accepted_per_position"], np.int64)
    if check_generate:
      reference = generate(target, prompts, rng, max_new_tokens=max_new_tokens, sampling=greedy)
      matches &= bool(np.array_equal(np.asarray(reference.tokens), np.asarray(out.tokens)))
  result = dict(totals,
                acceptance_rate=totals["accepted"] / max(totals["drafted"], 1),
                tokens_per_round=(totals["accepted"] + totals["rounds"]) / max(totals["rounds"], 1),
                accepted_per_position=per_position.tolist())
  if check_generate:
    result["matches_generate"] = matches
  return result


# ----------------------------------------------------------------------------------------------
# Tokenizer and data.


def train_tokenizer(documents, vocab_size: int = 8192, path: str | os.PathLike | None = None):
  """Trains a byte-level BPE (`tokenizers`) with `<pad>`=0, `<bos>`=1, `<eos>`=2.

  Encoding with special tokens prepends `<bos>`, as every training document starts with it.

  Args:
    documents: `corpus.Document`s (the training split only).
    vocab_size: total vocabulary including the special tokens.
    path: where to save `tokenizer.json`; None = do not save.

  Returns:
    The `tokenizers.Tokenizer`.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator((d.text for d in documents), trainer, length=len(documents))
  tokenizer.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
  if path is not None:
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
  return tokenizer


def corpus_stream(tokenizer_path: str | os.PathLike, split: corpus.Split = "train",
                  cache_dir: str | os.PathLike | None = None) -> np.ndarray:
  """The token stream of a corpus split, encoded with a `tokenizer.json` (cached as .npy)."""
  from tokenizers import Tokenizer
  tokenizer = Tokenizer.from_file(str(tokenizer_path))
  documents = corpus.load(split)
  key = corpus.file_list_hash(d.path for d in documents)
  cache = None
  if cache_dir is not None:
    digest = _file_digest(tokenizer_path)
    cache = pathlib.Path(cache_dir) / f"stream-{split}-{key}-{digest}.npy"
    if cache.exists():
      return np.load(cache)

  def encode(texts):
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

  stream = corpus.token_stream(encode, documents, tokenizer.token_to_id(BOS),
                               tokenizer.token_to_id(EOS))
  if cache is not None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.save(cache, stream)
  return stream


def _file_digest(path) -> str:
  import hashlib
  return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:12]


def state_model(state: dict, model_config: ModelConfig) -> Model:
  """The model held by a train state."""
  return Model(state["params"], model_config)


def load_run(directory: str | os.PathLike) -> tuple[Model, TrainConfig, Any]:
  """The model of the latest train state saved in a run directory, with its configs."""
  meta = json.loads((pathlib.Path(directory) / "run.json").read_text())
  model_config = config_from_dict(meta["model_config"])
  config = TrainConfig(**meta["train_config"])
  state = restore_state(directory, model_config, config)
  if state is None:
    raise FileNotFoundError(f"no train state in {directory}")
  return state_model(state, model_config), config, state


# ----------------------------------------------------------------------------------------------
# Command line (`specjax train ...`).


TASKS = {
    "tokenizer": "train the byte-level BPE tokenizer",
    "lm": "cross-entropy on the corpus (target or data-only draft)",
    "distill": "train a draft to match a trained target",
    "evaluate": "held-out perplexity of --target-run and of each --run-dir draft, and their "
                "greedy acceptance",
    "export": "write --target-run and --run-dir as a toy pair into --out",
}


def add_arguments(parser) -> None:
  """Declares the arguments of `specjax train {tokenizer,lm,distill,evaluate,export}` (the task
  itself is the subcommand)."""
  parser.add_argument("--tokenizer", default="checkpoints/toy/tokenizer.json",
                      help="tokenizer.json to read (or, for the tokenizer task, to write)")
  parser.add_argument("--vocab-size", type=int, default=8192)
  parser.add_argument("--model", default="target", help="architecture preset: target, draft, tiny")
  parser.add_argument("--run-dir", action="append",
                      help="train-state checkpoints; an existing run is resumed (evaluate: may be "
                      "repeated, one per draft)")
  parser.add_argument("--out", default="checkpoints/toy", help="export: destination directory")
  parser.add_argument("--eval-windows", type=int, default=64,
                      help="evaluate: held-out windows of --seq-len tokens for perplexity")
  parser.add_argument("--eval-prompts", type=int, default=32,
                      help="evaluate: held-out prompts for the acceptance measurement")
  parser.add_argument("--target-run", help="run directory of the target (distill)")
  parser.add_argument("--steps", type=int, default=1000)
  parser.add_argument("--stop-at", type=int, help="stop after this step (resume later)")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=256)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--warmup", type=int, default=100)
  parser.add_argument("--weight-decay", type=float, default=0.1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--loss", choices=("tv", "fkl"), default="tv", help="distillation loss")
  parser.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
  parser.add_argument("--on-policy", type=float, default=0.0,
                      help="share of each distillation batch sampled by the draft")
  parser.add_argument("--checkpoint-every", type=float, default=300.0, help="seconds")
  parser.add_argument("--no-progress", action="store_true")


def run_cli(args) -> int:
  """Runs `specjax train` with parsed arguments."""
  if args.task == "tokenizer":
    train_tokenizer(corpus.load("train"), args.vocab_size, args.tokenizer)
    print(f"wrote {args.tokenizer}")
    return 0
  if not args.run_dir:
    raise ValueError("--run-dir is required")
  if args.task == "evaluate":
    return _evaluate_cli(args)
  if args.task == "export":
    from specjax.default import export
    target, _, _ = load_run(args.target_run)
    draft, _, _ = load_run(args.run_dir[0])
    print(f"wrote {export(target, draft, args.tokenizer, args.out)}")
    return 0
  run_dir = args.run_dir[0]
  stream = corpus_stream(args.tokenizer, "train", cache_dir=pathlib.Path(run_dir) / "cache")
  from tokenizers import Tokenizer
  vocab_size = Tokenizer.from_file(str(args.tokenizer)).get_vocab_size()
  model_config = model_preset(args.model, vocab_size)
  config = TrainConfig(task=args.task, steps=args.steps, batch_size=args.batch_size,
                       seq_len=args.seq_len, learning_rate=args.lr, warmup_steps=args.warmup,
                       weight_decay=args.weight_decay, seed=args.seed, distill_loss=args.loss,
                       distill_temperature=args.temperature, on_policy=args.on_policy)
  target = None
  if args.task == "distill":
    if not args.target_run:
      raise ValueError("distill needs --target-run")
    target, _, _ = load_run(args.target_run)
  print(f"{args.task}: {args.model} ({model_config.num_params() / 1e6:.2f}M params), "
        f"{len(stream):,} training tokens, {config.steps} steps of "
        f"{config.batch_size}x{config.seq_len}", flush=True)
  train(model_config, config, stream, target=target, checkpoint_dir=run_dir,
        checkpoint_every_s=args.checkpoint_every, stop_at=args.stop_at,
        progress=not args.no_progress, log_path=pathlib.Path(run_dir) / "log.jsonl")
  return 0


def _evaluate_cli(args) -> int:
  heldout = corpus_stream(args.tokenizer, "heldout")
  windows = corpus.eval_windows(heldout, args.seq_len, args.eval_windows)
  # Acceptance prompts: evenly spaced held-out windows, not the perplexity windows.
  spaced = corpus.eval_windows(heldout, args.seq_len)
  prompts = spaced[np.linspace(0, len(spaced) - 1, args.eval_prompts).astype(int)]
  target = load_run(args.target_run)[0] if args.target_run else None
  report = {"heldout_tokens": int(len(heldout)), "eval_tokens": int(windows[:, 1:].size),
            "acceptance_prompts": len(prompts)}
  print(json.dumps(report), flush=True)
  if target is not None:
    report["target"] = evaluate(target, windows)
    print(json.dumps({"target": report["target"]}), flush=True)
  for run_dir in args.run_dir:
    draft = load_run(run_dir)[0]
    result = evaluate(draft, windows, target=target)
    if target is not None:
      result["greedy_k4"] = acceptance(target, draft, prompts, num_draft=4, check_generate=True)
    report[str(run_dir)] = result
    print(json.dumps({str(run_dir): result}), flush=True)
  return 0
