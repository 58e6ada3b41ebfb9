"""Training with optax, as one namespace (the code lives in `specjax.training`).

- `specjax.training.state`: `TrainConfig`, the optimizer, the train state and its Orbax checkpoints,
  model presets, `load_run`.
- `specjax.training.lm` / `distill`: one jitted step each (cross-entropy; TV or forward-KL
  distillation, optionally on-policy); `specjax.training.loop.train` runs them, resumably.
- `specjax.training.evaluate`: held-out perplexity, distance to a target, greedy acceptance.
- `specjax.training.data`: the byte-level BPE tokenizer and cached corpus token streams.
- `specjax.training.heads` / `head_run` / `selfdistill`: draft heads (EAGLE-3, MTP, Medusa) on
  the target's own features, `train_head`.
"""

from specjax.training.cli import TASKS, add_arguments, run_cli
from specjax.training.data import BOS, EOS, PAD, SPECIAL_TOKENS, corpus_stream, train_tokenizer
from specjax.training.distill import distill_step, sample_continuations
from specjax.training.evaluate import acceptance, evaluate
from specjax.training.head_run import train_head
from specjax.training.heads import HeadTrainConfig
from specjax.training.lm import lm_step, logits_of
from specjax.training.losses import cross_entropy, forward_kl, tv_distance
from specjax.training.loop import train
from specjax.training.state import (DistillLoss, Task, TrainConfig, init_state, load_run,
                                    make_optimizer, model_preset, restore_state, save_state,
                                    state_model)

__all__ = [
    "BOS", "EOS", "PAD", "SPECIAL_TOKENS", "TASKS", "DistillLoss", "HeadTrainConfig", "Task",
    "TrainConfig", "acceptance", "add_arguments", "corpus_stream", "cross_entropy",
    "distill_step", "evaluate", "forward_kl", "init_state", "lm_step", "load_run", "logits_of",
    "make_optimizer", "model_preset", "restore_state", "run_cli", "sample_continuations",
    "save_state", "state_model", "train", "train_head", "train_tokenizer", "tv_distance",
]
