"""HBM traffic of one speculative-decoding round on TPU, from the compiled programs, and the speedup
it implies. An estimate from the TPU compiler's cost model, not a measurement.

    python -m benchmarks.tpu_traffic [--chips v5e v6e] [--batches 1 8 64] [--unrolled]

Nothing runs on a TPU: libtpu's compiler compiles each program ahead of time for abstract devices
(`specjax.testing.tpu`), and the bytes are read off the compiled program.

**What is compiled.** The Qwen2.5-Coder-1.5B target and 0.5B draft (`tpu.REAL_CONFIGS`, real
depth: 28 and 24 layers), bfloat16 weights, in the stacked layout `Model.for_platform()` picks on
TPU (one `lax.scan` over layers), on one v5e chip (`"v5e-1"`) and on a v6e 2x2 slice
(`"v6e-2x2"`, mesh `(data, model) = (2, 2)`, figures per chip), at batch 1, 8 and 64, with a
`CAPACITY`-slot KV cache of which `LIVE` slots are live (each row's `starts`). Three programs:

  * `target_step`: `target(tokens [B, 1], starts, cache)` -> `(logits, cache)`, one token per row;
  * `verify`: `target(block [B, k + 1], starts, cache)` then `specjax.verify.dispatch.verify_tokens`
    on its logits (greedy, a point-mass drafter: no draft logits, `impl="auto"`) -> `(tokens,
    num_accepted, cache)`: the forward and rule `specjax.loop.round.verify_block` runs at its one
    width `k + 1` (its bookkeeping on `[B, k + 1]` tokens is left out);
  * `draft_step`: `draft(tokens [B, 1], starts, cache)` -> `(logits, cache)`.

The cache argument is donated: `decode` carries it in its `while_loop` state, where XLA updates it
in place; a step that did not donate it would copy the whole cache into its output.

**How bytes are counted** (`hbm_traffic`). `cost_analysis()`'s "bytes accessed" is not HBM traffic
on TPU: it counts a loop body once, and it counts every memory space. XLA:TPU stages weights in VMEM
(an async `copy-start`/`slice-start` from HBM, a `ConcatBitcast` custom call, then the matmul fusion
reading VMEM), and "bytes accessed" adds up all three. So the HBM figure here walks the compiled HLO
(`Compiled.text()`): for each instruction executed, the bytes of its operands and outputs that live
in HBM (a layout without a `S(n)` memory space, n > 0), where a fusion reads a parameter only
through `dynamic-slice` / `slice` / `gather` (possibly in a nested fusion) only the sliced bytes, an
in-place `dynamic-update-slice` / `scatter` only its update, an async copy or slice its HBM side
once, and `*-done`, tuples, bitcasts and parameters nothing. The two Pallas kernels count what
their schedules move: the cache write (`specjax_kv_write`) one aligned window per row and layer,
the cache attention (`specjax_cache_attention_block<n>`) of the stacked keys and values only the
`n`-slot blocks up to each row's last live one (`LIVE` slots live: the block index is clamped
there, and a repeated block is not fetched again). A `while` body counts its trip count
times, read from its condition (`counter < constant`, the start from the loop's initial tuple);
a `conditional` counts its most expensive branch. Sizes are logical (tile padding left out).

Two cross-checks of the trip-count handling, both in the JSON:
  * the unstacked layout (`Model.unstacked()`: layers unrolled, no loop) at 1 and 2 layers,
    extrapolated linearly to the real depth, `f(L) = f(1) + (L - 1) (f(2) - f(1))`, for the HBM
    walk and for XLA's own "bytes accessed" and "flops" (which are then loop-free);
  * with `--unrolled`, the unstacked layout at the real depth, no extrapolation.
Only the stacked layout attends through the cache attention kernel (the unstacked one keeps the
dense einsums over every slot), so since that kernel the unstacked HBM figures lie above the
stacked ones by about the dead half of the cache.
Flops for the roofline (and XLA's "bytes accessed", reported beside the HBM figure) are XLA's for
the unstacked layout at the real depth where compiled, else extrapolated (flops are linear in the
layer count: both agree; at batch 1 XLA:TPU counts a matrix-vector product as about 2.5x its
multiply-adds, which does not matter where the bytes bound the time). `cache_buffer_bytes` is the
HBM traffic of the instructions whose shape holds a whole K or V buffer (one device's shard):
copies, relayouts and slices of the cache rather than reads of it by attention.

**The floor** (`floor_bytes`, per chip): every weight's per-chip shard read once -- except an
untied input embedding, of which only the `B x T` looked-up rows are needed (a tied one is read
whole as the output projection) -- plus the live KV cache (`LIVE` slots of every layer, keys and
values, the chip's shard). `ratio = hbm_bytes / floor`; the bar is `BAR` (1.2x).

**Speedup** (per chip, a roofline): `t(program) = max(hbm_bytes / HBM bandwidth, flops / peak
bf16 flops)` from `jax.experimental.pallas.tpu.get_tpu_info_for_chip`, and
`speedup = tau * t(target_step) / (k * t(draft_step) + t(verify))` with `tau = TAU` emitted tokens
per round at `k = K` (measured on CPU for this pair: greedy, the 36-prompt real suite).
Assumptions: the roofline bound is reached (no launch overheads or per-op latency, no time for the
v6e mesh's collectives), `tau` does not depend on the batch, a round is `k` draft steps and one
verify (no host sync, the loop's bookkeeping free).

Writes `benchmarks/results/tpu_traffic.json` (checkpointed after every program: a rerun resumes)
and `tpu_traffic.png`, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import pathlib
import re
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
JSON_PATH = RESULTS / "tpu_traffic.json"
PNG_PATH = RESULTS / "tpu_traffic.png"
LABEL = "estimate from the TPU compiler's cost model, not a measurement"

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
# chip -> (specjax.testing.tpu.TOPOLOGIES name, pltpu.ChipVersion member name)
CHIPS = {"v5e": ("v5e-1", "TPU_V5E"), "v6e": ("v6e-2x2", "TPU_V6E")}
BATCHES = (1, 8, 64)
PROGRAMS = ("target_step", "verify", "draft_step")
LIVE = 1024  # live tokens in every row's KV cache
CAPACITY = 2048  # cache slots
K = 6  # drafts per round
TAU = 4.22  # emitted tokens per round at k = 6, greedy, the 36-prompt real suite (CPU)
BAR = 1.2  # a program's HBM bytes over its floor


# --------------------------------------------------------------------------------------------
# HBM bytes from the compiled HLO text.
# --------------------------------------------------------------------------------------------

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1, "s4": 0.5, "u4": 0.5, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\](\{[^{}]*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_COMMENT = re.compile(r"/\*.*?\*/")
# No traffic of their own: views, tuples, and the second halves of async pairs (counted at start).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-done", "slice-done",
         "async-done", "all-reduce-done", "all-gather-done", "collective-permute-done",
         "send-done", "recv-done"}
_SLICING = {"dynamic-slice", "slice", "gather"}  # read only what they return of operand 0
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # op -> operand index of its update
_VIEW = object()  # `_Walk.param_read`: the value leaves the computation unread (a view)
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


@dataclasses.dataclass(frozen=True)
class _Array:
  dtype: str
  dims: tuple[int, ...]
  space: int  # memory space: 0 = HBM (1 = VMEM, others: SMEM, sync flags...)

  @property
  def bytes(self) -> int:
    return int(math.prod(self.dims) * DTYPE_BYTES[self.dtype])


def _leaves(shape: str) -> list[_Array]:
  """The arrays of an HLO shape string (a tuple flattened in order) with their memory spaces."""
  out = []
  for m in _ARRAY.finditer(shape):
    if m.group(1) not in DTYPE_BYTES:
      continue
    dims = tuple(int(d) for d in m.group(2).split(",") if d)
    layout = m.group(3) or ""
    space = _SPACE.search(layout.split(":", 1)[1]) if ":" in layout else None
    out.append(_Array(m.group(1), dims, int(space.group(1)) if space else 0))
  return out


def _close(text: str, i: int) -> int:
  """The index just past the bracket that closes `text[i]`."""
  opener = text[i]
  closer = {"(": ")", "{": "}", "[": "]"}[opener]
  depth = 0
  for j in range(i, len(text)):
    if text[j] == opener:
      depth += 1
    elif text[j] == closer:
      depth -= 1
      if depth == 0:
        return j + 1
  raise ValueError(f"unbalanced {opener!r} in {text[i:i + 80]!r}")


def _split_top(text: str) -> list[str]:
  parts, depth, cur = [], 0, []
  for c in text:
    depth += (c in "([{") - (c in ")]}")
    if c == "," and depth == 0:
      parts.append("".join(cur).strip())
      cur = []
    else:
      cur.append(c)
  tail = "".join(cur).strip()
  return parts + [tail] if tail else parts


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  op: str
  operands: list[str]
  args: str  # the text from the operand list's "(" on (operands and attributes)
  root: bool

  @property
  def leaves(self) -> list[_Array]:
    return _leaves(self.shape)

  def attr(self, key: str) -> str | None:
    m = re.search(r"\b" + key + r"=(%[\w.\-]+|\"[^\"]*\"|\{[^}]*\})", self.args)
    return None if m is None else m.group(1).lstrip("%")

  @property
  def op_name(self) -> str:
    m = re.search(r'op_name="([^"]*)"', self.args)
    return m.group(1) if m else ""


def _parse_instr(line: str) -> _Instr:
  line = _COMMENT.sub("", line).strip()
  root = line.startswith("ROOT ")
  if root:
    line = line[5:]
  name, rest = line.split(" = ", 1)
  end = _close(rest, 0) if rest.startswith("(") else rest.index(" ")
  shape, rest = rest[:end], rest[end:].strip()
  paren = rest.index("(")
  close = _close(rest, paren)
  operands = [o.split(" ")[-1].lstrip("%") for o in _split_top(rest[paren + 1:close - 1])]
  return _Instr(name.lstrip("%"), shape, rest[:paren], operands, rest[paren:], root)


def _parse_module(text: str) -> tuple[dict[str, list[_Instr]], str]:
  """`({computation name: instructions}, entry name)` of an HLO module's text."""
  comps, entry, cur, name = {}, None, None, None
  for line in text.splitlines():
    if cur is None:
      m = re.match(r"(ENTRY )?%([\w.\-]+) \(.*\{\s*$", line)
      if m:
        name, cur = m.group(2), []
        entry = name if m.group(1) else entry
      continue
    if line.strip() == "}":
      comps[name], cur = cur, None
    elif " = " in line:
      cur.append(_parse_instr(line))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry


