"""Block sizes of the TPU verify kernels, the VMEM budget per TPU generation, and the loop that
walks a resident vocabulary tile in chunks.

VMEM holds two things per grid step: the logits blocks (double-buffered by the pipeline) and the
kernel body's temporaries. A block that holds a row's whole vocabulary is read from HBM once per
round however many passes the rule makes, so blocks are made as wide as the budget allows; the
body then walks the block in chunks of `BlockSizes.block_c` lanes (`over_chunks`), so that its
temporaries scale with the chunk, not with the vocabulary. Both are sized from the VMEM of the TPU
generation the program is compiled for: the device kind of the mesh being traced (what
`pltpu.get_tpu_info` reads), else of the local TPU, else the smallest.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128  # TPU vector lanes; the (8, 128) tiling rule's minor dimension
SUBLANES = 8
# VMEM per TensorCore by TPU generation, from jax's own chip table (`pltpu.get_tpu_info_for_chip`).
# The logits blocks (double-buffered) get `VMEM_BLOCK_FRACTION` of a kernel's scoped limit, which is
# raised to `VMEM_LIMIT_FRACTION` of this, so that a row's whole vocabulary stays resident where it
# fits (read from HBM once per round). The generation is the device kind of the TPU the computation
# is compiled for (`compile_device_kind`); without one (`jax.export` from a CPU host), Mosaic's
# default scoped limit.
_CHIPS = {"v4": pltpu.ChipVersion.TPU_V4, "v5e": pltpu.ChipVersion.TPU_V5E,
          "v5p": pltpu.ChipVersion.TPU_V5P, "v6e": pltpu.ChipVersion.TPU_V6E,
          "v7": pltpu.ChipVersion.TPU_7X}
TPU_VMEM_BYTES = {generation: pltpu.get_tpu_info_for_chip(chip, 1).vmem_capacity_bytes
                  for generation, chip in _CHIPS.items()}
VMEM_BLOCK_FRACTION = 0.5
VMEM_LIMIT_FRACTION = 0.75
# Mosaic's default scoped-VMEM limit (v4, v5e), used when the generation is not known.
DEFAULT_SCOPED_VMEM = 16 * 2**20
DEFAULT_MAX_BLOCK_B = 8
# The kernel bodies hold at most this many float32 temporaries of one chunk (`[block_b, rows,
# block_c]`, rows padded to 8) live at once; they get the half of the budget the blocks leave.
CHUNK_TEMPORARIES = 24
MAX_CHUNK = 2048
# Interpret mode has no VMEM and pays per grid step, so its default blocks are far larger.
INTERPRET_VMEM_BUDGET = 64 * 2**20
INTERPRET_MAX_BLOCK_B = 1024


# --------------------------------------------------------------------------------------------
# Block sizes.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the fused verify kernel: a block of batch rows times a vocabulary tile.

  Attributes:
    block_v: lanes per vocabulary tile. A multiple of 128 (TPU (8, 128) rule: the minor block dim
      must be a multiple of 128 or the whole axis). A vocabulary that is not a multiple of it is
      handled by masking the last tile; one that is smaller uses one tile of exactly `V`.
    block_b: batch rows per grid step (each with its `k+1` target and `k` draft rows). A leading
      block dim, so the (8, 128) rule does not constrain it; clamped to `B`. A batch that is not a
      multiple of it ends in a partial block whose missing rows are never written back.
    block_c: lanes the kernel body computes on at a time inside a tile (`over_chunks`), a
      multiple of 128; None = the whole tile at once (interpret mode, where VMEM is not the
      limit and every loop step costs).
  """

  block_v: int = 2048
  block_b: int = 8
  block_c: int | None = None

  def __post_init__(self):
    if self.block_c is not None and (isinstance(self.block_c, bool)
                                     or not isinstance(self.block_c, int) or self.block_c < 1
                                     or self.block_c % LANES):
      raise ValueError(f"BlockSizes.block_c must be a positive multiple of {LANES} or None, "
                       f"got {self.block_c!r}")
    for name in ("block_v", "block_b"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")
    if self.block_v % LANES:
      raise ValueError(f"BlockSizes.block_v must be a positive multiple of {LANES}, "
                       f"got {self.block_v}")

  def tile(self, vocab: int) -> int:
    """The tile actually used for `vocab`: `block_v`, clamped to the whole axis if that is
    smaller."""
    return vocab if vocab <= self.block_v else self.block_v

  def rows(self, batch: int) -> int:
    """The batch rows per grid step actually used: `block_b`, clamped to `batch`."""
    return min(self.block_b, batch)

  def chunk(self, vocab: int) -> int | None:
    """The chunk actually used inside a tile of `vocab` (None: the whole tile)."""
    if self.block_c is None or self.block_c >= self.tile(vocab):
      return None
    return self.block_c

  @classmethod
  def get_default(cls, vocab: int, num_draft: int, dtype=jnp.float32, *, batch: int | None = None,
                  has_draft_logits=True, vmem_budget: int | None = None,
                  max_block_b: int = DEFAULT_MAX_BLOCK_B, device_kind: str | None = None,
                  chunked: bool = True, temporaries: int = CHUNK_TEMPORARIES) -> BlockSizes:
    """Tiles whose double-buffered target and draft blocks fit `vmem_budget` bytes, and the chunk
    whose body temporaries fit as much again.

    Reading the logits once matters more than batching grid steps (each extra vocabulary tile
    makes every pass stream the logits from HBM again), so this takes the largest `block_b`
    (a power of two, at most `max_block_b` and the batch) whose blocks still hold the whole
    vocabulary; when not even one row does, `block_b = 1` and the largest tile that fits. Rows are
    counted padded to the dtype's sublane tile (8 for 32-bit, 16 for 16-bit), as VMEM stores them.
    `vmem_budget` defaults to the share of `device_kind`'s VMEM (`vmem_budget_for`). With
    `chunked`, `block_c` is the largest power of two of lanes (128 .. `MAX_CHUNK`) such that
    `temporaries` float32 arrays of `[block_b, rows, block_c]` fit half of `vmem_budget`.
    """
    if vmem_budget is None:
      vmem_budget = vmem_budget_for(device_kind)
    itemsize = jnp.dtype(dtype).itemsize
    row_tile = SUBLANES * max(1, 4 // itemsize)
    rows = _round_up(num_draft + 1, row_tile) + (_round_up(num_draft, row_tile)
                                                 if has_draft_logits else 0)
    per_lane = 2 * rows * itemsize  # per batch row: two pipeline buffers
    whole = _round_up(vocab, LANES)
    block_b = 1
    limit = max_block_b if batch is None else min(max_block_b, batch)
    while 2 * block_b <= limit and 2 * block_b * per_lane * whole <= vmem_budget:
      block_b *= 2
    block_v = max(LANES, (vmem_budget // (block_b * per_lane)) // LANES * LANES)
    block_c = None
    if chunked:
      rows32 = _round_up(num_draft + 1, SUBLANES) + (_round_up(num_draft, SUBLANES)
                                                     if has_draft_logits else 0)
      block_c = MAX_CHUNK
      while block_c > LANES and temporaries * block_b * rows32 * block_c * 4 > vmem_budget // 2:
        block_c //= 2
    return cls(block_v=min(block_v, whole), block_b=block_b, block_c=block_c)


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def tpu_generation(device_kind: str | None) -> str:
  """`"v4"`, `"v5e"`, `"v5p"`, `"v6e"` or `"v7"` for a TPU device kind (`"TPU v5 lite"`...);
  unknown kinds and None give the smallest VMEM, `"v4"`."""
  kind = (device_kind or "").lower().replace("tpu", "").strip()
  for generation, names in (("v6e", ("v6 lite", "v6e", "v6")), ("v5e", ("v5 lite", "v5e")),
                            ("v5p", ("v5p", "v5")), ("v7", ("v7", "7x")), ("v4", ("v4",))):
    if any(kind.startswith(name) for name in names):
      return generation
  return "v4"


def scoped_vmem_limit(device_kind: str | None) -> int:
  """Bytes of scoped VMEM a kernel may use on `device_kind`: its `vmem_limit_bytes`, or Mosaic's
  default when the generation is not known."""
  if device_kind is None:
    return DEFAULT_SCOPED_VMEM
  return int(TPU_VMEM_BYTES[tpu_generation(device_kind)] * VMEM_LIMIT_FRACTION)


def vmem_budget_for(device_kind: str | None) -> int:
  """Bytes of VMEM the double-buffered logits blocks may take on `device_kind`: half of the
  kernel's scoped limit (the other half holds the body's temporaries and the scratch)."""
  return int(scoped_vmem_limit(device_kind) * VMEM_BLOCK_FRACTION)


def vmem_limit_for(device_kind: str | None) -> int | None:
  """The kernel's `vmem_limit_bytes` on `device_kind` (None: the compiler's default)."""
  if device_kind is None:
    return None
  return scoped_vmem_limit(device_kind)


def compile_device_kind() -> str | None:
  """The kind of the TPU the program being traced is compiled for: the device kind of the
  abstract mesh in context (a mesh of TPU devices, including abstract ones from
  `jax.experimental.topologies` when compiling ahead of time on another host), else that of the
  local default device when it is a TPU; None otherwise (e.g. `jax.export(..., platforms=["tpu"])`
  from a CPU host with no TPU mesh), which sizes blocks for the smallest VMEM."""
  abstract_device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if abstract_device is not None and abstract_device.platform == "tpu":
    return abstract_device.device_kind
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return None
  return device.device_kind if device.platform == "tpu" else None


# --------------------------------------------------------------------------------------------
# Walking a resident tile in chunks.
# --------------------------------------------------------------------------------------------

class Chunk(NamedTuple):
  """One chunk of a vocabulary tile, as a kernel body sees it.

  Attributes:
    lanes: the lane index of the chunk inside the tile's block (`ref[:, :, chunk.lanes]`).
    vocab_ids: `[1, 1, size]` int32 vocabulary ids of its lanes.
    in_vocab: `[1, 1, size]` bool, False on lanes past the vocabulary (the last tile's tail).
    first: traced bool, the first chunk of the first tile (where a pass initialises).
    last: traced bool, the last chunk of the last tile (where a pass finishes).
  """

  lanes: object
  vocab_ids: jax.Array
  in_vocab: jax.Array
  first: jax.Array
  last: jax.Array


def over_chunks(body: Callable[[Chunk], None], *, tile, num_tiles: int, block_v: int,
                block_c: int | None, vocab: int) -> None:
  """Calls `body(chunk)` on each chunk of `block_c` lanes of the current vocabulary tile, in
  order: full chunks in a `lax.fori_loop` (aligned dynamic lane slices), then the remainder, if
  any, as one static slice. `block_c` None = the whole tile as one chunk. `tile` is the grid's
  tile index; every chunk sees the same refs, so per-row statistics accumulate across chunks
  exactly as across tiles."""
  chunk = block_v if block_c is None or block_c >= block_v else block_c
  full, rest = divmod(block_v, chunk)
  count = full + (1 if rest else 0)

  def run(index, start, size):
    ids = tile * block_v + start + jax.lax.broadcasted_iota(jnp.int32, (1, 1, size), 2)
    body(Chunk(lanes=pl.ds(start, size), vocab_ids=ids, in_vocab=ids < vocab,
               first=(tile == 0) & (index == 0),
               last=(tile == num_tiles - 1) & (index == count - 1)))

  if full == 1:
    run(0, 0, chunk)
  elif full > 1:
    def step(index, carry):
      run(index, pl.multiple_of(index * chunk, chunk), chunk)
      return carry
    jax.lax.fori_loop(0, full, step, 0)
  if rest:
    run(full, full * chunk, rest)
