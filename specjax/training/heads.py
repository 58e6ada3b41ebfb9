"""Training draft heads (EAGLE-3, MTP, Medusa) on the target's own distribution, with optax.

EAGLE-3's training-time test: the head is unrolled `ttt_steps` times on its own output features,
as at inference. Chain `i` starts from the true pairs `0..i` (step 0 is an ordinary causal pass
over `(feature_t, token_{t+1})`); step `j` feeds the head's previous output for chain `i` with
token `i + 1 + j` at position `i + j`, attending to the true pairs `<= i` and to the chain's own
earlier steps (their keys sit on the diagonal), and predicts token `i + 2 + j`. The loss is
`sum_j 0.8^j * soft-CE(p_j, q_j)` where `p_j` is the target's distribution at that position
restricted to the draft vocabulary and renormalised, averaged over answer positions whose target
argmax lies in the draft vocabulary. Medusa head `i` at position `t` is trained the same way
against the target's distribution for token `t + 2 + i`.

A parallel EAGLE head (`parallel=True`, P-EAGLE-style) is unrolled the same way except that steps
`j >= 2` read the head's learned placeholders (`parallel_embed[j - 2]`, `parallel_feature[j - 2]`)
in place of the previous step's output and token `i + 1 + j`: at inference those slots come out
of one forward, before any of the drafts they precede exist. It gets `ttt_steps - 2` placeholders
and drafts up to `ttt_steps` tokens a round.

The target's features (taps, final hidden state) and its top-k logits are recorded once, by the
forward passes that generated the data (`specjax.training.selfdistill`), so training never runs
the target. The train state is one pytree (`params`, `opt_state`, `step`) updated by
a step that donates it; batches are a pure function of the step (`HeadData.batch_at`), so a resumed
run equals an uninterrupted one bitwise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.drafters.eagle import network as eagle
from specjax.drafters.eagle.parallel import placeholders
from specjax.drafters.medusa import network as medusa
from specjax.models.transformer import Model

HeadKind = Literal["eagle3", "mtp", "medusa"]


@dataclasses.dataclass(frozen=True)
class HeadTrainConfig:
  """Hyperparameters of one head-training run.

  Attributes:
    kind: "eagle3", "mtp" or "medusa".
    steps: optimizer steps of the whole run (the schedule's length).
    batch_size: conversations per step.
    seq_len: window length (a conversation is cut or padded to it).
    ttt_steps: training-time-test unroll depth (EAGLE/MTP); Medusa: number of heads.
    parallel: EAGLE/MTP only: a parallel-drafting head with `ttt_steps - 2` placeholder slots
      (see the module docstring; needs `ttt_steps >= 3`).
    step_weight: weight `w^j` of unroll step / Medusa head `j`.
    draft_vocab_size: `N`, the most frequent answer ids.
    learning_rate / warmup_steps / final_lr_ratio: AdamW peak, linear warmup, cosine floor.
    weight_decay: decoupled weight decay on matrices.
    clip_norm: global gradient-norm clipping.
    b1 / b2: AdamW betas.
    seed: initialisation and data order.
  """

  kind: HeadKind = "eagle3"
  steps: int = 1000
  batch_size: int = 8
  seq_len: int = 256
  ttt_steps: int = 5
  parallel: bool = False
  step_weight: float = 0.8
  draft_vocab_size: int = 8192
  learning_rate: float = 1e-3
  warmup_steps: int = 50
  final_lr_ratio: float = 0.05
  weight_decay: float = 0.0
  clip_norm: float = 0.5
  b1: float = 0.9
  b2: float = 0.95
  seed: int = 0

  def __post_init__(self):
    if self.kind not in ("eagle3", "mtp", "medusa"):
      raise ValueError(f"kind must be eagle3, mtp or medusa, got {self.kind!r}")
    for name in ("steps", "batch_size", "seq_len", "ttt_steps", "draft_vocab_size"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"HeadTrainConfig.{name} must be >= 1")
    if self.parallel and (self.kind == "medusa" or self.ttt_steps < 3):
      raise ValueError("a parallel head is an EAGLE-3 or MTP head with ttt_steps >= 3 (two "
                       f"ordinary steps, then placeholders); got kind {self.kind!r}, ttt_steps "
                       f"{self.ttt_steps}")
    if not 0 <= self.warmup_steps <= self.steps:
      raise ValueError("warmup_steps must lie in [0, steps]")


def make_optimizer(config: HeadTrainConfig) -> optax.GradientTransformation:
  """Clip, then AdamW with linear warmup and cosine decay; decay only on matrices."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, max(config.warmup_steps, 1), config.steps,
      end_value=config.learning_rate * config.final_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  return optax.chain(optax.clip_by_global_norm(config.clip_norm),
                     optax.adamw(schedule, b1=config.b1, b2=config.b2,
                                 weight_decay=config.weight_decay, mask=decay_mask))


def init_network(config: HeadTrainConfig, target: Model, draft_ids: np.ndarray):
  """A fresh EagleHead (eagle3/mtp) or MedusaHeads for `target` over `draft_ids`."""
  if config.kind == "medusa":
    mc = medusa.MedusaConfig(target.config.embed_dim, config.ttt_steps, len(draft_ids),
                             target.config.vocab_size)
    return medusa.init_medusa(mc, target, draft_ids)
  hc = eagle.head_config_for(target.config, kind=config.kind, draft_vocab_size=len(draft_ids),
                             parallel=config.ttt_steps - 2 if config.parallel else 0)
  return eagle.init_head(hc, target, jax.random.PRNGKey(config.seed), draft_ids)


def split_network(network):
  """`(trainable params without d2t, d2t, static config)`."""
  params = dict(network.params)
  d2t = params.pop("d2t")
  return params, d2t, network.config


def join_network(params: dict, d2t: jax.Array, static):
  full = {**params, "d2t": d2t}
  if isinstance(static, medusa.MedusaConfig):
    return medusa.MedusaHeads(full, static)
  return eagle.EagleHead(full, static)


def extend_draft_vocab(head: eagle.EagleHead, target: Model, draft_ids) -> eagle.EagleHead:
  """The same head over a larger draft vocabulary that contains its own.

  The LM-head columns of the ids the head already has are kept. Each new id's column is the
  target's output row for it, carried through the linear map `A` that best takes the target's
  rows of the old ids to the head's trained columns (least squares, `A T_old ~ W_old`): training
  moved the head's columns away from the target's rows (scale, the head's own final norm), and raw
  target rows beside trained columns would outscore them and take over its drafts. On the old ids
  the logits are exactly the old head's.

  Args:
    head: the head.
    target: the target it drafts for (its output projection initialises the new columns).
    draft_ids: strictly increasing target ids, a superset of `head.draft_ids`.

  Returns:
    An `EagleHead` whose config has `draft_vocab_size = len(draft_ids)`.
  """
  c = head.config
  ids = eagle._check_draft_ids(draft_ids, c.vocab_size, np.asarray(draft_ids).size)
  old = np.asarray(head.draft_ids)
  if not np.isin(old, ids).all():
    raise ValueError("the new draft vocabulary must contain every id of the head's own")
  where = np.searchsorted(ids, old)
  rows = np.asarray(eagle.target_output_head(target), np.float64)[:, ids]  # [E, N]
  trained = np.asarray(head.params["lm_head"], np.float64)  # [E, n_old]
  fit = np.linalg.lstsq(rows[:, where].T, trained.T, rcond=None)[0]  # A.T: rows.T @ A.T ~ W.T
  lm_head = (fit.T @ rows).astype(np.float32)
  lm_head[:, where] = trained  # the old columns exactly (float32 -> float64 -> float32)
  params = {**head.params, "lm_head": lm_head.astype(head.params["lm_head"].dtype),
            "d2t": jnp.asarray(ids - np.arange(ids.shape[0]), jnp.int32)}
  return eagle.EagleHead(params, dataclasses.replace(c, draft_vocab_size=int(ids.shape[0])))


def init_state(config: HeadTrainConfig, params: dict) -> dict:
  state = {"params": params, "opt_state": make_optimizer(config).init(params),
             "step": jnp.zeros((), jnp.int32)}
  return jax.tree.map(jnp.array, state)  # distinct buffers: the train step donates the state


# ---------------------------------------------------------------------------------------------
# Targets and losses


def cached_signals(top_logits: jax.Array, top_ids: jax.Array, draft_index: jax.Array):
  """The teacher from the target's recorded top-k logits.

  Args:
    top_logits: `[B, T, K]` the target's largest logits (descending) at every position.
    top_ids: `[B, T, K]` their target ids.
    draft_index: `[V]` int32 draft id of every target id, -1 outside the draft vocabulary.

  Returns:
    `(probs [B, T, K] float32, slots [B, T, K] int32, in_vocab [B, T] bool, argmax [B, T])`:
    the target's distribution restricted to the top-k ids that lie in the draft vocabulary,
    renormalised (zero elsewhere), those ids' draft slots (0 where outside), whether the target's
    argmax lies in the draft vocabulary, and the argmax (target id).
  """
  slots = draft_index[top_ids]  # [B, T, K]
  inside = slots >= 0
  logits = jnp.where(inside, top_logits.astype(jnp.float32), -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  probs = jnp.where(inside.any(-1, keepdims=True), probs, 0.0)
  return probs, jnp.maximum(slots, 0), inside[..., 0], top_ids[..., 0]


def soft_cross_entropy(probs: jax.Array, logits: jax.Array, slots: jax.Array | None = None
                       ) -> jax.Array:
  """`-sum_x p(x) log q(x)` over the last axis (q = softmax(logits)); with `slots [..., K]` the
  teacher `probs [..., K]` is sparse: mass `probs[k]` sits on draft id `slots[k]`."""
  log_q = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  if slots is not None:
    log_q = jnp.take_along_axis(log_q, slots, axis=-1)
  return -jnp.sum(probs * log_q, axis=-1)


def _shift(x: jax.Array, by: int, fill=0) -> jax.Array:
  """`x[:, t + by]` at `t` (axis 1), `fill` past the end."""
  if by == 0:
    return x
  pad = jnp.full((x.shape[0], by) + x.shape[2:], fill, x.dtype)
  return jnp.concatenate([x[:, by:], pad], axis=1)


def _ttt_attention(q, k0, v0, diag_k, diag_v, scale):
  """Attention of unroll step j: the true pairs `s <= t` plus the chain's own steps 1..j.

  Args:
    q: `[B, T, H, D]`; k0, v0: `[B, T, KVH, D]` keys/values of step 0 (the true pairs);
    diag_k, diag_v: lists of `[B, T, KVH, D]`, chain `t`'s keys/values of steps 1..j.

  Returns:
    `[B, T, H*D]`.
  """
  b, t, h, d = q.shape
  kvh = k0.shape[2]
  qg = q.reshape(b, t, kvh, h // kvh, d)
  causal = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32) * scale
  visible = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T(query), S]
  causal = jnp.where(visible, causal, jnp.finfo(jnp.float32).min)
  diag = [jnp.einsum("btkgd,btkd->bkgt", qg, k, preferred_element_type=jnp.float32)[..., None]
          * scale for k in diag_k]
  probs = jax.nn.softmax(jnp.concatenate([causal] + diag, axis=-1), axis=-1)
  out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v0.astype(jnp.float32))
  for s, v in enumerate(diag_v):
    out = out + jnp.einsum("bkgt,btkd->btkgd", probs[..., t + s], v.astype(jnp.float32))
  return out.reshape(b, t, h * d).astype(q.dtype)


