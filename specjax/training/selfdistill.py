"""Self-distillation data for draft heads: the target's own answers to generated chat prompts.

`generate_chunks` chat-templates conversations (`specjax.training.prompts`), lets the target answer
them with `specjax.generate` (batches alternate greedy and temperature 0.7) and writes one
`chunk_NNNN.npz` per batch: `tokens [B, W]` (prompt + answer, right-padded), `lengths [B]`,
`prompt_lengths [B]`. Finished chunks are skipped, so an interrupted run resumes where it stopped.

Training reads the chunks in a fixed order (`HeadData.batch_at` is a pure function of the step), so
it can start as soon as the first chunks exist and still be resumed bitwise: the first epoch walks
the chunks in order (shuffled inside groups of chunks) and waits for a chunk that is not written
yet; later epochs shuffle everything. The target's features and logits are computed on the fly.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.core.sampling import top_k as vocab_top_k

CHUNK_FIELDS = ("tokens", "lengths", "prompt_lengths", "taps", "hidden", "top_logits", "top_ids")


def chunk_path(directory: pathlib.Path, index: int) -> pathlib.Path:
  """The folder of chunk `index` (one `.npy` per field, memory-mapped when read)."""
  return pathlib.Path(directory) / f"chunk_{index:04d}"


@functools.partial(jax.jit, static_argnames=("taps", "top_k"))
def _prefill(target, prompts, starts, cache, *, taps, top_k):
  # `starts` (zeros) is an argument: zeros XLA can see make it constant-fold the attention over
  # the empty cache, for seconds per layer.
  out = target(prompts, starts, cache, taps=taps, return_hidden=True)
  top_logits, top_ids = vocab_top_k(out.logits, top_k)
  return out.cache, out.taps, out.hidden, top_logits, top_ids.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("taps", "top_k", "max_new_tokens"))
def _decode_recording(target, cache, first_logits, prompt_lengths, key, temperature, eos_id, *,
                      taps, top_k, max_new_tokens):
  """Samples `max_new_tokens` tokens per row (greedy when temperature == 0), feeding each one to
  the target and recording its features and top-k logits at that token's position."""
  batch = prompt_lengths.shape[0]

  def choose(logits, i):
    sampled = jax.random.categorical(jax.random.fold_in(key, i),
                                     logits / jnp.maximum(temperature, 1e-6), axis=-1)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)

  def step(carry, i):
    cache, logits, done = carry
    token = jnp.where(done, target.config.pad_id, choose(logits, i))
    out = target(token[:, None], prompt_lengths + i, cache, taps=taps, return_hidden=True)
    top_logits, top_ids = vocab_top_k(out.logits[:, 0], top_k)
    record = (token, done, out.taps[:, :, 0] if taps else jnp.zeros((0, batch, 1)),
              out.hidden[:, 0], top_logits, top_ids.astype(jnp.int32))
    return (out.cache, out.logits[:, 0], done | (token == eos_id)), record

  init = (cache, first_logits, jnp.zeros((batch,), bool))
  _, records = jax.lax.scan(step, init, jnp.arange(max_new_tokens))
  return records


