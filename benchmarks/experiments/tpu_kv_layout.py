"""Does a Pallas kernel for attention over the KV cache remove XLA:TPU's whole-cache copies? A
compile-only experiment (docs/tpu.md, "The KV cache's layout on TPU").

    python -m benchmarks.experiments.tpu_kv_layout [VARIANT[:inside|:donated] ...]
    # environment: L (layers, default 4; the docs' table used 24), PS (page size, 64), PPCB (pages
    # per compute block, 8), DC (the cache's head_dim, zero-padded from 64: the kernels need 128),
    # WRITE (scatter | perhead | dus: how the paged variants write the new token's keys/values),
    # HLO_DIR (where to keep each compiled program's text; default: nowhere)

Compiles (never runs) simplified decoder steps with Qwen2.5-Coder-0.5B's attention shapes (E 896,
14 query heads, 2 KV heads, head_dim 64, MLP 4,864; RMSNorm, no RoPE, no embedding or vocabulary),
bfloat16, batch 64, a 2,048-slot cache, one token per row at traced positions, four steps in a
`fori_loop`, the cache created inside the jitted function (`inside`, as `decode` does) or a donated
argument (`donated`), for one v5e chip (libtpu's compiler on abstract devices). Variants:
A_stacked (`[L, B, KVH, S, D]` through a layer `scan`, einsum attention, one scatter write),
A_layers (one `[B, KVH, S, D]` buffer per layer, layers unrolled), B_layers (per layer, pages
`[KVH, pages, PS, D]`, a row's pages contiguous, `jax.experimental.pallas.ops.tpu.paged_attention`),
B_stacked (every layer's pages in one buffer, the layer picked by the page table), C_layers (per
layer, pages `[pages, PS, 2 KVH, D]` with K and V interleaved, `ragged_paged_attention`).

Bytes: `benchmarks.tpu_traffic`'s HBM walk over one trip of the step loop; whole-cache bytes are
those of instructions shaped like a whole cache buffer; the floor is the weights plus the live
cache (`LIVE` slots) read once. The walk counts a kernel's cache operands whole, so the JSON also
gives the live pages such a kernel reads (`kernel_live_read`). An estimate from the compiler's
programs, not a measurement. Results go to benchmarks/results/tpu_kv_layout.json.
"""
import json
import math
import os
import sys
import time
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import tpu_traffic as tt
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

E, H, KVH, D, F = 896, 14, 2, 64, 4864
L = int(os.environ.get("L", 4))
B, S, LIVE, STEPS = 64, 2048, 1024, 4
PS = int(os.environ.get("PS", 64))          # page size
PPR = S // PS                                # pages per row
PPCB = int(os.environ.get("PPCB", 8))        # pages per compute block
DT = jnp.bfloat16
DC = int(os.environ.get("DC", D))  # cache head_dim (zero-padded to DC for paged_attention)
OUT = "benchmarks/results/tpu_kv_layout.json"
HLO_DIR = os.environ.get("HLO_DIR")

topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2")
dev = topo.devices[:1]
mesh = jax.sharding.Mesh(dev, ("x",))
REP = NamedSharding(mesh, P())


def sds(shape, dtype=DT):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=REP)


WEIGHT_SHAPES = {"ln1": (E,), "wq": (E, H * D), "wk": (E, KVH * D), "wv": (E, KVH * D),
                 "wo": (H * D, E), "ln2": (E,), "wg": (E, F), "wu": (E, F), "wd": (F, E)}


def rms(x, w):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(DT) * w


def mlp(x, w):
  h = rms(x, w["ln2"])
  return x + (jax.nn.silu(h @ w["wg"]) * (h @ w["wu"])) @ w["wd"]


def qkv(x, w):
  h = rms(x, w["ln1"])
  return ((h @ w["wq"]).reshape(B, H, D), (h @ w["wk"]).reshape(B, KVH, D),
          (h @ w["wv"]).reshape(B, KVH, D))


# ---- variant A: dense cache [B, KVH, S, D], einsum + mask, scatter write -------------------