@dataclasses.dataclass
class Traffic:
  """What one compiled program moves through HBM (per device), its loops counted in full.

  Attributes:
    hbm_bytes: bytes read from and written to HBM.
    all_bytes: the same walk over every memory space (HBM, VMEM, ...).
    collectives: collective ops executed (all-reduce, all-gather, ...; loops counted in full).
    collective_bytes: the bytes those collectives return, in any memory space (ICI traffic, not
      part of `hbm_bytes` unless their buffers are in HBM).
    loops: `(while instruction, trip count, times its computation runs)` per loop met.
    rows: every instruction that moves HBM bytes, `(hbm bytes, op, shape, op_name)` (totals over
      its executions), largest first.
  """

  hbm_bytes: int
  all_bytes: int
  collectives: int
  collective_bytes: int
  loops: list
  rows: list

  def whole_buffer_bytes(self, elements: int) -> int:
    """HBM bytes of the instructions with an array of exactly `elements` elements in their shape
    (one KV cache buffer: the copies, relayouts and slices of a whole cache buffer)."""
    return sum(b for b, _, shape, _ in self.rows
               if any(math.prod(a.dims) == elements for a in _leaves(shape)))


class _Walk:
  """One pass over a module, counting bytes in HBM (or in every memory space: `all_spaces`)."""

  def __init__(self, comps, entry, all_spaces: bool, live_slots: int | None = None):
    self.comps, self.entry, self.all_spaces = comps, entry, all_spaces
    self.live_slots = live_slots
    self.tables = {c: {i.name: i for i in instrs} for c, instrs in comps.items()}
    self.loops, self.rows = [], collections.Counter()
    self.collectives = self.collective_bytes = 0
    self._users, self._roots = {}, {}

  def mem(self, a: _Array) -> int:
    return a.bytes if (self.all_spaces or a.space == 0) else 0

  def operand(self, comp: str, name: str) -> int:
    return sum(self.mem(a) for a in self.tables[comp][name].leaves)

  def users(self, comp: str):
    if comp not in self._users:
      users = collections.defaultdict(list)
      for instr in self.comps[comp]:
        for pos, o in enumerate(instr.operands):
          users[o].append((instr, pos))
      self._users[comp] = users
    return self._users[comp]

  def params(self, comp: str) -> dict[int, _Instr]:
    return {int(re.match(r"\((\d+)\)", i.args).group(1)): i
            for i in self.comps[comp] if i.op == "parameter"}

  def param_read(self, comp: str, name: str, full: int):
    """Bytes a fused computation reads of its value `name` (`full` if read whole); `_VIEW` if
    `name` leaves the computation as its root (a nested fusion that only bitcasts): the caller
    then follows that fusion's own users."""
    if name == self.root(comp).name:
      return _VIEW
    total = 0
    for user, pos in self.users(comp).get(name, []):
      if user.op == "bitcast":
        read = self.param_read(comp, user.name, full)
      elif user.op in _SLICING and pos == 0:
        read = sum(a.bytes for a in user.leaves)
      elif user.op in _IN_PLACE and pos == 0:
        read = 0  # the buffer updated in place: its update is counted with the output
      elif user.op == "fusion":
        inner = user.attr("calls")
        read = self.param_read(inner, self.params(inner)[pos].name, full)
        if read is _VIEW:
          read = self.param_read(comp, user.name, full)
      else:
        return full
      if read is _VIEW:
        return _VIEW
      total += read
    return min(total, full)

  def root(self, comp: str) -> _Instr:
    if comp not in self._roots:
      self._roots[comp] = next(i for i in self.comps[comp] if i.root)
    return self._roots[comp]

  def fusion(self, comp: str, instr: _Instr) -> tuple[int, int]:
    called = instr.attr("calls")
    table = self.tables[called]
    params = self.params(called)
    root = self.root(called)
    outs = [table[o] for o in root.operands] if root.op == "tuple" else [root]
    in_place, write = set(), 0
    for out in outs:
      size = sum(self.mem(a) for a in out.leaves)
      if out.op in _IN_PLACE:
        base = out.operands[0]
        while table[base].op == "bitcast":
          base = table[base].operands[0]
        if table[base].op == "parameter":
          in_place.add(base)
          update = table[out.operands[_IN_PLACE[out.op]]]
          size = min(size, sum(a.bytes for a in update.leaves))
      write += size
    read = 0
    for index, name in enumerate(instr.operands):
      full = self.operand(comp, name)
      if full and params[index].name not in in_place:
        part = self.param_read(called, params[index].name, full)
        read += full if part is _VIEW else part
    return read, write

  def trip_count(self, comp: str, instr: _Instr) -> int:
    known = re.search(r'known_trip_count"?:\{"n":"(\d+)"', instr.args)
    if known:
      return int(known.group(1))
    cond = instr.attr("condition")
    table = self.tables[cond]
    root = self.root(cond)
    direction = re.search(r"direction=(\w+)", root.args)
    if root.op != "compare" or direction is None:
      raise ValueError(f"{instr.name}: loop condition is {root.op}, not a compare")
    direction = direction.group(1)
    a, b = (table[o] for o in root.operands)
    if a.op == "constant" and b.op != "constant":
      a, b = b, a
      direction = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}[direction]
    if a.op != "get-tuple-element" or b.op != "constant" or direction not in ("LT", "LE"):
      raise ValueError(f"{instr.name}: loop condition {a.op} {direction} {b.op} not understood")
    limit = int(re.match(r"\((-?\d+)\)", b.args).group(1))
    index = int(re.search(r"index=(\d+)", a.args).group(1))
    start = 0
    init = self.tables[comp][instr.operands[0]]
    if init.op == "tuple":
      node = self.tables[comp][init.operands[index]]
      while node.op in ("copy", "bitcast") and node.operands:
        node = self.tables[comp][node.operands[0]]
      if node.op == "constant":
        start = int(re.match(r"\((-?\d+)\)", node.args).group(1))
    return max(limit - start + (direction == "LE"), 0)

  def cache_attention(self, comp: str, instr: _Instr) -> tuple[int, int]:
    """The cache attention kernel (`specjax.kernels.cache_attention`; operands: starts, layer,
    window, row positions, query rows, then the stacked keys and values `[L, B, C, S, E]`):
    its small operands and outputs, and of the keys and values only the blocks its schedule
    fetches, `fetched_slots(live, S, block)` slots of every row (the block index clamped to the
    row's last live block; `live` = `live_slots`, all `S` where not given), one layer."""
    from specjax.kernels.cache_attention import fetched_slots  # pylint: disable=C0415
    block = int(re.search(r"_block(\d+)", instr.name).group(1))
    read = sum(self.operand(comp, o) for o in instr.operands[:5])
    for name in instr.operands[5:7]:
      (cache,) = self.tables[comp][name].leaves
      _, batch, groups, slots, width = cache.dims
      live = slots if self.live_slots is None else min(self.live_slots, slots)
      if self.mem(cache):
        read += int(batch * groups * fetched_slots(live, slots, block) * width
                    * DTYPE_BYTES[cache.dtype])
    return read, sum(self.mem(a) for a in instr.leaves)

  def computation(self, comp: str, times: int) -> int:
    return sum(self.instruction(comp, instr, times) for instr in self.comps[comp])

  def instruction(self, comp: str, instr: _Instr, times: int) -> int:
    op = instr.op
    if op in _FREE:
      return 0
    if op == "while":
      trip = self.trip_count(comp, instr)
      self.loops.append((instr.name, trip, times))
      return (self.computation(instr.attr("body"), times * trip)
              + self.computation(instr.attr("condition"), times * (trip + 1)))
    if op == "conditional":
      branches = re.findall(r"%([\w.\-]+)", instr.attr("branch_computations") or "")
      branches = branches or [instr.attr("true_computation"), instr.attr("false_computation")]
      return max(self.computation(b, times) for b in branches)
    if op == "call" or (op == "async-start" and instr.attr("calls")):
      return self.computation(instr.attr("calls") or instr.attr("to_apply"), times)
    leaves = instr.leaves
    if op == "custom-call" and "ConcatBitcast" in instr.args:
      return 0  # joins VMEM slices of an async slice: a view
    if op == "custom-call" and instr.name.startswith("specjax_kv_write"):
      # The cache write kernel (`specjax.kernels.kv_write`; the cache, operand 2, aliased to the
      # output): reads the starts and the padded block, and reads and writes back one window of
      # the block's padded size per row and layer, not the cache.
      window = sum(a.bytes for a in self.tables[comp][instr.operands[1]].leaves)
      read = self.operand(comp, instr.operands[0]) + self.operand(comp, instr.operands[1]) + window
      write = window
    elif op == "custom-call" and instr.name.startswith("specjax_cache_attention"):
      read, write = self.cache_attention(comp, instr)
    elif op == "copy-start":  # (destination, source, context)
      read, write = self.operand(comp, instr.operands[0]), self.mem(leaves[0])
    elif op == "slice-start":  # ((source), destination, context): reads the slice
      src = self.tables[comp][instr.operands[0]].leaves
      dest = leaves[len(src)]
      read = dest.bytes if any(self.mem(a) for a in src) else 0
      write = self.mem(dest)
    elif op == "fusion":
      read, write = self.fusion(comp, instr)
    elif op in _IN_PLACE:
      at = _IN_PLACE[op]
      update = sum(a.bytes for a in self.tables[comp][instr.operands[at]].leaves)
      read = sum(self.operand(comp, o) for o in instr.operands[at:])
      write = update if any(self.mem(a) for a in leaves) else 0
    elif op in _SLICING:
      out = sum(a.bytes for a in leaves)
      read = (min(self.operand(comp, instr.operands[0]), out)
              + sum(self.operand(comp, o) for o in instr.operands[1:]))
      write = sum(self.mem(a) for a in leaves)
    else:
      read = sum(self.operand(comp, o) for o in instr.operands)
      write = sum(self.mem(a) for a in leaves)
    total = (read + write) * times
    if op.startswith(_COLLECTIVES) and not op.endswith("-done"):
      self.collectives += times
      self.collective_bytes += sum(a.bytes for a in leaves) * times
    if total:
      self.rows[(op, instr.shape, instr.op_name)] += total
    return total