def generate_chunks(target, encode_chat: Callable[[list[dict]], list[int]],
                    conversations: Sequence[list[dict]], directory: str | os.PathLike, *,
                    batch_size: int = 64, max_new_tokens: int = 128, eos_id: int | None = None,
                    taps: Sequence[int] = (), temperatures: Sequence[float] = (0.0, 0.7),
                    top_k: int = 32, prefill_rows: int = 8, seed: int = 0,
                    only: Sequence[int] | None = None,
                    log: Callable[[str], None] = print) -> pathlib.Path:
  """Writes the target's answers to `conversations`, with its features, as numbered chunks.

  Every position of every row (prompt and answer) records what a head trains on, taken from the
  very forward pass that generated the answer (no second pass): the taps `[n, E]`, the final
  normed hidden state `[E]` and the `top_k` largest logits with their ids (the teacher's
  distribution, truncated). Features are stored as float16.

  Args:
    target: the target `specjax.Model`.
    encode_chat: chat template + tokenizer: messages -> token ids ending with the generation prompt.
    conversations: lists of {role, content} messages, each ending with a user turn.
    directory: output folder (created); existing chunks are kept and skipped.
    batch_size: rows per chunk.
    max_new_tokens: answer budget per row.
    eos_id: the end-of-turn id (kept in the data; the row stops there).
    taps: target layers whose incoming residual stream is recorded (EAGLE-3's).
    temperatures: cycled over chunks (0 = greedy).
    top_k: logits kept per position.
    prefill_rows: rows per prefill call (bounds the `[rows, T, V]` logits in memory).
    seed: sampling seed (chunk `i` uses `fold_in(PRNGKey(seed), i)`).
    only: write only these chunk indices (None: all); the others are neither read nor written.
    log: progress sink.

  Returns:
    The directory.
  """
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  pad = target.config.pad_id
  eos = -1 if eos_id is None else int(eos_id)
  taps = tuple(int(i) for i in taps)
  for i, start in enumerate(range(0, len(conversations), batch_size)):
    path = chunk_path(directory, i)
    if path.exists() or (only is not None and i not in only):
      continue
    began = time.perf_counter()
    rows = [encode_chat(c) for c in conversations[start:start + batch_size]]
    rows += [rows[-1]] * (batch_size - len(rows))  # a short last chunk repeats its last row
    width = -(-max(map(len, rows)) // 32) * 32
    prompts = np.full((batch_size, width), pad, np.int32)
    prompt_lengths = np.array([len(r) for r in rows], np.int32)
    for b, r in enumerate(rows):
      prompts[b, :len(r)] = r
    caches, pre = [], []
    for r0 in range(0, batch_size, prefill_rows):
      cache = target.init_cache(min(prefill_rows, batch_size - r0), width + max_new_tokens)
      rows_r = jnp.asarray(prompts[r0:r0 + prefill_rows])
      cache, *rest = _prefill(target, rows_r, jnp.zeros((rows_r.shape[0],), jnp.int32), cache,
                              taps=taps, top_k=top_k)
      caches.append(cache)
      pre.append([np.asarray(x) if x is not None else None for x in rest])
    # Row-concatenate the prefill caches: [L, B, KVH, S, D] (stacked), [B, KVH, S, D] per layer.
    batch_axis = 0 if caches[0].per_layer else 1
    cache = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=batch_axis if xs[0].ndim > 1
                                                     else 0), *caches)
    cache = cache.with_lengths(jnp.asarray(prompt_lengths))
    pre_taps = np.concatenate([p[0] for p in pre], axis=1) if taps else None  # [n, B, W, E]
    pre_hidden = np.concatenate([p[1] for p in pre])  # [B, W, E]
    pre_top = np.concatenate([p[2] for p in pre]), np.concatenate([p[3] for p in pre])
    last = prompt_lengths - 1
    # The first answer token is drawn from the prompt's last top-k logits (exact when greedy).
    first_logits = np.full((batch_size, target.config.vocab_size), -1e30, np.float32)
    for b in range(batch_size):
      first_logits[b, pre_top[1][b, last[b]]] = pre_top[0][b, last[b]]
    temperature = float(temperatures[i % len(temperatures)])
    key = jax.random.fold_in(jax.random.PRNGKey(seed), i)
    tokens_r, done_r, taps_r, hidden_r, top_l_r, top_i_r = [
        np.asarray(x) for x in _decode_recording(
            target, cache, jnp.asarray(first_logits), jnp.asarray(prompt_lengths), key,
            jnp.float32(temperature), jnp.int32(eos), taps=taps, top_k=top_k,
            max_new_tokens=max_new_tokens)]
    counts = np.sum(~done_r, axis=0).astype(np.int32)  # tokens up to and including the EOS
    lengths = prompt_lengths + counts
    total = int(lengths.max())
    tokens = np.full((batch_size, total), pad, np.int32)
    n_taps = len(taps)
    feat_taps = np.zeros((batch_size, total, n_taps, target.config.embed_dim), np.float16)
    hidden = np.zeros((batch_size, total, target.config.embed_dim), np.float16)
    top_logits = np.zeros((batch_size, total, top_k), np.float16)
    top_ids = np.zeros((batch_size, total, top_k), np.int32)
    for b in range(batch_size):
      p, c = int(prompt_lengths[b]), int(counts[b])
      tokens[b, :p] = rows[b]
      tokens[b, p:p + c] = tokens_r[:c, b]
      if n_taps:
        feat_taps[b, :p] = np.moveaxis(pre_taps[:, b, :p], 0, 1)
        feat_taps[b, p:p + c] = taps_r[:c, :, b]
      hidden[b, :p], hidden[b, p:p + c] = pre_hidden[b, :p], hidden_r[:c, b]
      top_logits[b, :p], top_logits[b, p:p + c] = pre_top[0][b, :p], top_l_r[:c, b]
      top_ids[b, :p], top_ids[b, p:p + c] = pre_top[1][b, :p], top_i_r[:c, b]
    arrays = dict(tokens=tokens, lengths=lengths, prompt_lengths=prompt_lengths,
                  temperature=np.float32(temperature), taps=feat_taps, hidden=hidden,
                  top_logits=top_logits, top_ids=top_ids, tap_layers=np.asarray(taps, np.int32))
    tmp = directory / f".tmp_{path.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, value in arrays.items():
      np.save(tmp / f"{name}.npy", value)
    tmp.rename(path)  # a chunk appears only when complete
    log(json.dumps(dict(chunk=i, rows=batch_size, answer_tokens=int(counts.sum()),
                        seconds=round(time.perf_counter() - began, 1), temperature=temperature)))
  return directory