def eagle_unroll(head: eagle.EagleHead, embed: jax.Array, tokens: jax.Array, source: jax.Array,
                 num_steps: int) -> list[jax.Array]:
  """The head's draft logits of every unroll step: list of `[B, T, N]`, step `j` at chain `t`
  predicting token `t + 2 + j` (see the module docstring; a parallel head's steps `j >= 2` read
  its placeholders, `j >= 1` in vLLM's P-EAGLE layout)."""
  c = head.config
  b, t = tokens.shape
  first = 2 if c.parallel_reads_first else 1  # the first step that reads a placeholder
  if c.parallel and num_steps > c.parallel + first:
    raise ValueError(f"a head with {c.parallel} placeholder slots unrolls at most "
                     f"{c.parallel + first} steps, asked for {num_steps}")
  features = eagle.project_features(head, source)  # [B, T, E]
  base = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  scale = c.layer_config.attention_scale
  k0 = v0 = None
  diag_k, diag_v, outputs = [], [], []
  for j in range(num_steps):
    if c.parallel and j >= first:
      embedded, features = placeholders(head, j - first, features.shape, features.dtype)
      q, k, v = eagle.head_qkv(head, None, embedded, features, base + j)
    else:
      q, k, v = eagle.head_qkv(head, embed, _shift(tokens, 1 + j), features, base + j)
    if j == 0:
      k0, v0 = k, v
    else:
      diag_k.append(k)
      diag_v.append(v)
    attn = _ttt_attention(q, k0, v0, diag_k, diag_v, scale)
    logits, features = eagle.head_finish(head, features, attn)
    outputs.append(logits)
  return outputs