def hbm_traffic(text: str, live_slots: int | None = None) -> Traffic:
  """The bytes one execution of a compiled program moves, from its HLO text (`Compiled.text()`).

  Args:
    text: the optimized HLO module (one device's program).
    live_slots: live slots of every cache row (the cache attention kernel's reads depend on
      them, a run-time value); None counts every slot.

  Returns:
    `Traffic`, with `while` bodies counted their trip count times (read from each loop's
    condition; a condition that is not `counter < constant` raises ValueError).
  """
  comps, entry = _parse_module(text)
  hbm = _Walk(comps, entry, all_spaces=False, live_slots=live_slots)
  everything = _Walk(comps, entry, all_spaces=True, live_slots=live_slots)
  hbm_bytes = hbm.computation(entry, 1)
  all_bytes = everything.computation(entry, 1)
  rows = [(b, op, shape, name) for (op, shape, name), b in hbm.rows.most_common()]
  return Traffic(hbm_bytes, all_bytes, hbm.collectives, hbm.collective_bytes, hbm.loops, rows)


# --------------------------------------------------------------------------------------------
# The programs and their abstract arguments.
# --------------------------------------------------------------------------------------------

def target_step(model, tokens, starts, cache):
  """One forward over `tokens [B, T]` at `starts` with the cache: `(logits, new cache)`."""
  out = model(tokens, starts, cache)
  return out.logits, out.cache