def load_chunk(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """The fields of one chunk (`CHUNK_FIELDS`; features memory-mapped); ValueError if corrupt."""
  path = pathlib.Path(path)
  try:
    return {name: np.load(path / f"{name}.npy", mmap_mode="r") for name in CHUNK_FIELDS}
  except (OSError, ValueError) as error:
    raise ValueError(f"corrupt self-distillation chunk {path}: {error}") from None


def wait_for_chunk(directory, index: int, poll_s: float = 10.0, timeout_s: float = 7200.0
                   ) -> pathlib.Path:
  """Blocks until chunk `index` exists (the generator may still be writing later chunks)."""
  path = chunk_path(directory, index)
  waited = 0.0
  while not path.exists():
    if waited >= timeout_s:
      raise TimeoutError(f"chunk {path} did not appear within {timeout_s:.0f}s")
    time.sleep(poll_s)
    waited += poll_s
  return path


def token_counts(directory, chunks: Sequence[int], vocab_size: int) -> np.ndarray:
  """`[V]` int64 occurrences of every id in the answers of the given chunks."""
  counts = np.zeros((vocab_size,), np.int64)
  for i in chunks:
    chunk = load_chunk(chunk_path(directory, i))
    tokens, lengths, prompt_lengths = chunk["tokens"], chunk["lengths"], chunk["prompt_lengths"]
    for b in range(tokens.shape[0]):
      np.add.at(counts, tokens[b, prompt_lengths[b]:lengths[b]], 1)
  return counts


def frequent_ids(counts: np.ndarray, size: int, keep=()) -> np.ndarray:
  """The `size` most frequent ids, sorted; ties go to the lower id (BPE ids are merge-ordered,
  so lower ids are the more common pieces when the sample is too small to tell).

  `keep`: ids that stay whatever their counts (a head's existing draft vocabulary, when it grows);
  the most frequent other ids fill the rest.
  """
  keep = np.unique(np.asarray(keep, np.int64))
  if keep.shape[0] > size:
    raise ValueError(f"cannot keep {keep.shape[0]} ids in a vocabulary of {size}")
  order = np.lexsort((np.arange(counts.shape[0]), -counts))
  order = order[~np.isin(order, keep)][:size - keep.shape[0]]
  return np.sort(np.concatenate([keep, order])).astype(np.int32)


class HeadData:
  """Fixed-shape training windows from self-distillation chunks, a pure function of the step.

  Every row is one conversation cut or padded to `seq_len`; `mask` marks the positions whose
  NEXT token is part of the answer (the positions a head is trained to draft from), or, with
  `answers_only=False`, every position whose next token exists (the target's distribution on the
  prompt is as good a teacher; the forward pass over it is paid for anyway).

  Args:
    directory: the chunk folder.
    chunks: indices of the chunks that make up the data (in first-epoch order).
    batch_size: rows per step.
    seq_len: window length.
    seed: shuffling seed.
    group: first-epoch shuffling happens inside groups of this many chunks.
    answers_only: train only where the next token is an answer token.
    context: if set, a window starts this many tokens before the answer (the head sees that much
      of the prompt), so long prompts do not crowd the answer out of `seq_len`.
  """

  def __init__(self, directory, chunks: Sequence[int], *, batch_size: int, seq_len: int,
               rows_per_chunk: int, seed: int = 0, group: int = 1, pad_id: int = 0,
               answers_only: bool = True, context: int | None = None):
    self.directory = pathlib.Path(directory)
    self.chunks = list(chunks)
    self.batch_size, self.seq_len, self.seed, self.group = batch_size, seq_len, seed, group
    self.rows_per_chunk = rows_per_chunk
    self.pad_id = pad_id
    self.answers_only = answers_only
    self.context = context
    self.num_rows = len(self.chunks) * rows_per_chunk
    self._cache: dict[int, tuple] = {}

  @property
  def steps_per_epoch(self) -> int:
    return max(1, self.num_rows // self.batch_size)

  def _order(self, epoch: int) -> np.ndarray:
    """Global row ids (chunk slot * rows_per_chunk + row) in the order of `epoch`."""
    rng = np.random.default_rng([self.seed, epoch])
    rows = np.arange(self.num_rows)
    if epoch > 0:
      return rng.permutation(rows)
    span = self.group * self.rows_per_chunk
    return np.concatenate([rng.permutation(rows[s:s + span]) for s in range(0, self.num_rows, span)])

  def _chunk(self, slot: int) -> dict[str, np.ndarray]:
    if slot not in self._cache:
      if len(self._cache) >= 16:
        self._cache.clear()
      self._cache[slot] = load_chunk(wait_for_chunk(self.directory, self.chunks[slot]))
    return self._cache[slot]

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    """The batch of training step `step`.

    Returns:
      `tokens [B, T] int32`, `mask [B, T] bool` (train at position p: token p + 1 is kept),
      `taps [n, B, T, E]`, `hidden [B, T, E]` (float16 features of the target at every
      position), `top_logits [B, T, K]` float16 / `top_ids [B, T, K]` int32 (the target's
      largest logits for the token after each position).
    """
    epoch, index = divmod(step, self.steps_per_epoch)
    ids = self._order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
    first = self._chunk(int(ids[0]) // self.rows_per_chunk)
    n, e, k = first["taps"].shape[2], first["hidden"].shape[-1], first["top_ids"].shape[-1]
    b_, t_ = self.batch_size, self.seq_len
    out = {"tokens": np.full((b_, t_), self.pad_id, np.int32), "mask": np.zeros((b_, t_), bool),
           "taps": np.zeros((b_, t_, n, e), np.float16), "hidden": np.zeros((b_, t_, e), np.float16),
           "top_logits": np.zeros((b_, t_, k), np.float16), "top_ids": np.zeros((b_, t_, k), np.int32)}
    for b, row_id in enumerate(ids):
      slot, row = divmod(int(row_id), self.rows_per_chunk)
      chunk = self._chunk(slot)
      if row >= chunk["tokens"].shape[0]:
        continue
      prompt_length = int(chunk["prompt_lengths"][row])
      offset = 0 if self.context is None else max(prompt_length - self.context, 0)
      length = min(int(chunk["lengths"][row]) - offset, t_)
      for name in ("tokens", "taps", "hidden", "top_logits", "top_ids"):
        out[name][b, :length] = chunk[name][row, offset:offset + length]
      # position p predicts token p + 1: train where token p + 1 is kept (an answer token).
      start = max(prompt_length - offset - 1, 0) if self.answers_only else 0
      out["mask"][b, start:length - 1] = True
    out["taps"] = np.moveaxis(out["taps"], 2, 0)
    return out
