"""Models and prompts for the synthetic and pair suites, and the machine's description."""

from __future__ import annotations

import datetime
import os
import pathlib
import platform

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.synthetic import random_pair


def random_prompts(batch: int, prompt_tokens: int, vocab_size: int, seed: int = 0):
  ids = np.random.default_rng(seed).integers(3, vocab_size, (batch, prompt_tokens))
  return jnp.asarray(ids, jnp.int32), jnp.full((batch,), prompt_tokens, jnp.int32)


def heldout_prompt_texts(count: int, prompt_chars: int = 600) -> list[str]:
  """Prompts cut from the held-out corpus split: the text before a `def ` (ending with it)."""
  from specjax.training import corpus
  documents = corpus.load("heldout")
  texts = []
  for document in documents:
    text = document.text
    starts = [i for i in range(len(text)) if text.startswith("\n    def ", i)
              or text.startswith("\ndef ", i)]
    starts = [i for i in starts if i >= prompt_chars // 2]
    if not starts:
      continue
    cut = starts[len(starts) // 2]
    end = text.index("def ", cut) + len("def ")
    texts.append(text[max(0, end - prompt_chars):end])
    if len(texts) >= count:
      break
  return texts


def encode_prompts(tokenizer, texts: list[str], prompt_tokens: int, batch: int):
  """`[batch, prompt_tokens]` prompts (each keeps its last `prompt_tokens` tokens; rows cycle)."""
  rows = []
  for i in range(batch):
    ids = tokenizer.encode(texts[i % len(texts)])
    rows.append(ids[-prompt_tokens:])
  width = min(len(r) for r in rows)
  rows = [r[-width:] for r in rows]
  return jnp.asarray(rows, jnp.int32), jnp.full((batch,), width, jnp.int32)


def load_pair(kind: str, *, seed: int = 0):
  """(`target`, `draft`, `tokenizer` or None, description) for a `--model` value.

  `kind` is "default" (the shipped pair), a random size of `SYNTHETIC_SIZES`,
  "ckpt:TARGET_DIR,DRAFT_DIR,TOKENIZER_JSON" (specjax checkpoints) or
  "runs:TARGET_RUN,DRAFT_RUN[,TOKENIZER_JSON]" (the latest states of `specjax train` runs; the
  tokenizer defaults to the shipped one).
  """
  if kind == "default":
    from specjax.testing.models import load_toy
    pair = load_toy()
    return pair.target, pair.draft, pair.tokenizer, "toy pair (specjax.testing.models.load_toy())"
  if kind.startswith(("ckpt:", "runs:")):
    from specjax.io.orbax import load
    from specjax.io.tokenizer import load_tokenizer
    paths = kind[5:].split(",")
    if len(paths) == 2 and kind.startswith("runs:"):
      from specjax.pretrained.pairs import TOKENIZER_FILE, TOY_DIR, default_dir
      try:
        paths.append(str(default_dir() / TOY_DIR / TOKENIZER_FILE))
      except FileNotFoundError:
        paths.append(str(pathlib.Path(__file__).resolve().parent.parent / "checkpoints"
                         / TOY_DIR / TOKENIZER_FILE))
    if len(paths) != 3:
      raise ValueError(f"--model {kind}: expected {kind[:5]}TARGET,DRAFT,TOKENIZER")
    if kind.startswith("runs:"):
      from specjax.training.state import load_run
      target, draft = load_run(paths[0])[0], load_run(paths[1])[0]
    else:
      target, draft = load(paths[0], dtype=jnp.float32), load(paths[1], dtype=jnp.float32)
    return (target.astype(jnp.float32), draft.astype(jnp.float32), load_tokenizer(paths[2]),
            f"pair from {kind}")
  target, draft = random_pair(kind, seed=seed, vocab_size=64 if kind == "tiny" else 8192,
                              max_len=256 if kind == "tiny" else 1024)
  return target, draft, None, f"random weights ({kind})"


def default_pair_available() -> bool:
  try:
    from specjax.pretrained.pairs import default_dir
    default_dir()
    return True
  except (FileNotFoundError, ImportError):
    return False


def describe(model) -> dict:
  c = model.config
  return {"params": c.num_params(), "embed_dim": c.embed_dim, "num_layers": c.num_layers,
          "vocab_size": c.vocab_size, "dtype": str(model.dtype)}


def environment() -> dict:
  device = jax.devices()[0]
  return {
      "platform": device.platform,
      "device": getattr(device, "device_kind", str(device)),
      "num_devices": jax.device_count(),
      "cpu_count": os.cpu_count(),
      "machine": platform.machine(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      # Other load on a shared machine slows every call: 1/5/15-minute run-queue averages.
      "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
  }


def prompts_for(pair, settings, batch: int):
  target, _, tokenizer, _ = pair
  if tokenizer is None:
    return random_prompts(batch, settings.prompt_tokens, target.vocab_size, settings.seed)
  texts = heldout_prompt_texts(max(batch, settings.peer_prompts))
  return encode_prompts(tokenizer, texts, settings.prompt_tokens, batch)
