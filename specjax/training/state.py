"""The train state of LM / draft training: config, optimizer, Orbax checkpoints, presets.

The train state (params, optimizer state, step, rng) is one pytree. It is saved with
`specjax.io.orbax.save_tree` under `state_NNNNNNNN/` in the run directory (the newest two are
kept) beside `run.json` (the model and train configs)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from specjax.models.config import ModelConfig
from specjax.models.transformer import Model, init_params


Task = Literal["lm", "distill"]
DistillLoss = Literal["tv", "fkl"]

STATE_PREFIX = "state_"


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

def apply_gradients(state: dict, grads, config: TrainConfig) -> dict:
  """One optimizer update of `state` with `grads` (the step counter advances)."""
  updates, opt_state = make_optimizer(config).update(grads, state["opt_state"], state["params"])
  return dict(state, params=optax.apply_updates(state["params"], updates), opt_state=opt_state,
              step=state["step"] + 1)


def save_state(directory: str | os.PathLike, state: dict, model_config: ModelConfig,
               config: TrainConfig, keep: int = 2) -> None:
  """Saves the full train state at its step (Orbax) plus the run's configs as JSON."""
  from specjax.io.orbax import config_to_dict, save_tree
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  meta = {"model_config": config_to_dict(model_config),
          "train_config": dataclasses.asdict(config)}
  (directory / "run.json").write_text(json.dumps(meta, indent=2))
  step = int(state["step"])
  save_tree(directory / f"{STATE_PREFIX}{step:08d}", state, {"step": step}, overwrite=True)
  for old in _state_dirs(directory)[:-keep]:
    shutil.rmtree(old, ignore_errors=True)


def _state_dirs(directory: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p for p in directory.iterdir() if p.name.startswith(STATE_PREFIX))


def restore_state(directory: str | os.PathLike, model_config: ModelConfig,
                  config: TrainConfig) -> dict | None:
  """The latest restorable train state in `directory`, or None if there is none."""
  from specjax.io.orbax import restore_tree
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    return None
  abstract = jax.eval_shape(lambda: init_state(model_config, config))
  for path in reversed(_state_dirs(directory)):
    try:
      return restore_tree(path, abstract)[0]
    except (ValueError, FileNotFoundError):  # an interrupted save: fall back to the previous one
      continue
  return None


def load_run(directory: str | os.PathLike) -> tuple[Model, TrainConfig, Any]:
  """The model of the latest train state saved in a run directory, with its configs."""
  from specjax.io.orbax import config_from_dict
  meta = json.loads((pathlib.Path(directory) / "run.json").read_text())
  model_config = config_from_dict(meta["model_config"])
  config = TrainConfig(**meta["train_config"])
  state = restore_state(directory, model_config, config)
  if state is None:
    raise FileNotFoundError(f"no train state in {directory}")
  return state_model(state, model_config), config, state

def state_model(state: dict, model_config: ModelConfig) -> Model:
  """The model held by a train state."""
  return Model(state["params"], model_config)
