"""The training corpus: the Python standard library's own source files.

Real text that is on every machine with Python, and code completion is a flagship speculative
decoding workload. What goes in, exactly:

- every `*.py` file under `sysconfig.get_paths()["stdlib"]` of the running interpreter, walked
  recursively, in sorted order of the POSIX relative path;
- except any file with a path component named `test`, `tests` or `idle_test` (the test suites,
  including `idlelib/idle_test` and `lib2to3/tests`), `site-packages`, `__pycache__`,
  `lib-dynload`, the `config-*` build directory, and the machine-generated `_sysconfigdata_*.py`;
- each file read as UTF-8 (undecodable bytes replaced) with line endings normalised to `\\n`.

The held-out split is by top-level module (`json/decoder.py` -> `json`, `argparse.py` ->
`argparse`): modules are ordered by `sha256(name)` and the shortest prefix of that order holding at
least `heldout_fraction` (5%) of the corpus characters is held out. Whole modules, never parts of
one, are unseen during training. (A plain hash bucket per module would hold out anywhere between
0.3% and 20% of the text, module sizes are that skewed.) With CPython 3.11 that is `collections`,
`modulefinder`, `queue`, `json`, `struct`, `cmd`, `nturl2path`, `operator`, `logging`,
`_threading_local`, `cgitb`, `importlib` and `pydoc`: 5.7% of the characters. Python versions differ
slightly in what the standard library contains; `file_list_hash` fingerprints the exact list so a
checkpoint README can record it.

Training streams are built by joining each document as `<bos> text <eos>` into one token array;
`batch_at(stream, step, ...)` cuts it into non-overlapping windows and visits them in a permutation
seeded by `(seed, epoch)`, so the batch at a step depends only on the step (resume-safe).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sysconfig
from typing import Iterable, Literal, Sequence

import numpy as np

Split = Literal["train", "heldout", "all"]

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__",
                           "lib-dynload"})
HELDOUT_FRACTION = 0.05


@dataclasses.dataclass(frozen=True)
class Document:
  """One source file of the corpus.

  Attributes:
    path: POSIX path relative to the standard library root, e.g. "json/decoder.py".
    module: top-level module name, e.g. "json".
    text: file contents, `\\n` line endings.
  """

  path: str
  module: str
  text: str


def stdlib_root() -> pathlib.Path:
  """The running interpreter's standard library directory."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _excluded(relative: pathlib.PurePosixPath) -> bool:
  parts = relative.parts
  if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in parts[:-1]):
    return True
  return parts[-1].startswith("_sysconfigdata")


def module_of(path: str) -> str:
  """Top-level module name of a relative path: "json/decoder.py" -> "json"."""
  first = path.split("/", 1)[0]
  return first[:-3] if first.endswith(".py") else first


def heldout_modules(documents: Sequence[Document],
                    heldout_fraction: float = HELDOUT_FRACTION) -> frozenset[str]:
  """Top-level modules of the held-out split: the shortest prefix, in `sha256(name)` order, that
  holds at least `heldout_fraction` of the characters of `documents`."""
  sizes: dict[str, int] = {}
  for document in documents:
    sizes[document.module] = sizes.get(document.module, 0) + len(document.text)
  budget = heldout_fraction * sum(sizes.values())
  chosen, total = [], 0
  for module in sorted(sizes, key=lambda m: hashlib.sha256(m.encode("utf-8")).digest()):
    if total >= budget:
      break
    chosen.append(module)
    total += sizes[module]
  return frozenset(chosen)


def list_files(root: str | os.PathLike | None = None) -> list[str]:
  """Relative POSIX paths of the corpus files under `root` (default: the stdlib), sorted."""
  root = pathlib.Path(root) if root is not None else stdlib_root()
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
    for name in filenames:
      if name.endswith(".py"):
        relative = pathlib.PurePosixPath(pathlib.Path(dirpath, name).relative_to(root).as_posix())
        if not _excluded(relative):
          paths.append(str(relative))
  return sorted(paths)


def file_list_hash(paths: Iterable[str]) -> str:
  """sha256 (hex, first 16 digits) of the newline-joined relative paths."""
  return hashlib.sha256("\n".join(paths).encode("utf-8")).hexdigest()[:16]


def load(split: Split = "train", root: str | os.PathLike | None = None,
         heldout_fraction: float = HELDOUT_FRACTION) -> list[Document]:
  """Reads the corpus documents of one split, in deterministic (sorted path) order.

  Args:
    split: "train", "heldout" or "all".
    root: directory to read (default: the running interpreter's standard library).
    heldout_fraction: share of the characters held out (whole top-level modules).

  Returns:
    The documents, sorted by path.
  """
  if split not in ("train", "heldout", "all"):
    raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
  root = pathlib.Path(root) if root is not None else stdlib_root()
  documents = []
  for path in list_files(root):
    raw = (root / path).read_bytes().decode("utf-8", errors="replace")
    documents.append(Document(path, module_of(path),
                              raw.replace("\r\n", "\n").replace("\r", "\n")))
  if split == "all":
    return documents
  heldout = heldout_modules(documents, heldout_fraction)
  return [d for d in documents if (d.module in heldout) == (split == "heldout")]


def token_stream(encode, documents: Sequence[Document], bos_id: int, eos_id: int) -> np.ndarray:
  """Joins documents into one int32 token array: `<bos> doc <eos> <bos> doc <eos> ...`.

  Args:
    encode: maps a list of strings to a list of token-id lists (no special tokens added).
    documents: the documents, in order.
    bos_id / eos_id: ids framing each document.

  Returns:
    `[N]` int32.
  """
  pieces = []
  for ids in encode([d.text for d in documents]):
    pieces.append(np.asarray([bos_id, *ids, eos_id], np.int32))
  return np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)


def num_windows(stream_length: int, seq_len: int) -> int:
  """Non-overlapping windows of `seq_len + 1` tokens (input plus shifted target) in a stream."""
  return max((stream_length - 1) // seq_len, 0)


def batch_at(stream: np.ndarray, step: int, batch_size: int, seq_len: int,
             seed: int = 0) -> np.ndarray:
  """The training batch of a step: `[batch_size, seq_len + 1]` int32 windows of the stream.

  Windows start at multiples of `seq_len`; each epoch visits all of them once in a permutation
  seeded by `(seed, epoch)`. The result depends only on `(stream, step, batch_size, seq_len,
  seed)`, which is what makes resuming reach the same state as an uninterrupted run.
  """
  count = num_windows(len(stream), seq_len)
  if count < 1:
    raise ValueError(f"stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
  indices = []
  position = step * batch_size
  while len(indices) < batch_size:
    epoch, offset = divmod(position, count)
    order = np.random.default_rng([seed, epoch]).permutation(count)
    take = min(batch_size - len(indices), count - offset)
    indices.extend(order[offset:offset + take])
    position += take
  starts = np.asarray(indices, np.int64) * seq_len
  return np.stack([stream[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
  """The first `max_windows` non-overlapping windows of a stream, in order: `[W, seq_len + 1]`."""
  count = num_windows(len(stream), seq_len)
  if max_windows is not None:
    count = min(count, max_windows)
  return np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(count)])