def head_losses(params, d2t, static, config: HeadTrainConfig, embed, tokens, mask, source, probs,
                slots, in_vocab, argmax):
  """`(loss, metrics)`: weighted soft-CE over unroll steps / Medusa heads, plus per-step accuracy
  (draft argmax == target argmax) and greedy acceptance length on the masked positions."""
  network = join_network(params, d2t, static)
  if config.kind == "medusa":
    logits = medusa.medusa_forward(network, source)  # [B, T, k, N]
    steps = [logits[:, :, i] for i in range(logits.shape[2])]
  else:
    steps = eagle_unroll(network, embed, tokens, source, config.ttt_steps)
  draft_ids = network.draft_ids
  loss = 0.0
  metrics = {}
  leading = None
  for j, draft_logits in enumerate(steps):
    # chain t at step j predicts token t + 2 + j: the target's distribution at position t + 1 + j
    valid = _shift(mask & in_vocab, 1 + j, False)
    ce = soft_cross_entropy(_shift(probs, 1 + j), draft_logits, _shift(slots, 1 + j))
    count = jnp.maximum(valid.sum(), 1)
    loss = loss + config.step_weight ** j * jnp.sum(jnp.where(valid, ce, 0.0)) / count
    hit = draft_ids[jnp.argmax(draft_logits, axis=-1)] == _shift(argmax, 1 + j)
    scored = _shift(mask, 1 + j, False)
    metrics[f"acc{j}"] = jnp.sum(hit & scored) / jnp.maximum(scored.sum(), 1)
    leading = hit if leading is None else leading & hit
    metrics[f"chain{j}"] = jnp.sum(leading & scored) / jnp.maximum(scored.sum(), 1)
  metrics["loss"] = loss
  return loss, metrics


