"""Training a DFlash block drafter with optax, on the target's own answers (self-distillation).

Data: `specjax.training.selfdistill.generate_chunks` chunks (the target's answers to
training-template prompts, with its features at every position from the very forward that
produced them: the taps and the final normed hidden state). A drafter reading `target_layer_ids`
`(1, 14, 26, 29)` of a 30-layer target uses the taps `(2, 15, 27)` and the final hidden state.

Loss (DFlash's): per training row, `M` anchors `a` drawn uniformly inside the target's own
answer (`prompt_length - 1 <= a <= length - 2`); each anchor's block `[token_a, MASK x (B - 1)]`
at positions `a .. a + B - 1` sees the context entries of positions `< a` (as at decode, where the
anchor is the last verified token) and its own block bidirectionally; cross-entropy of slot `k`
against `token_{a+k}`, `k = 1 .. B - 1`, weighted by `exp(-(k - 1) / gamma)` (early slots decide
acceptance), over the slots inside the row. All anchors of a row share one context projection.

`train_dflash` runs AdamW (warmup, cosine decay, clipping) for a step count or a wall-clock
budget, checkpointing in the published layout (`specjax.drafters.dflash.checkpoint.save_dflash`),
so the result loads with `load_dflash` exactly as z-lab's files do.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.drafters.dflash import network as dflash
from specjax.drafters.dflash.checkpoint import save_dflash, target_tables
from specjax.training.selfdistill import chunk_path, load_chunk

__all__ = ["DFlashBatches", "block_weights", "dflash_loss", "init_from_target", "train_dflash"]


def block_weights(block_size: int, gamma: float) -> np.ndarray:
  """`[B - 1]` loss weights of slots `1 .. B - 1`: `exp(-(k - 1) / gamma)`."""
  return np.exp(-np.arange(block_size - 1) / gamma).astype(np.float32)


def init_from_target(config: dflash.DFlashConfig, target, rng: jax.Array) -> dflash.DFlashNetwork:
  """A drafter whose layers start as copies of the target's last layers (same widths), whose final
  norm is the target's, and whose `fc` starts by passing the last context feature through (plus
  small noise): a starting point that already predicts the next token somewhat."""
  network = dflash.init_network(config, rng, scale=0.02)
  stacked = target.stacked()  # canonical per-layer weights, whatever the target's layout
  src = stacked.params["layers"]
  first = stacked.config.num_layers - config.num_layers
  layers = []
  for i, layer in enumerate(network.params["layers"]):
    j = first + i
    copy = dict(layer)
    for ours, theirs in (("input_norm", "attn_norm"), ("wq", "wq"), ("wk", "wk"), ("wv", "wv"),
                         ("wo", "wo"), ("mlp_norm", "mlp_norm"), ("w_gate", "w_gate"),
                         ("w_up", "w_up"), ("w_down", "w_down"), ("q_norm", "q_norm"),
                         ("k_norm", "k_norm")):
      if theirs in src and src[theirs][j].shape == layer[ours].shape:
        copy[ours] = jnp.asarray(src[theirs][j], jnp.float32)
    layers.append(copy)
  e = config.embed_dim
  n = len(config.target_layer_ids)
  fc = network.params["fc"].at[(n - 1) * e:].add(jnp.eye(e))
  params = dict(network.params, layers=tuple(layers), fc=fc,
                norm=jnp.asarray(stacked.params["final_norm"], jnp.float32))
  return dflash.DFlashNetwork(params, config)


def dflash_loss(params, config: dflash.DFlashConfig, embed, head, batch: dict):
  """Mean weighted cross-entropy of the blocks of `batch` (see the module docstring).

  Args:
    params: the drafter's params; config: its config.
    embed: `[V, H]` the target's embedding; head: `[H, V]` its output projection.
    batch: `features [n, R, T, H]` (in `target_layer_ids` order), `tokens [R, T]` int32,
      `anchors [R, M]` int32, `weights [R, M, B - 1]` float32 (0 outside the row).

  Returns:
    `(loss, metrics)`: metrics `accuracy` (slot-1 argmax equals the target's token, weighted by
    whether slot 1 counts) and `accuracy_all` (every counted slot).
  """
  network = dflash.DFlashNetwork(params, config)
  features, tokens = batch["features"], batch["tokens"]
  anchors, weights = batch["anchors"], batch["weights"]
  rows, length = tokens.shape
  num_anchors, size = anchors.shape[1], config.block_size
  context = dflash.project_context(network, features)  # [R, T, H]
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (rows, length))
  keys, values = dflash.context_kv(network, context, positions)  # [N, R, T, KVH, D]
  keys = jnp.repeat(keys, num_anchors, axis=1)  # [N, R*M, T, KVH, D]
  values = jnp.repeat(values, num_anchors, axis=1)
  flat = anchors.reshape(-1)  # [R*M]
  anchor_tokens = jnp.take_along_axis(tokens, anchors, axis=1).reshape(-1)
  block = jnp.concatenate([anchor_tokens[:, None],
                           jnp.full((flat.shape[0], size - 1), config.mask_token_id, jnp.int32)],
                          axis=1)
  block_positions = flat[:, None] + jnp.arange(size, dtype=jnp.int32)[None]
  visible = jnp.arange(length)[None] < flat[:, None]
  hidden = dflash.block_hidden(network, jnp.take(embed, block, axis=0), block_positions, keys,
                               values, visible)
  logits = dflash.output_logits(config, hidden[:, 1:], head)  # [R*M, B - 1, V]
  target_index = jnp.clip(block_positions[:, 1:], 0, length - 1)
  targets = jnp.take_along_axis(jnp.repeat(tokens, num_anchors, axis=0), target_index, axis=1)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]  # [R*M, B - 1]
  w = weights.reshape(nll.shape)
  loss = jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1e-6)
  hit = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  counted = (w > 0).astype(jnp.float32)
  metrics = {"accuracy": jnp.sum(hit[:, 0] * counted[:, 0]) / jnp.maximum(counted[:, 0].sum(), 1),
             "accuracy_all": jnp.sum(hit * counted) / jnp.maximum(counted.sum(), 1)}
  return loss, metrics


class DFlashBatches:
  """Training batches from self-distillation chunks: `rows` rows of up to `seq_len` tokens, `M`
  anchors each inside the row's answer (module docstring)."""

  def __init__(self, directory, chunks, config: dflash.DFlashConfig, *, rows: int,
               anchors: int, seq_len: int, gamma: float, seed: int = 0):
    self.directory = pathlib.Path(directory)
    self.chunks = list(chunks)
    self.config = config
    self.rows, self.anchors, self.seq_len = rows, anchors, seq_len
    self.slot_weights = block_weights(config.block_size, gamma)
    self.rng = np.random.default_rng(seed)
    self._loaded = {}

  def _chunk(self, index: int) -> dict:
    if index not in self._loaded:
      self._loaded[index] = load_chunk(chunk_path(self.directory, index))
    return self._loaded[index]

  def next(self) -> dict:
    c = self.config
    size = c.block_size
    tokens = np.zeros((self.rows, self.seq_len), np.int32)
    taps, hidden = [], []
    anchors = np.zeros((self.rows, self.anchors), np.int32)
    weights = np.zeros((self.rows, self.anchors, size - 1), np.float32)
    for r in range(self.rows):
      while True:
        chunk = self._chunk(int(self.rng.choice(self.chunks)))
        row = int(self.rng.integers(chunk["tokens"].shape[0]))
        prompt, length = int(chunk["prompt_lengths"][row]), int(chunk["lengths"][row])
        if length - prompt >= 2:
          break
      # A window of seq_len tokens that ends inside the answer and holds the anchors' blocks.
      end = int(self.rng.integers(prompt + 1, length + 1))
      start = max(0, min(end, length) - self.seq_len)
      end = min(length, start + self.seq_len)
      width = end - start
      tokens[r, :width] = chunk["tokens"][row, start:end]
      t = np.zeros((self.seq_len,) + chunk["taps"].shape[2:], np.float16)
      t[:width] = chunk["taps"][row, start:end]
      h = np.zeros((self.seq_len, chunk["hidden"].shape[-1]), np.float16)
      h[:width] = chunk["hidden"][row, start:end]
      taps.append(t)
      hidden.append(h)
      low, high = max(prompt - 1 - start, 0), width - 2  # anchors inside the answer
      a = self.rng.integers(low, max(high, low) + 1, self.anchors)
      anchors[r] = a
      inside = (a[:, None] + np.arange(1, size)[None]) < width
      weights[r] = inside * self.slot_weights[None]
    taps = np.moveaxis(np.stack(taps), 2, 0)  # [n_taps, R, T, H]
    hidden = np.stack(hidden)
    features = dflash.gather_features(c, jnp.asarray(taps, jnp.float32) if len(c.taps) else None,
                                      jnp.asarray(hidden, jnp.float32))
    return {"features": features, "tokens": jnp.asarray(tokens), "anchors": jnp.asarray(anchors),
            "weights": jnp.asarray(weights)}