def verify(model, block, starts, cache, seeds):
  """The target's forward over `block [B, k + 1]` (the last token, then `k` drafts) and the
  greedy accept rule on its logits: `(tokens [B, k + 1], num_accepted [B], new cache)`."""
  from specjax.core.sampling import Sampling  # pylint: disable=import-outside-toplevel
  from specjax.verify.dispatch import verify_tokens  # pylint: disable=import-outside-toplevel
  out = model(block, starts, cache)
  result = verify_tokens(out.logits, None, block[:, 1:], sampling=Sampling(), seeds=seeds,
                         positions=starts + 1, impl="auto")
  return result.tokens, result.num_accepted, out.cache


def abstract_setup(config, mesh, batch: int, length: int, *, capacity: int = CAPACITY,
                   unstacked: bool = False):
  """`(model, tokens [B, length], starts [B], cache, seeds [B])`: `ShapeDtypeStruct`s sharded on
  `mesh` as `sj.shard` / `cache_shardings` place them (rows over "data" where they divide),
  bfloat16 weights and cache; `unstacked` gives `Model.unstacked()`'s layout and a per-layer
  cache."""
  from specjax.parallel.mesh import cache_shardings, param_shardings  # pylint: disable=C0415
  from specjax.testing import tpu  # pylint: disable=import-outside-toplevel
  model = tpu.abstract_model(config, mesh, jnp.bfloat16)
  if unstacked:
    shapes = jax.eval_shape(lambda m: m.unstacked(), model)
    model = dataclasses.replace(shapes, params=tpu.abstract_like(
        shapes.params, param_shardings(shapes, mesh)))
  cache = jax.eval_shape(lambda: model.init_cache(batch, capacity))
  cache = tpu.abstract_like(cache, cache_shardings(cache, mesh))
  tokens, _ = tpu.abstract_tokens(mesh, batch, length)
  rows = tokens.sharding.spec[0] if len(tokens.sharding.spec) else None
  starts = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(mesh, P(rows)))
  seeds = jax.ShapeDtypeStruct((batch,), jnp.uint32, sharding=NamedSharding(mesh, P(rows)))
  return model, tokens, starts, cache, seeds