def _signals(batch: dict, d2t: jax.Array, vocab_size: int, kind: str):
  draft_ids = jnp.arange(d2t.shape[0], dtype=jnp.int32) + d2t
  draft_index = jnp.full((vocab_size,), -1, jnp.int32).at[draft_ids].set(
      jnp.arange(d2t.shape[0], dtype=jnp.int32))
  source = (batch["taps"] if kind == "eagle3" else batch["hidden"]).astype(jnp.float32)
  return (source,) + cached_signals(batch["top_logits"], batch["top_ids"], draft_index)


@functools.partial(jax.jit, static_argnames=("static", "config"), donate_argnums=(0,))
def train_step(state: dict, batch: dict, embed: jax.Array, d2t: jax.Array, *, static,
               config: HeadTrainConfig):
  """One optimizer step on a `HeadData` batch (recorded target features); `(state, metrics)`."""
  signals = _signals(batch, d2t, embed.shape[0], config.kind)
  grad_fn = jax.value_and_grad(head_losses, has_aux=True)
  (_, metrics), grads = grad_fn(state["params"], d2t, static, config, embed, batch["tokens"],
                                batch["mask"], *signals)
  updates, opt_state = make_optimizer(config).update(grads, state["opt_state"], state["params"])
  metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
  return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
          "step": state["step"] + 1}, metrics


@functools.partial(jax.jit, static_argnames=("static", "config"))
def eval_step(params: dict, batch: dict, embed: jax.Array, d2t: jax.Array, *, static,
              config: HeadTrainConfig) -> dict:
  """Metrics of `head_losses` on one batch, no update."""
  signals = _signals(batch, d2t, embed.shape[0], config.kind)
  return head_losses(params, d2t, static, config, embed, batch["tokens"], batch["mask"],
                     *signals)[1]