def attn_dense(q, kc, vc, starts):
  qg = q.reshape(B, KVH, H // KVH, D)
  s = jnp.einsum("bkgd,bksd->bkgs", qg, kc, preferred_element_type=jnp.float32) / math.sqrt(D)
  mask = jnp.arange(S)[None, :] <= starts[:, None]
  s = jnp.where(mask[:, None, None, :], s, -1e30)
  p = jax.nn.softmax(s, -1).astype(DT)
  return jnp.einsum("bkgs,bksd->bkgd", p, vc).reshape(B, H * D)


def write_dense(c, new, starts):  # c [B, KVH, S, D], new [B, KVH, D]
  return c.at[jnp.arange(B), :, starts].set(new)


def layer_dense(x, w, kc, vc, starts):
  q, k, v = qkv(x, w)
  kc, vc = write_dense(kc, k, starts), write_dense(vc, v, starts)
  x = x + attn_dense(q, kc, vc, starts) @ w["wo"]
  return mlp(x, w), kc, vc


# ---- variant B: paged [KVH, pages, PS, D] + Pallas paged_attention -------------------------

def padd(a):
  return a if DC == D else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, DC - D)])


WRITE = os.environ.get("WRITE", "scatter")


def write_paged(c, new, page, slot):  # c [KVH, P, PS, DC], new [B, KVH, D]
  new = padd(new)
  if WRITE == "scatter":  # one scatter, window (KVH, DC)
    return c.at[:, page, slot, :].set(jnp.swapaxes(new, 0, 1))
  if WRITE == "perhead":  # one scatter per KV head, window (DC,)
    for h in range(KVH):
      c = c.at[h, page, slot, :].set(new[:, h])
    return c
  if WRITE == "dus":  # per (row, head) dynamic_update_slice of one [1, 1, 1, DC] vector
    def body(b, c):
      for h in range(KVH):
        c = jax.lax.dynamic_update_slice(c, new[b, h][None, None, None, :],
                                         (h, page[b], slot[b], 0))
      return c
    return jax.lax.fori_loop(0, B, body, c)
  raise ValueError(WRITE)


def attn_paged(q, kc, vc, starts, table):
  o = paged_attention(padd(q * (1.0 / math.sqrt(D))), kc, vc, starts + 1, table,
                      pages_per_compute_block=PPCB)
  return o[..., :D].reshape(B, H * D)


def layer_paged(x, w, kc, vc, starts, table, page, slot):
  q, k, v = qkv(x, w)
  kc, vc = write_paged(kc, k, page, slot), write_paged(vc, v, page, slot)
  x = x + attn_paged(q, kc, vc, starts, table) @ w["wo"]
  return mlp(x, w), kc, vc


# ---- variant C: ragged [pages, PS, 2*KVH, D] (K, V interleaved) + ragged_paged_attention ----

def layer_ragged(x, w, kv, starts, table, page, slot):
  q, k, v = qkv(x, w)
  new = padd(jnp.stack([k, v], axis=2).reshape(B, 2 * KVH, D))  # k0 v0 k1 v1
  kv = kv.at[page, slot].set(new)
  o = ragged_paged_attention(padd(q), kv, starts + 1, table, jnp.arange(B + 1, dtype=jnp.int32),
                             jnp.array([B], jnp.int32), sm_scale=1.0 / math.sqrt(D),
                             num_kv_pages_per_block=PPCB, num_queries_per_block=8)
  x = x + o[..., :D].reshape(B, H * D) @ w["wo"]
  return mlp(x, w), kv


# ---- programs ------------------------------------------------------------------------------

def cache_shapes(variant):
  if variant == "A_stacked":
    return [(L, B, KVH, S, D)] * 2
  if variant == "A_layers":
    return [(B, KVH, S, D)] * (2 * L)
  if variant == "B_layers":
    return [(KVH, B * PPR, PS, DC)] * (2 * L)
  if variant == "B_stacked":  # all layers' pages in one buffer; the layer picked by the table
    return [(KVH, L * B * PPR, PS, DC)] * 2
  if variant == "C_layers":
    return [(B * PPR, PS, 2 * KVH, DC)] * L
  raise ValueError(variant)