def compile_program(fn, *args, mesh, donate=()):
  """`specjax.testing.tpu.compile_call` with `donate_argnums` (the cache is donated, as in the
  decode loop's state). Returns `tpu.Compiled`."""
  from specjax.parallel.mesh import use_mesh  # pylint: disable=import-outside-toplevel
  from specjax.testing import tpu  # pylint: disable=import-outside-toplevel
  with use_mesh(mesh):
    compiled = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
  return tpu.Compiled(compiled, compiled.memory_analysis())


def _shard_bytes(x) -> int:
  shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
  return int(math.prod(shape) * jnp.dtype(x.dtype).itemsize)


def floor_bytes(model, cache, *, live: int, tokens_per_row: int) -> dict:
  """The least HBM traffic of one forward, per device: every weight's shard read once (an untied
  input embedding: only the looked-up rows, `B * tokens_per_row` of them at most) plus the live
  part (`live` of the cache's slots, every layer, keys and values) of the device's cache shard.

  Returns:
    `{"weights": bytes, "kv_live": bytes, "floor": their sum}`.
  """
  params = dict(model.params)
  weights = 0
  embed = params.pop("embed")
  if model.config.tie_embeddings and "lm_head" not in params:
    weights += _shard_bytes(embed)
  else:
    rows, cols = embed.sharding.shard_shape(embed.shape)
    batch = cache.batch
    weights += min(rows, batch * tokens_per_row) * cols * jnp.dtype(embed.dtype).itemsize
  weights += sum(_shard_bytes(x) for x in jax.tree.leaves(params))
  kv = sum(_shard_bytes(x) for x in jax.tree.leaves((cache.k, cache.v)))
  kv_live = kv * live // cache.max_len
  return {"weights": weights, "kv_live": kv_live, "floor": weights + kv_live}