def train_dflash(network: dflash.DFlashNetwork, target, batches: DFlashBatches, out_dir, *,
                 steps: int, minutes: float | None = None, learning_rate: float = 1e-3,
                 warmup: int = 50, clip: float = 1.0, save_every: int = 200,
                 log: Callable[[str], None] = print) -> dflash.DFlashNetwork:
  """AdamW on `dflash_loss` for `steps` steps or `minutes` of wall clock, whichever ends first;
  saves the network in the published layout under `out_dir` every `save_every` steps and at the
  end (`save_dflash`), and appends one JSON line per logged step to `out_dir/log.jsonl`."""
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  config = network.config
  embed, head = target_tables(target)
  embed, head = jnp.asarray(embed, jnp.float32), jnp.asarray(head, jnp.float32)
  schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1),
                                                learning_rate * 0.05)
  optimizer = optax.chain(optax.clip_by_global_norm(clip),
                          optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.0))
  params = network.params
  opt_state = optimizer.init(params)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    (loss, metrics), grads = jax.value_and_grad(
        lambda p: dflash_loss(p, config, embed, head, batch), has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, metrics

  began = time.perf_counter()
  logfile = (out_dir / "log.jsonl").open("a")
  done = 0
  for index in range(steps):
    params, opt_state, loss, metrics = step(params, opt_state, batches.next())
    done = index + 1
    if index % 20 == 0 or done == steps:
      line = json.dumps(dict(step=index, loss=round(float(loss), 4),
                             accuracy=round(float(metrics["accuracy"]), 4),
                             accuracy_all=round(float(metrics["accuracy_all"]), 4),
                             seconds=round(time.perf_counter() - began, 1)))
      log(line)
      logfile.write(line + "\n")
      logfile.flush()
    if done % save_every == 0:
      save_dflash(dflash.DFlashNetwork(params, config), out_dir / "drafter")
    if minutes is not None and time.perf_counter() - began > 60 * minutes:
      break
  logfile.close()
  trained = dflash.DFlashNetwork(params, config)
  save_dflash(trained, out_dir / "drafter")
  (out_dir / "train.json").write_text(json.dumps(dict(
      steps=done, seconds=round(time.perf_counter() - began, 1), learning_rate=learning_rate,
      rows=batches.rows, anchors=batches.anchors, seq_len=batches.seq_len,
      config=dataclasses.asdict(config)), indent=2))
  return trained
