"""Block sizes of the TPU verify kernel and the VMEM budget per TPU generation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

LANES = 128  # TPU vector lanes; the (8, 128) tiling rule's minor dimension
SUBLANES = 8
# VMEM per TensorCore by TPU generation (as jax's `pltpu` chip table lists it). The logits blocks
# (double-buffered) get `VMEM_BLOCK_FRACTION` of it and the kernel's `vmem_limit_bytes` is raised
# to `VMEM_LIMIT_FRACTION` of it, so that a row's whole vocabulary stays resident where it fits
# (read from HBM once per round). The generation is the device kind of the TPU the computation is
# compiled on; lowering for TPU from another host (`jax.export`) takes the smallest, v4.
TPU_VMEM_BYTES = {"v4": 16 * 2**20, "v5e": 128 * 2**20, "v5p": 64 * 2**20, "v6e": 128 * 2**20,
                  "v7": 64 * 2**20}
VMEM_BLOCK_FRACTION = 0.5
VMEM_LIMIT_FRACTION = 0.75
DEFAULT_MAX_BLOCK_B = 8
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
  """

  block_v: int = 2048
  block_b: int = 8

  def __post_init__(self):
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

  @classmethod
  def get_default(cls, vocab: int, num_draft: int, dtype=jnp.float32, *, batch: int | None = None,
                  has_draft_logits=True, vmem_budget: int | None = None,
                  max_block_b: int = DEFAULT_MAX_BLOCK_B,
                  device_kind: str | None = None) -> BlockSizes:
    """Tiles whose double-buffered target and draft blocks fit `vmem_budget` bytes.

    Reading the logits once matters more than batching grid steps (each extra vocabulary tile
    makes every pass stream the logits from HBM again), so this takes the largest `block_b`
    (a power of two, at most `max_block_b` and the batch) whose blocks still hold the whole
    vocabulary; when not even one row does, `block_b = 1` and the largest tile that fits. Rows are
    counted padded to the dtype's sublane tile (8 for 32-bit, 16 for 16-bit), as VMEM stores them.
    `vmem_budget` defaults to the share of `device_kind`'s VMEM (`vmem_budget_for`).
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
    return cls(block_v=min(block_v, whole), block_b=block_b)


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


def vmem_budget_for(device_kind: str | None) -> int:
  """Bytes of VMEM the double-buffered logits blocks may take on `device_kind`."""
  return int(TPU_VMEM_BYTES[tpu_generation(device_kind)] * VMEM_BLOCK_FRACTION)


def vmem_limit_for(device_kind: str | None) -> int | None:
  """The kernel's `vmem_limit_bytes` on `device_kind` (None: the compiler's default)."""
  if device_kind is None:
    return None
  return int(TPU_VMEM_BYTES[tpu_generation(device_kind)] * VMEM_LIMIT_FRACTION)


def compile_device_kind() -> str | None:
  """The kind of the TPU this process compiles for, or None when the default backend is not TPU
  (e.g. `jax.export(..., platforms=["tpu"])` from a CPU host)."""
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return None
  return device.device_kind if device.platform == "tpu" else None