def build(program: str, config_names=(TARGET, DRAFT), *, topology: str, batch: int,
          num_layers: int | None = None, unstacked: bool = False, capacity: int = CAPACITY,
          num_draft: int = K):
  """`(fn, args, donate, model, cache, tokens_per_row, mesh)` of one program, ready to compile.

  `num_layers` replaces the model's layer count (real widths and vocabulary); None keeps it."""
  from specjax.testing import tpu  # pylint: disable=import-outside-toplevel
  target_name, draft_name = config_names
  config = tpu.REAL_CONFIGS[draft_name if program == "draft_step" else target_name]
  if num_layers is not None:
    config = tpu.with_layers(config, num_layers)
  mesh = tpu.topology_mesh(topology)
  length = num_draft + 1 if program == "verify" else 1
  model, tokens, starts, cache, seeds = abstract_setup(config, mesh, batch, length,
                                                      capacity=capacity, unstacked=unstacked)
  if program == "verify":
    return verify, (model, tokens, starts, cache, seeds), (3,), model, cache, length, mesh
  return target_step, (model, tokens, starts, cache), (3,), model, cache, length, mesh


# --------------------------------------------------------------------------------------------
# Measuring one program.
# --------------------------------------------------------------------------------------------

def _layers(program: str) -> int:
  from specjax.testing import tpu  # pylint: disable=import-outside-toplevel
  return tpu.REAL_CONFIGS[DRAFT if program == "draft_step" else TARGET].num_layers


def _compile(program, *, topology, batch, num_layers=None, unstacked=False):
  fn, args, donate, model, cache, length, mesh = build(
      program, topology=topology, batch=batch, num_layers=num_layers, unstacked=unstacked)
  start = time.perf_counter()
  compiled = compile_program(fn, *args, mesh=mesh, donate=donate)
  seconds = time.perf_counter() - start
  return compiled, model, cache, length, seconds


def _xla(compiled) -> dict:
  cost = compiled.cost()
  return {"bytes_accessed": float(cost.get("bytes accessed", 0.0)),
          "flops": float(cost.get("flops", 0.0))}


def measure(program: str, *, chip: str, batch: int, unrolled: bool = False, previous=None,
            log=print) -> dict:
  """One program on one chip at one batch: HBM bytes (the stacked layout, loops counted in
  full), its floor and ratio, the bytes of whole-cache-buffer copies, XLA's flops and bytes of the
  unstacked layout at 1 and 2 layers (extrapolated in `derive`), and with `unrolled` the unstacked
  layout at the real depth. The unstacked figures of a `previous` record are reused."""
  topology = CHIPS[chip][0]
  layers = _layers(program)
  compiled, model, cache, length, seconds = _compile(program, topology=topology, batch=batch)
  traffic = hbm_traffic(compiled.text(), live_slots=LIVE)
  floor = floor_bytes(model, cache, live=LIVE, tokens_per_row=length)
  buffer = jax.tree.leaves(cache.k)[0]
  record = {
      "chip": chip, "topology": topology, "batch": batch, "program": program,
      "layers": layers, "tokens_per_row": length, "live": LIVE, "capacity": CAPACITY,
      "hbm_bytes": traffic.hbm_bytes, "all_spaces_bytes": traffic.all_bytes,
      "collectives": traffic.collectives, "collective_bytes": traffic.collective_bytes, **floor,
      "ratio": traffic.hbm_bytes / floor["floor"],
      "cache_buffer_bytes": traffic.whole_buffer_bytes(math.prod(
          buffer.sharding.shard_shape(buffer.shape))),
      "loops": traffic.loops,
      "top": [{"hbm_bytes": b, "op": op, "shape": shape[:200], "op_name": name}
              for b, op, shape, name in traffic.rows[:12]],
      "xla_reported": _xla(compiled),
      "hbm_capacity_needed": compiled.total_bytes, "compile_seconds": round(seconds, 1),
  }
  log(f"  {chip} B={batch} {program}: stacked {traffic.hbm_bytes / 1e9:.3f} GB, floor "
      f"{floor['floor'] / 1e9:.3f} GB, ratio {record['ratio']:.3f}, whole-cache-buffer ops "
      f"{record['cache_buffer_bytes'] / 1e9:.3f} GB ({seconds:.0f} s)")
  previous = previous or {}
  if "unstacked_1_2" in previous:
    record["unstacked_1_2"] = previous["unstacked_1_2"]
  else:  # the loop-free layout at 1 and 2 layers
    per = {}
    for n in (1, 2):
      small, *_ = _compile(program, topology=topology, batch=batch, num_layers=n, unstacked=True)
      per[n] = dict(_xla(small), hbm_bytes=hbm_traffic(small.text(), LIVE).hbm_bytes)
    record["unstacked_1_2"] = {"at_1": per[1], "at_2": per[2]}
  if "unstacked_full" in previous:
    record["unstacked_full"] = previous["unstacked_full"]
  elif unrolled:
    full, *_ = _compile(program, topology=topology, batch=batch, unstacked=True)
    record["unstacked_full"] = dict(_xla(full),
                                    hbm_bytes=hbm_traffic(full.text(), LIVE).hbm_bytes)
  derive(record)
  extrapolated = record["unstacked_1_2"]["extrapolated"]
  log(f"    unstacked 1-2 extrapolated: hbm {extrapolated['hbm_bytes'] / 1e9:.3f} GB, xla bytes "
      f"{extrapolated['bytes_accessed'] / 1e9:.3f} GB, flops {extrapolated['flops']:.3g}"
      + (f"; unstacked full: hbm {record['unstacked_full']['hbm_bytes'] / 1e9:.3f} GB, xla "
         f"{record['unstacked_full']['bytes_accessed'] / 1e9:.3f} GB, flops "
         f"{record['unstacked_full']['flops']:.3g}" if "unstacked_full" in record else ""))
  return record