def step_fn(variant):
  """(x [B, E], weights, starts [B], caches list) -> (x, caches)"""
  base_table = jnp.arange(B * PPR, dtype=jnp.int32).reshape(B, PPR)

  def step(x, weights, starts, caches):
    page = jnp.arange(B, dtype=jnp.int32) * PPR + starts // PS
    slot = starts % PS
    if variant == "A_stacked":
      def body(x, xs):
        w, kc, vc = xs
        x, kc, vc = layer_dense(x, w, kc, vc, starts)
        return x, (kc, vc)
      # like specjax on TPU: scan over stacked layers, cache carried through ys
      x, (kc, vc) = jax.lax.scan(body, x, (weights, caches[0], caches[1]))
      return x, [kc, vc]
    if variant == "B_stacked":
      kc, vc = caches

      def body(l, carry):
        x, kc, vc = carry
        w = jax.tree.map(lambda a: a[l], weights)
        off = l * (B * PPR)
        return layer_paged(x, w, kc, vc, starts, base_table + off, page + off, slot)
      x, kc, vc = jax.lax.fori_loop(0, L, body, (x, kc, vc))
      return x, [kc, vc]
    out = []
    for l in range(L):
      w = jax.tree.map(lambda a: a[l], weights)
      if variant == "A_layers":
        x, kc, vc = layer_dense(x, w, caches[2 * l], caches[2 * l + 1], starts)
        out += [kc, vc]
      elif variant == "B_layers":
        x, kc, vc = layer_paged(x, w, caches[2 * l], caches[2 * l + 1], starts, base_table,
                                page, slot)
        out += [kc, vc]
      elif variant == "C_layers":
        x, kv = layer_ragged(x, w, caches[l], starts, base_table, page, slot)
        out.append(kv)
    return x, out
  return step


def program(variant, mode):
  step = step_fn(variant)
  shapes = cache_shapes(variant)

  def loop(x, weights, starts, caches):
    def body(i, carry):
      x, caches = carry
      x, caches = step(x, weights, starts + i, caches)
      return x, caches
    return jax.lax.fori_loop(0, STEPS, body, (x, caches))

  if mode == "inside":
    def f(x, weights, starts):
      caches = [jnp.zeros(s, DT) for s in shapes]
      x, _ = loop(x, weights, starts, caches)
      return x
    args = (sds((B, E)), {k: sds((L,) + s) for k, s in WEIGHT_SHAPES.items()},
            sds((B,), jnp.int32))
    return f, args, ()
  args = (sds((B, E)), {k: sds((L,) + s) for k, s in WEIGHT_SHAPES.items()},
          sds((B,), jnp.int32), [sds(s) for s in shapes])
  return loop, args, (3,)


def per_step(text):
  """HBM bytes of one trip of the step loop (the outermost while in ENTRY), and its rows."""
  comps, entry = tt._parse_module(text)
  walk = tt._Walk(comps, entry, all_spaces=False)
  whiles = [i for i in comps[entry] if i.op == "while"]
  trips = [walk.trip_count(entry, w) for w in whiles]
  outer = [w for w, t in zip(whiles, trips) if t == STEPS]
  if len(outer) != 1:
    return None, None, list(zip([w.name for w in whiles], trips))
  w = outer[0]
  total = walk.computation(w.attr("body"), 1) + walk.computation(w.attr("condition"), 1)
  rows = [(b, op, shape, name) for (op, shape, name), b in walk.rows.most_common()]
  return total, rows, list(zip([w.name for w in whiles], trips))


def floor():
  weights = L * sum(math.prod(s) for s in WEIGHT_SHAPES.values()) * 2
  live = L * 2 * B * KVH * LIVE * D * 2
  return weights, live