def derive(record: dict) -> dict:
  """Adds the loop-free figures: the unstacked layout's XLA bytes, flops and HBM bytes at 1 and
  2 layers extrapolated to the real depth (`f(L) = f(1) + (L - 1) (f(2) - f(1))`), then
  `flops` and `xla_bytes_accessed` (XLA's own "bytes accessed", every memory space): from the
  unstacked layout at the real depth where compiled (`xla_source` says which), else
  extrapolated."""
  per, layers = record["unstacked_1_2"], record["layers"]
  per["extrapolated"] = {key: per["at_1"][key] + (layers - 1) * (per["at_2"][key]
                                                                  - per["at_1"][key])
                         for key in per["at_1"]}
  source = "unstacked_full" if "unstacked_full" in record else "extrapolated"
  figures = record.get("unstacked_full", per["extrapolated"])
  record["xla_source"] = source
  record["flops"] = figures["flops"]
  record["xla_bytes_accessed"] = figures["bytes_accessed"]
  record["xla_ratio"] = record["xla_bytes_accessed"] / record["floor"]
  return record


# --------------------------------------------------------------------------------------------
# Roofline and speedup.
# --------------------------------------------------------------------------------------------

def chip_info(chip: str) -> dict:
  """HBM bandwidth and peak bf16 flops of one chip (`pltpu.get_tpu_info_for_chip`)."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel
  info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, CHIPS[chip][1]), 1)
  return {"mem_bw_bytes_per_second": info.mem_bw_bytes_per_second,
          "bf16_ops_per_second": info.bf16_ops_per_second}


def roofline(record: dict, info: dict) -> dict:
  """`t = max(hbm_bytes / bandwidth, flops / peak)`, and which bound it is."""
  memory = record["hbm_bytes"] / info["mem_bw_bytes_per_second"]
  compute = record["flops"] / info["bf16_ops_per_second"]
  return {"t_memory_s": memory, "t_compute_s": compute, "t_s": max(memory, compute),
          "bound": "memory" if memory >= compute else "compute",
          "t_floor_s": max(record["floor"] / info["mem_bw_bytes_per_second"], compute)}


def speedup(times: dict, *, tau: float = TAU, k: int = K) -> float:
  """`tau * t(target_step) / (k * t(draft_step) + t(verify))`."""
  return tau * times["target_step"] / (k * times["draft_step"] + times["verify"])


def summarize(records: list[dict]) -> dict:
  """Roofline times per record and the estimated speedups per (chip, batch)."""
  infos = {chip: chip_info(chip) for chip in {r["chip"] for r in records}}
  for r in records:
    derive(r)
    r["roofline"] = roofline(r, infos[r["chip"]])
  groups = collections.defaultdict(dict)
  for r in records:
    groups[(r["chip"], r["batch"])][r["program"]] = r
  speedups = []
  for (chip, batch), programs in sorted(groups.items()):
    if set(programs) != set(PROGRAMS):
      continue
    times = {p: programs[p]["roofline"]["t_s"] for p in PROGRAMS}
    floors = {p: programs[p]["roofline"]["t_floor_s"] for p in PROGRAMS}
    speedups.append({
        "chip": chip, "batch": batch, "tau": TAU, "k": K,
        "t_target_step_s": times["target_step"], "t_draft_step_s": times["draft_step"],
        "t_verify_s": times["verify"], "speedup": speedup(times),
        "speedup_at_floor": speedup(floors),
        "tokens_per_s_target_alone": batch / times["target_step"],
        "tokens_per_s_speculative": batch * TAU / (K * times["draft_step"] + times["verify"]),
    })
  return {"chips": infos, "speedups": speedups}


# --------------------------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------------------------

def markdown(records: list[dict], speedups: list[dict]) -> str:
  """Two README tables: bytes vs floor per program, and the estimated speedups."""
  gb = lambda b: f"{b / 1e9:.3f}"
  lines = [f"HBM traffic per program, per chip ({LABEL}; Qwen2.5-Coder-1.5B target, 0.5B draft, "
           f"bf16, {LIVE} live of {CAPACITY} cache slots, k = {K}; v6e: one chip of a 2x2 mesh "
           "(data 2, model 2)). Floor: weights + live KV cache read once. Cache copies: HBM "
           "bytes of ops that copy, relayout or slice a whole K or V buffer. XLA bytes: "
           "`cost_analysis()` \"bytes accessed\" of the unrolled layout (counts VMEM staging "
           "too).", "",
           "| chip | batch | program | HBM GB | floor GB | ratio | cache copies GB "
           "| XLA bytes GB (ratio) | GFLOP | roofline ms | bound |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
  order = {p: i for i, p in enumerate(PROGRAMS)}
  for r in sorted(records, key=lambda r: (r["chip"], r["batch"], order[r["program"]])):
    flag = " **>1.2x**" if r["ratio"] > BAR else ""
    lines.append(
        f"| {r['chip']} | {r['batch']} | {r['program']} | {gb(r['hbm_bytes'])} | "
        f"{gb(r['floor'])} | {r['ratio']:.2f}{flag} | {gb(r['cache_buffer_bytes'])} | "
        f"{gb(r['xla_bytes_accessed'])} ({r['xla_ratio']:.2f}) | {r['flops'] / 1e9:.1f} | "
        f"{r['roofline']['t_s'] * 1e3:.3f} | {r['roofline']['bound']} |")
  lines += ["", f"Estimated speedup over the target alone ({LABEL}; tau = {TAU} at k = {K}, "
            "roofline times, tau independent of batch):", "",
            "| chip | batch | target step ms | draft step ms | verify ms | speedup "
            "| at the floor |",
            "|---|---:|---:|---:|---:|---:|---:|"]
  for s in speedups:
    lines.append(f"| {s['chip']} | {s['batch']} | {s['t_target_step_s'] * 1e3:.3f} | "
                 f"{s['t_draft_step_s'] * 1e3:.3f} | {s['t_verify_s'] * 1e3:.3f} | "
                 f"{s['speedup']:.2f}x | {s['speedup_at_floor']:.2f}x |")
  return "\n".join(lines)


def plot(records: list[dict], speedups: list[dict], path: pathlib.Path = PNG_PATH) -> None:
  """Ratio to floor per program and the estimated speedups, both panels labelled."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
  chips = sorted({r["chip"] for r in records})
  batches = sorted({r["batch"] for r in records})
  width = 0.8 / (len(chips) * len(PROGRAMS))
  for ci, chip in enumerate(chips):
    for pi, program in enumerate(PROGRAMS):
      xs, ys = [], []
      for bi, batch in enumerate(batches):
        for r in records:
          if (r["chip"], r["batch"], r["program"]) == (chip, batch, program):
            xs.append(bi + (ci * len(PROGRAMS) + pi) * width - 0.4 + width / 2)
            ys.append(r["ratio"])
      left.bar(xs, ys, width, label=f"{chip} {program}", hatch="//" if ci else None,
               color=f"C{pi}", alpha=0.6 if ci else 0.9)
  left.axhline(BAR, color="k", linestyle="--", linewidth=1, label=f"bar {BAR}x")
  left.axhline(1.0, color="grey", linewidth=0.8)
  left.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
  left.set_ylabel("HBM bytes / floor (weights + live KV, read once)")
  left.set_title("HBM traffic over its floor, per chip (v6e: 1 of a 2x2 mesh)")
  left.legend(fontsize=7, ncol=2)
  for ci, chip in enumerate(chips):
    rows = [s for s in speedups if s["chip"] == chip]
    right.plot([s["batch"] for s in rows], [s["speedup"] for s in rows], "o-", color=f"C{ci}",
               label=f"{chip} (compiled bytes)")
    right.plot([s["batch"] for s in rows], [s["speedup_at_floor"] for s in rows], "x--",
               color=f"C{ci}", label=f"{chip} (at the floor)")
  right.axhline(1.0, color="grey", linewidth=0.8)
  right.set_xscale("log", base=2)
  right.set_xticks(batches, [str(b) for b in batches])
  right.set_xlabel("batch")
  right.set_ylabel("speedup over the target alone")
  right.set_title(f"Roofline speedup, tau = {TAU}, k = {K}")
  right.legend(fontsize=8)
  fig.suptitle(f"Qwen2.5-Coder 1.5B + 0.5B draft, bf16, on TPU: {LABEL}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _write(records: list[dict], extra: dict) -> None:
  RESULTS.mkdir(exist_ok=True)
  payload = {"label": LABEL, "date": datetime.date.today().isoformat(),
             "jax": jax.__version__, "setup": {
                 "target": TARGET, "draft": DRAFT, "dtype": "bfloat16", "live": LIVE,
                 "capacity": CAPACITY, "k": K, "tau": TAU, "bar": BAR,
                 "chips": {c: t for c, (t, _) in CHIPS.items()},
                 "layout": "stacked (lax.scan over layers), cache donated",
                 "method": __doc__.split("**How bytes are counted**")[1].split("**The floor**")[0]
                           .strip()},
             "records": records, **extra}
  JSON_PATH.write_text(json.dumps(payload, indent=1, default=str))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--chips", nargs="+", default=list(CHIPS), choices=list(CHIPS))
  parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
  parser.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=list(PROGRAMS))
  parser.add_argument("--unrolled", action="store_true",
                      help="also compile the unstacked layout at the real depth (cross-check)")
  parser.add_argument("--fresh", action="store_true", help="ignore the checkpointed JSON")
  args = parser.parse_args(argv)
  records = []
  if JSON_PATH.exists() and not args.fresh:
    records = json.loads(JSON_PATH.read_text()).get("records", [])
  known = {(r["chip"], r["batch"], r["program"]): r for r in records}
  for chip in args.chips:
    for batch in args.batches:
      for program in args.programs:
        previous = known.get((chip, batch, program))
        if previous and "cache_buffer_bytes" in previous and (
            not args.unrolled or "unstacked_full" in previous):
          continue
        record = measure(program, chip=chip, batch=batch, unrolled=args.unrolled,
                         previous=previous, log=lambda s: print(s, flush=True))
        records = [r for r in records
                   if (r["chip"], r["batch"], r["program"]) != (chip, batch, program)] + [record]
        _write(records, summarize(records))  # checkpoint
  extra = summarize(records)
  _write(records, extra)
  plot(records, extra["speedups"])
  print(markdown(records, extra["speedups"]))


if __name__ == "__main__":
  main()