def measure(variant, mode):
  f, args, donate = program(variant, mode)
  rec = {"variant": variant, "mode": mode, "page_size": PS, "pages_per_compute_block": PPCB, "cache_head_dim": DC, "write": WRITE, "layers": L}
  t0 = time.time()
  try:
    with jax.set_mesh(mesh):  # an abstract device, for Pallas' TPU-info queries
      compiled = jax.jit(f, donate_argnums=donate).lower(*args).compile()
  except Exception as e:  # pylint: disable=broad-except
    rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}",
               compile_s=round(time.time() - t0, 1))
    traceback.print_exc()
    return rec
  rec["compile_s"] = round(time.time() - t0, 1)
  text = compiled.as_text()
  name = None
  if HLO_DIR:
    name = os.path.join(HLO_DIR, f"hlo_{variant}_{mode}_ps{PS}_d{DC}_{WRITE}_L{L}.txt")
    with open(name, "w") as fh:
      fh.write(text)
  m = compiled.memory_analysis()
  traffic = tt.hbm_traffic(text)
  step_bytes, step_rows, loops = per_step(text)
  shapes = cache_shapes(variant)
  buf_elems = sorted({math.prod(s) for s in shapes})
  def whole(rows):
    return sum(b for b, _, shape, _ in rows
               if any(math.prod(a.dims) in buf_elems for a in tt._leaves(shape)))
  def kernel(rows):
    return sum(b for b, op, _, name in rows if op == "custom-call")
  w_bytes, live = floor()
  fl = w_bytes + live
  rec.update(
      ok=True, hlo=name,
      argument_bytes=m.argument_size_in_bytes, temp_bytes=m.temp_size_in_bytes,
      output_bytes=m.output_size_in_bytes, alias_bytes=m.alias_size_in_bytes,
      total_hbm_bytes=traffic.hbm_bytes, loops=loops,
      hbm_bytes_per_step_total_div=traffic.hbm_bytes / STEPS,
      hbm_bytes_per_step=step_bytes,
      whole_cache_bytes_per_step=whole(step_rows) if step_rows else None,
      whole_cache_bytes_total=whole(traffic.rows),
      custom_call_bytes_per_step=kernel(step_rows) if step_rows else None,
      floor_weights=w_bytes, floor_kv_live=live, floor=fl,
      ratio=(step_bytes / fl) if step_bytes else None,
      # the HLO walk counts a custom call's operands whole; a paged kernel DMAs only the live pages
      kernel_live_read=(L * 2 * B * KVH * LIVE * DC * 2) if variant[0] in "BC" else 0,
      cache_buffer_bytes_all=sum(math.prod(s) for s in shapes) * 2,
      copies=sorted({f"{i.op} {i.shape[:120]}" for c in tt._parse_module(text)[0].values()
                     for i in c if i.op in ("copy", "copy-start", "transpose")
                     and any(math.prod(a.dims) in buf_elems for a in i.leaves)}),
      top=[{"bytes": b, "op": op, "shape": s[:160], "name": n}
           for b, op, s, n in (step_rows or traffic.rows)[:12]],
  )
  print(f"{variant}/{mode}: step {step_bytes and step_bytes / 1e6:.1f} MB, whole-cache "
        f"{rec['whole_cache_bytes_per_step'] and rec['whole_cache_bytes_per_step'] / 1e6:.1f} MB,"
        f" kernel {rec['custom_call_bytes_per_step'] and rec['custom_call_bytes_per_step']/1e6:.1f}"
        f" MB, floor {fl / 1e6:.1f} MB, ratio {rec['ratio'] and rec['ratio']:.2f}, temp "
        f"{m.temp_size_in_bytes / 1e6:.1f} MB ({rec['compile_s']} s)", flush=True)
  return rec


if __name__ == "__main__":
  wanted = sys.argv[1:] or ["A_stacked", "A_layers", "B_layers", "B_stacked", "C_layers"]
  saved = json.load(open(OUT)) if os.path.exists(OUT) else {}
  header = {k: v for k, v in saved.items() if k != "records"} or {
      "label": "compile-only estimate from the TPU compiler's programs (one v5e chip), not a "
               "measurement", "jax": jax.__version__}
  results = saved.get("records", [])
  for spec in wanted:
    variant, _, mode = spec.partition(":")
    for md in ([mode] if mode else ["inside", "donated"]):
      rec = measure(variant, md)
      results = [r for r in results if (r["variant"], r["mode"], r["page_size"], r.get("cache_head_dim", D), r.get("write", "scatter"), r.get("layers", 4)) !=
                 (variant, md, PS, DC, WRITE, L)] + [rec]
      json.dump({**header, "records": results}, open(OUT, "w"), indent=1)
