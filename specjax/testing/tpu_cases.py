"""The compile tier's case registry: every specjax program a TPU user runs, as an abstract call.

Each `Case` builds, from a `Setup` (a topology, a batch, a dtype, a vocabulary), a `Program`: a
function and its abstract arguments (`jax.ShapeDtypeStruct`s carrying `NamedSharding`s on the
topology's mesh of abstract TPU devices) that `specjax.testing.tpu.compile_call` compiles with the
real TPU compiler. Nothing is allocated: target and draft models are `abstract_model`s, feature
heads come from `jax.eval_shape` on their init functions, so a 152k-vocabulary head costs no
memory.

The setup (`Setup()`'s defaults) is the issue's: the widths of the Qwen2.5-Coder 1.5B target and
0.5B draft (`REAL_CONFIGS`) with 2 layers each, their 151,936-token vocabulary (`vocab=` swaps in
Llama's 128,256 or Gemma's 262,144 at the same widths), bfloat16 weights, 64-token prompts, 32 new
tokens, `Sampling(temperature=0.7, top_k=50, top_p=0.9)`, `k = 4` drafts a round.

`CASES` maps a name to its `Case`; `compile_case(name, setup)` compiles one and returns
`tpu.Compiled`, or raises `tpu.TpuCompileError` with the compiler's message. What the cases cover:

  * `generate`: the target alone;
  * `decode` with every drafter: a draft model (verify "auto" and "kernel", a confidence stop
    with verify widths), self-drafting copies (int8, int4, asymmetric int4), EAGLE-3, MTP,
    Medusa, a parallel EAGLE-3 head, the hybrid (prompt lookup in front of EAGLE-3), prompt
    lookup (`NGramDrafter`), suffix drafting over a corpus, the adaptive drafter, a draft
    vocabulary (`with_draft_vocab`), a DFlash block drafter (`dflash`, sampled drafts);
  * a Gemma 4 target (`Case.target`: `tpu.GEMMA4_TEXT`'s E2B widths, `GEMMA4_LAYERS` layers:
    window and global, the last two KV-shared, per-layer embeddings, proportional RoPE, its
    262,144-token vocabulary): `sj.generate` (`gemma4_generate`) and `sj.decode` with a
    `Gemma4AssistantDrafter` (`gemma4_assistant`: 2 layers reading the target's store layers,
    ordered embeddings over 32 of 2048 centroids, sampled drafts);
  * every tree builder (static, sampled i.i.d. and without replacement, dynamic, n-gram, the
    suffix trie), with the draft model and, where the head supports the builder, an EAGLE-3 or
    Medusa head; DDTree with a DFlash drafter (`tree_ddtree_dflash`);
  * `decode` under a grammar constraint's tables (traced), with the draft model: a chain
    (`constrained`) and a sampled tree (`constrained_tree`);
  * `decode_stream`'s two programs (the jitted start, and one round on the start's state) and the
    audit's (its scoring forward, and decode under its negative-control rule);
  * the verify kernels called directly, on float32 logits (what the models' forward hands them)
    inside `jax.shard_map` over the rows (as specjax calls them under a mesh): the fused chain
    kernel (with draft logits and with a point-mass drafter), the fused tree kernel at the shape
    of every tree of `TREES`, and the vocabulary-sharded verify (`needs_model_axis`: meaningful
    only where the mesh's "model" axis splits the vocabulary). They compile in seconds and check
    the kernels' VMEM blocks at the shapes the decode cases hand them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from specjax.drafters.grammar import GrammarDrafter
from specjax.drafters.grammar_tree import GrammarTreeDrafter
from specjax.constrain.tables import ConstraintTables
from specjax.core import validation
from specjax.core.sampling import Sampling
from specjax.drafters.adaptive.drafter import AdaptiveDrafter
from specjax.drafters.dflash import network as dflash_network
from specjax.drafters.dflash.checkpoint import target_tables
from specjax.drafters.dflash.drafter import DFlashDrafter
from specjax.drafters.eagle.drafter import EagleDrafter
from specjax.drafters.gemma4_assistant import network as gemma4_network
from specjax.drafters.gemma4_assistant.drafter import Gemma4AssistantDrafter
from specjax.drafters.hybrid import HybridDrafter
from specjax.drafters.medusa.drafter import MedusaDrafter
from specjax.drafters.model import ModelDrafter, self_drafter, with_draft_vocab
from specjax.drafters.ngram import NGramDrafter
from specjax.drafters.suffix import SuffixCorpus, SuffixDrafter
from specjax.drafters.tree import ModelTreeDrafter
from specjax.drafters.eagle import network as eagle
from specjax.drafters.medusa import network as medusa
from specjax.exactness import audit
from specjax.loop import stream
from specjax.loop.decode import check_decode_arguments, decode
from specjax.loop.generate import generate
from specjax.loop.round import check_verify_widths
from specjax.models.config import ModelConfig
from specjax.models.transformer import Model
from specjax.parallel.mesh import call_context
from specjax.testing import tpu
from specjax.trees.structure import Tree, TreeSpec
from specjax.verify.local import local_vocab_ops
from specjax.kernels.fused_verify import fused_verify
from specjax.kernels.tree_verify import tree_node_results
from specjax.verify.sharded import sharded_verify

__all__ = ["CASES", "Case", "DRAFT_VOCAB", "GEMMA4_LAYERS", "NUM_DRAFT", "Program", "SAMPLING",
           "Setup", "TREES", "VOCABS", "case_setup", "compile_case", "eagle_config"]

SAMPLING = Sampling(temperature=0.7, top_k=50, top_p=0.9)
NUM_DRAFT = 4  # k of the chain cases (decode's default)
DRAFT_VOCAB = 32_000  # the heads' and `with_draft_vocab`'s reduced vocabulary (EAGLE-3's size)
SUFFIX_CAPACITY = 65_536  # slots of the suffix corpus
VOCABS = {"qwen": 151_936, "llama": 128_256, "gemma": 262_144}
GEMMA4_LAYERS = 4  # a Gemma 4 target's layers: window, global, then both again KV-shared

# The tree specs of the exactness harness (tests/exactness/test_exactness_harness.py).
TREES = {
    "static": TreeSpec("static", depth=5, width=2),
    "sampled": TreeSpec("sampled", branching=(2, 2, 1, 1), replacement=True),
    "sampled_without_replacement": TreeSpec("sampled", branching=(3, 2, 1, 1),
                                               replacement=False),
    "dynamic": TreeSpec("dynamic", depth=4, width=2, num_nodes=8),
    "ngram": TreeSpec("ngram", depth=5, width=3, max_ngram=2),
}


# --------------------------------------------------------------------------------------------
# Setup: what every case is built from.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Setup:
  """One point of the matrix (hashable: abstract models are cached per setup).

  Attributes:
    topology: a `tpu.TOPOLOGIES` name.
    batch: prompt rows `B`.
    dtype: the weight dtype of the models and heads (the direct kernel cases take float32
      logits whatever it is, as the models' forward returns them).
    vocab: None (the configs' own, 151,936) or a vocabulary size for target, draft and heads.
    target, draft: `tpu.REAL_CONFIGS` names, or for the target a `tpu.GEMMA4_TEXT` name (a
      Gemma 4 case sets it: `case_setup`).
    layers: layers of each model (widths and vocabulary stay real); a Gemma 4 target has
      `GEMMA4_LAYERS` whatever it is.
    prompt_len, max_new_tokens: tokens per prompt row, new tokens per row.
    sampling: the settings of every call.
  """

  topology: str = "v5e-1"
  batch: int = 1
  dtype: Any = jnp.bfloat16
  vocab: int | None = None
  target: str = "qwen2.5-coder-1.5b"
  draft: str = "qwen2.5-coder-0.5b"
  layers: int = 2
  prompt_len: int = 64
  max_new_tokens: int = 32
  sampling: Sampling = SAMPLING

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return _mesh(self.topology)

  @property
  def model_axis(self) -> int:
    """The size of the mesh's "model" axis (> 1: the vocabulary is split over it)."""
    return dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)).get("model", 1)

  def config(self, name: str) -> ModelConfig:
    if name in tpu.GEMMA4_TEXT:
      return tpu.gemma4_config(tpu.GEMMA4_TEXT[name], GEMMA4_LAYERS, self.vocab)
    config = tpu.with_layers(tpu.REAL_CONFIGS[name], self.layers)
    return config if self.vocab is None else dataclasses.replace(config, vocab_size=self.vocab)

  def target_model(self) -> Model:
    return _abstract_model(self.config(self.target), self.topology, self.dtype)

  def draft_model(self) -> Model:
    return _abstract_model(self.config(self.draft), self.topology, self.dtype)

  def prompt(self):
    """`(tokens [B, prompt_len] int32, rng key)`, abstract."""
    return tpu.abstract_tokens(self.mesh, self.batch, self.prompt_len)

  def replicated(self, tree):
    """`tree`'s leaves as abstract arguments replicated over the mesh."""
    return tpu.abstract_like(tree, NamedSharding(self.mesh, P()))

  @property
  def row_axis(self) -> str | None:
    """The mesh axis the batch rows are split over: "data" where it is > 1 and divides `B`."""
    data = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)).get("data", 1)
    return "data" if data > 1 and self.batch % data == 0 else None

  def rows(self, shape, dtype, *, vocab_axis: bool = False):
    """An abstract `[B, ...]` argument with its rows over `row_axis` (the rest replicated), and
    with `vocab_axis` its last axis over "model", as the vocabulary-sharded verify receives its
    logits."""
    spec = P(self.row_axis, *(None,) * (len(shape) - 2), "model") if vocab_axis else P(
        self.row_axis)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, spec))

  def describe(self) -> str:
    return (f"{self.topology} B={self.batch} {jnp.dtype(self.dtype).name} "
            f"V={self.config(self.target).vocab_size}" + (
                f" {self.target}" if self.target in tpu.GEMMA4_TEXT else ""))


@functools.lru_cache(maxsize=None)
def _mesh(topology: str) -> jax.sharding.Mesh:
  return tpu.topology_mesh(topology)


@functools.lru_cache(maxsize=None)
def _abstract_model(config: ModelConfig, topology: str, dtype) -> Model:
  return tpu.abstract_model(config, _mesh(topology), dtype)


# --------------------------------------------------------------------------------------------
# Cases.
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Program:
  """`fn(*args)` to compile on `mesh` (`tpu.compile_call(fn, *args, mesh=mesh)`)."""

  fn: Callable
  args: tuple
  mesh: jax.sharding.Mesh


@dataclasses.dataclass(frozen=True)
class Case:
  """One program of the tier.

  Attributes:
    name: its key in `CASES`.
    description: one line: what is compiled.
    build: `Setup -> Program`.
    needs_model_axis: only meaningful on a mesh whose "model" axis is > 1 (the vocabulary-
      sharded verify); a setup without one should pick another topology.
    group: "decode", "tree", "stream", "audit" or "kernel".
    target: None, or the target the case always runs on (a `tpu.GEMMA4_TEXT` name), whatever
      the setup's (`case_setup`).
  """

  name: str
  description: str
  build: Callable[[Setup], Program]
  needs_model_axis: bool = False
  group: str = "decode"
  target: str | None = None


def case_setup(case: Case | str, setup: Setup) -> Setup:
  """`setup` as `case` runs it: with the case's own target where it has one."""
  case = CASES[case] if isinstance(case, str) else case
  return setup if case.target is None else dataclasses.replace(setup, target=case.target)


def compile_case(case: Case | str, setup: Setup = Setup(), *,
                 effort: float | None = None) -> tpu.Compiled:
  """Compiles `case` for `setup` with the TPU compiler (`effort`: `tpu.compile_call`'s).

  Raises:
    tpu.TpuCompileError: the compiler rejected the program (its message).
    ValueError: `case` needs a model axis that `setup`'s mesh does not have.
    Anything else the program raises while it is traced.
  """
  case = CASES[case] if isinstance(case, str) else case
  if case.needs_model_axis and setup.model_axis == 1:
    raise ValueError(f"{case.name} needs a mesh whose 'model' axis is > 1, {setup.topology} has "
                     "none")
  program = case.build(case_setup(case, setup))
  return tpu.compile_call(program.fn, *program.args, mesh=program.mesh, effort=effort)


CASES: dict[str, Case] = {}


def _register(name: str, description: str, *, needs_model_axis: bool = False,
              group: str = "decode", target: str | None = None):
  def add(build):
    if name in CASES:
      raise ValueError(f"case {name!r} registered twice")
    CASES[name] = Case(name, description, build, needs_model_axis, group, target)
    return build
  return add


def _decode_program(setup: Setup, make_draft=None, inputs: tuple | None = None,
                    **kwargs) -> Program:
  """`sj.decode(target, make_draft(target, *inputs), ...)` over the setup's prompt, compiled with
  the target, the prompt and `inputs` (abstract arguments: the draft model by default, a head, a
  corpus, or nothing) as the program's arguments. `make_draft` None drafts with the draft model
  itself; a `tree=` in `kwargs` drafts trees."""
  tokens, key = setup.prompt()
  if "tree" not in kwargs:
    kwargs.setdefault("num_draft", NUM_DRAFT)
  inputs = (setup.draft_model(),) if inputs is None else inputs
  make_draft = make_draft or (lambda target, draft: draft)

  def fn(target, tokens, rng, *inputs):
    return decode(target, make_draft(target, *inputs), tokens, rng,
                     max_new_tokens=setup.max_new_tokens, sampling=setup.sampling,
                     **kwargs).tokens

  return Program(fn, (setup.target_model(), tokens, key, *inputs), setup.mesh)


# Heads: abstract, from their init functions, replicated over the mesh.

def eagle_config(config: ModelConfig, kind: str, parallel: int = 0):
  """The `HeadConfig` of an EAGLE-3 / MTP head for `config` over `DRAFT_VOCAB` ids. An EAGLE-3
  head of a target with fewer than 4 layers reads layers `(0, L // 2, L)` (`head_config_for`'s
  `(2, L // 2, L - 3)` needs 4): the same three taps and widths."""
  layers = config.num_layers
  head = eagle.head_config_for(dataclasses.replace(config, num_layers=max(layers, 4)), kind=kind,
                               draft_vocab_size=min(DRAFT_VOCAB, config.vocab_size),
                               parallel=parallel)
  if kind == "eagle3" and layers < 4:
    head = dataclasses.replace(head, taps=(0, layers // 2, layers))
  return dataclasses.replace(head, max_len=config.max_len)


def _draft_ids(vocab: int) -> np.ndarray:
  return np.arange(min(DRAFT_VOCAB, vocab))


def _eagle_head(setup: Setup, kind: str, parallel: int = 0):
  target = setup.target_model()
  config = eagle_config(target.config, kind, parallel)
  head = jax.eval_shape(lambda t: eagle.init_head(
      config, t, jax.random.key(1), _draft_ids(t.config.vocab_size)).astype(setup.dtype), target)
  return setup.replicated(head)


def _medusa_heads(setup: Setup, num_heads: int):
  target = setup.target_model()
  c = target.config
  config = medusa.MedusaConfig(embed_dim=c.embed_dim, num_heads=num_heads,
                               draft_vocab_size=min(DRAFT_VOCAB, c.vocab_size),
                               vocab_size=c.vocab_size)
  heads = jax.eval_shape(lambda t: medusa.init_medusa(
      config, t, _draft_ids(t.config.vocab_size)).astype(setup.dtype), target)
  return setup.replicated(heads)


def _eagle_drafter(target, head):
  return EagleDrafter(head, target.params["embed"])


def _suffix_corpus(setup: Setup):
  """An abstract `SuffixCorpus` of `SUFFIX_CAPACITY` slots, replicated."""
  int32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  return setup.replicated(SuffixCorpus(int32(SUFFIX_CAPACITY), int32(SUFFIX_CAPACITY),
                                          int32(), int32()))


def _adaptive(draft) -> AdaptiveDrafter:
  """The adaptive drafter around the draft model, from fixed costs and a prior (no calibration
  directory): per-row `k` in 0..NUM_DRAFT and verify widths (1, 2, 4, 5)."""
  k = NUM_DRAFT
  return AdaptiveDrafter(ModelDrafter(draft), max_draft=k,
                            round_ms=tuple(1.0 + 0.15 * j for j in range(k + 1)),
                            prior=(0.6,) * k, widths=(1, 2, 4))


# ---- generate and chain decoding --------------------------------------------------------------

@_register("generate", "sj.generate: the target alone, one sampled token per step")
def _generate(setup: Setup) -> Program:
  tokens, key = setup.prompt()

  def fn(target, tokens, rng):
    return generate(target, tokens, rng, max_new_tokens=setup.max_new_tokens,
                       sampling=setup.sampling).tokens

  return Program(fn, (setup.target_model(), tokens, key), setup.mesh)


@_register("draft_model", "sj.decode with the 0.5B draft model, verify_impl='auto'")
def _draft_model(setup: Setup) -> Program:
  return _decode_program(setup)


@_register("draft_model_kernel", "sj.decode with the draft model, verify_impl='kernel' (the "
           "fused Pallas verify forced)")
def _draft_model_kernel(setup: Setup) -> Program:
  return _decode_program(setup, verify_impl="kernel")


@_register("draft_model_confidence", "sj.decode with ModelDrafter(confidence=0.5) and verify "
           "widths (1, 2, 4): the target forward picked per round by lax.switch")
def _draft_model_confidence(setup: Setup) -> Program:
  return _decode_program(setup, make_draft=lambda t, d: ModelDrafter(d, confidence=0.5),
                         verify_widths=(1, 2, 4))


@_register("draft_model_fp8_cache", "sj.decode with ModelDrafter(cache_dtype='float8_e4m3fn'): "
           "the draft model's KV cache in 8-bit floats (written by the KV write kernel, read by "
           "the cache attention kernel)")
def _draft_model_fp8_cache(setup: Setup) -> Program:
  return _decode_program(setup, make_draft=lambda t, d: ModelDrafter(d,
                                                                     cache_dtype="float8_e4m3fn"))


@_register("self_int8", "sj.decode with sj.self_drafter(target, bits=8) built in the program")
def _self_int8(setup: Setup) -> Program:
  return _decode_program(setup, lambda t: self_drafter(t, bits=8), ())


@_register("self_int4", "sj.decode with sj.self_drafter(target, bits=4) built in the program")
def _self_int4(setup: Setup) -> Program:
  return _decode_program(setup, lambda t: self_drafter(t, bits=4), ())


@_register("self_q4", "sj.decode with sj.self_drafter(target, bits=4, asymmetric=True, "
           "embed_bits=8) (Q4_1-style scale and offset) built in the program")
def _self_q4(setup: Setup) -> Program:
  return _decode_program(setup, lambda t: self_drafter(
      t, bits=4, asymmetric=True, embed_bits=8), ())


@_register("eagle3", "sj.decode with an EAGLE-3 head (three target taps, 32k draft vocabulary)")
def _eagle3(setup: Setup) -> Program:
  return _decode_program(setup, _eagle_drafter, (_eagle_head(setup, "eagle3"),))


@_register("mtp", "sj.decode with an MTP head (the target's final hidden state)")
def _mtp(setup: Setup) -> Program:
  return _decode_program(setup, _eagle_drafter, (_eagle_head(setup, "mtp"),))


@_register("medusa", f"sj.decode with {NUM_DRAFT} Medusa heads (all drafts from one forward)")
def _medusa(setup: Setup) -> Program:
  return _decode_program(setup, lambda t, heads: MedusaDrafter(heads),
                         (_medusa_heads(setup, NUM_DRAFT),))


@_register("eagle3_parallel", f"sj.decode with a parallel EAGLE-3 head ({NUM_DRAFT - 2} "
           "placeholder slots: every draft of a round from one forward)")
def _eagle3_parallel(setup: Setup) -> Program:
  return _decode_program(setup, _eagle_drafter,
                         (_eagle_head(setup, "eagle3", parallel=NUM_DRAFT - 2),))


@_register("hybrid", "sj.decode with HybridDrafter: prompt lookup (ngram=2) in front of an "
           "EAGLE-3 head")
def _hybrid(setup: Setup) -> Program:
  return _decode_program(setup, lambda t, head: HybridDrafter(_eagle_drafter(t, head),
                                                                ngram=2),
                         (_eagle_head(setup, "eagle3"),))


@_register("ngram", "sj.decode with sj.NGramDrafter(max_ngram=3): prompt lookup, a point-mass q")
def _ngram(setup: Setup) -> Program:
  return _decode_program(setup, lambda t: NGramDrafter(max_ngram=3), ())


@_register("suffix", f"sj.decode with sj.SuffixDrafter over a {SUFFIX_CAPACITY}-slot "
           "SuffixCorpus (traced argument), a point-mass q")
def _suffix(setup: Setup) -> Program:
  return _decode_program(setup, lambda t, corpus: SuffixDrafter(corpus=corpus),
                         (_suffix_corpus(setup),))


# A tool-call schema's automaton at V = 151,936, padded (`specjax.constrain.pad_tables`): the
# largest of `benchmarks.constrained`'s 25 schemas has 1,704 states and 427 token classes.
GRAMMAR_STATES = 2048
GRAMMAR_CLASSES = 512


def _grammar_tables(setup: Setup):
  """`(tables, schema)`: abstract stacked `ConstraintTables` of one grammar (`GRAMMAR_STATES`
  states, `GRAMMAR_CLASSES` token classes) and each row's index into them, replicated: traced
  arguments, as `decode(..., constraint=)` passes them."""
  vocab = setup.config(setup.target).vocab_size
  s, c = GRAMMAR_STATES, GRAMMAR_CLASSES
  shape = lambda *dims, dtype=jnp.int32: jax.ShapeDtypeStruct(dims, dtype)
  tables = ConstraintTables(classes=shape(1, vocab), next_state=shape(1, s, c),
                            accepting=shape(1, s, dtype=jnp.bool_), initial=shape(1),
                            vocab_size=vocab)
  return setup.replicated(tables), setup.replicated(shape(setup.batch))


@_register("constrained", "sj.decode(..., constraint=) with the draft model: a grammar's "
           f"tables ({GRAMMAR_STATES} states, {GRAMMAR_CLASSES} token classes, traced) mask the "
           "drafts' q and the target's p at every block position")
def _constrained(setup: Setup) -> Program:
  tables, schema = _grammar_tables(setup)
  return _decode_program(
      setup, lambda t, draft, tables, schema: GrammarDrafter(ModelDrafter(draft), tables, schema),
      (setup.draft_model(), tables, schema))


CONSTRAINED_TREE = TreeSpec("sampled", branching=(3, 2, 1))


@_register("constrained_tree", "sj.decode(tree=TreeSpec('sampled', branching=(3, 2, 1)), "
           "constraint=) with the draft model: the grammar's tables restrict every node's q in "
           "the builder and the target's p at every node of the tree verify")
def _constrained_tree(setup: Setup) -> Program:
  tables, schema = _grammar_tables(setup)
  return _decode_program(
      setup, lambda t, draft, tables, schema: GrammarTreeDrafter(
          ModelTreeDrafter(draft, CONSTRAINED_TREE), tables, schema),
      (setup.draft_model(), tables, schema), tree=CONSTRAINED_TREE)


@_register("adaptive", "sj.decode with AdaptiveDrafter(draft model, fixed round_ms and prior): "
           "per-row k and verify widths (1, 2, 4, 5)")
def _adaptive_case(setup: Setup) -> Program:
  return _decode_program(setup, make_draft=lambda t, d: _adaptive(d), num_draft=None)


@_register("draft_vocab", f"sj.decode with sj.drafters.with_draft_vocab(draft model, "
           f"{DRAFT_VOCAB} ids): the draft's output projection restricted in the program")
def _draft_vocab(setup: Setup) -> Program:
  ids = _draft_ids(setup.target_model().config.vocab_size)
  return _decode_program(setup, make_draft=lambda t, d: with_draft_vocab(ModelDrafter(d),
                                                                            ids))


# ---- trees ------------------------------------------------------------------------------------

def _tree_case(builder: str, with_: str) -> None:
  spec = TREES[builder]
  name = f"tree_{builder}" + ("" if with_ in ("model", "none") else f"_{with_}")
  drafter = {"model": "the draft model", "eagle3": "an EAGLE-3 head",
             "medusa": f"{spec.depth} Medusa heads", "none": "no drafter (n-gram matches)",
             "suffix": "a SuffixDrafter over a corpus (its suffix trie)"}[with_]

  def build(setup: Setup) -> Program:
    if with_ == "eagle3":
      return _decode_program(setup, _eagle_drafter, (_eagle_head(setup, "eagle3"),), tree=spec)
    if with_ == "medusa":
      return _decode_program(setup, lambda t, heads: MedusaDrafter(heads),
                             (_medusa_heads(setup, spec.depth),), tree=spec)
    if with_ == "none":
      return _decode_program(setup, lambda t: None, (), tree=spec)
    if with_ == "suffix":
      return _decode_program(setup, lambda t, corpus: SuffixDrafter(corpus=corpus),
                             (_suffix_corpus(setup),), tree=spec)
    return _decode_program(setup, tree=spec)

  _register(name, f"sj.decode(tree={_spec_text(spec)}) with {drafter}", group="tree")(build)


def _spec_text(spec) -> str:
  fields = {"static": ("depth", "width"), "sampled": ("branching", "replacement"),
            "dynamic": ("depth", "width", "num_nodes"), "ngram": ("depth", "width", "max_ngram")}
  args = ", ".join(f"{f}={getattr(spec, f)}" for f in fields[spec.builder])
  return f"TreeSpec({spec.builder!r}, {args}; N={spec.size})"


for _builder in ("static", "sampled", "sampled_without_replacement", "dynamic"):
  _tree_case(_builder, "model")
_tree_case("ngram", "none")
_tree_case("ngram", "suffix")
for _builder in ("static", "sampled", "dynamic"):
  _tree_case(_builder, "eagle3")
_tree_case("static", "medusa")


# ---- DFlash block drafting -------------------------------------------------------------------

DFLASH_BLOCK = 16  # the published drafters' block size
DDTREE = TreeSpec("ddtree", depth=NUM_DRAFT, width=4, num_nodes=16)


def _dflash_network(setup: Setup):
  """An abstract 2-layer DFlash drafter at the target's widths, reading its first and last
  layers (the last one: its final normed state), replicated."""
  c = setup.target_model().config
  config = dflash_network.DFlashConfig(
      embed_dim=c.embed_dim, num_layers=2, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
      head_dim=c.head_dim, mlp_dim=c.mlp_dim, vocab_size=c.vocab_size, block_size=DFLASH_BLOCK,
      mask_token_id=c.vocab_size - 1, target_layer_ids=(0, c.num_layers - 1),
      num_target_layers=c.num_layers, norm_eps=c.norm_eps, rope_theta=c.rope_theta)
  network = jax.eval_shape(lambda: jax.tree.map(
      lambda x: x.astype(setup.dtype), dflash_network.init_network(config, jax.random.key(1))))
  return setup.replicated(network)


def _dflash_drafter(mode: str):
  return lambda target, network: DFlashDrafter(network, *target_tables(target), mode=mode)


@_register("dflash", "sj.decode with a 2-layer DFlash block drafter (block 16), sampled drafts")
def _dflash(setup: Setup) -> Program:
  return _decode_program(setup, _dflash_drafter("sampled"), (_dflash_network(setup),))


@_register("tree_ddtree_dflash", f"sj.decode(tree=TreeSpec('ddtree', depth={DDTREE.depth}, "
           f"width={DDTREE.width}; N={DDTREE.size})) with a 2-layer DFlash block drafter",
           group="tree")
def _ddtree(setup: Setup) -> Program:
  return _decode_program(setup, _dflash_drafter("argmax"), (_dflash_network(setup),),
                         tree=DDTREE)


# ---- Gemma 4: the target alone and with its assistant -----------------------------------------

GEMMA4 = "gemma-4-e2b"
# The assistant's own widths (the published assistant's config.json was not fetched here): 2
# layers (a window and a global layer, each attending the target's store layer of its kind),
# width 1024, 8 query heads, MLP 4096; the head widths, key/value heads, window and RoPE are the
# target's. Ordered embeddings with `transformers`' defaults (`Gemma4AssistantConfig`): 2048
# centroids, the tokens of the best 32 scored (4,096 of 262,144), the rest masked.
GEMMA4_ASSISTANT = dict(embed_dim=1024, num_heads=8, mlp_dim=4096, num_centroids=2048,
                        centroid_top_k=32)


def _gemma4_assistant(setup: Setup):
  """`(network, source_layers)`: an abstract Gemma 4 assistant (`GEMMA4_ASSISTANT`) for the
  setup's Gemma 4 target, replicated, and the target layers it reads (global, then window)."""
  c = setup.target_model().config
  config = gemma4_network.AssistantConfig(
      vocab_size=c.vocab_size, backbone_dim=c.embed_dim, layer_global=(False, True),
      head_dim=c.head_dim, global_head_dim=c.global_head_dim, num_kv_heads=c.num_kv_heads,
      global_kv_heads=c.global_kv_heads, norm_eps=c.norm_eps, activation=c.activation,
      sliding_window=c.sliding_window, rope_local_theta=c.rope_local_theta,
      rope_theta=c.rope_theta, rope_scaling=c.rope_scaling, ordered_embeddings=True,
      **GEMMA4_ASSISTANT)
  network = jax.eval_shape(lambda: gemma4_network.init_network(config, jax.random.key(1),
                                                               setup.dtype))
  return setup.replicated(network), (c.kv_store_layer(True), c.kv_store_layer(False))


@_register("gemma4_generate", f"sj.generate with a {GEMMA4_LAYERS}-layer Gemma 4 target at E2B's "
           "widths (window and global layers, KV sharing, per-layer embeddings), V = 262,144",
           target=GEMMA4)
def _gemma4_generate(setup: Setup) -> Program:
  return _generate(setup)


@_register("gemma4_assistant", f"sj.decode with a 2-layer Gemma4AssistantDrafter (ordered "
           f"embeddings: {GEMMA4_ASSISTANT['centroid_top_k']} of "
           f"{GEMMA4_ASSISTANT['num_centroids']} centroids) for the {GEMMA4_LAYERS}-layer Gemma 4 "
           "target, sampled drafts", target=GEMMA4)
def _gemma4_assistant_case(setup: Setup) -> Program:
  network, sources = _gemma4_assistant(setup)
  return _decode_program(setup, lambda t, network: Gemma4AssistantDrafter(
      network, t.params["embed"], sources), (network,))


# ---- decode_stream's and the audit's programs ---------------------------------------------------

def _stream_start_fn(setup: Setup):
  """`decode_stream`'s first step for the draft model: its own validation and mesh handling,
  then `specjax.loop.stream._start`."""

  def fn(target, draft, tokens, rng):
    args = check_decode_arguments(target, ModelDrafter(draft), tokens, rng, lengths=None,
                                  max_new_tokens=setup.max_new_tokens, num_draft=NUM_DRAFT,
                                  sampling=setup.sampling, eos_id=None, verify_impl="auto")
    inputs = (target, args.drafter, args.tokens, args.lengths, args.rng, args.eos_ids)
    with call_context(inputs) as call:
      target, drafter, tokens, lengths, rng, eos_ids = call.inputs
      return stream._start(target, drafter, tokens, lengths, jnp.int32(args.max_new_tokens),
                           eos_ids, rng, num_draft=args.num_draft, capacity=args.capacity,
                           rules=call.rules, classes=validation.pytree_classes(target, drafter))

  return fn


@_register("stream_start", "decode_stream's jitted start (specjax.loop.stream._start): both "
           "prefills and the first DecodeState, draft model", group="stream")
def _stream_start(setup: Setup) -> Program:
  tokens, key = setup.prompt()
  return Program(_stream_start_fn(setup), (setup.target_model(), setup.draft_model(), tokens,
                                           key), setup.mesh)


@functools.lru_cache(maxsize=None)
def _stream_state(setup: Setup):
  """The abstract `DecodeState` `_start` returns, carrying the shardings the compiler gave it
  (the start is compiled once per setup for them)."""
  program = _stream_start(setup)
  compiled = tpu.compile_call(program.fn, *program.args, mesh=program.mesh).compiled
  return tpu.abstract_like(compiled.out_info, compiled.output_shardings)


@_register("stream_round", "decode_stream's jitted round (specjax.loop.stream._round) on the "
           "start's DecodeState, draft model (compiles the start first for its shardings)",
           group="stream")
def _stream_round(setup: Setup) -> Program:
  widths = check_verify_widths(None, NUM_DRAFT)
  state = _stream_state(setup)

  def fn(target, draft, state):
    drafter = ModelDrafter(draft)
    with call_context((target, drafter, state)) as call:
      target, drafter, state = call.inputs
      return stream._round(target, drafter, state, num_draft=NUM_DRAFT, sampling=setup.sampling,
                           verify_impl="auto", widths=widths, rules=call.rules,
                           classes=validation.pytree_classes(target, drafter))

  return Program(fn, (setup.target_model(), setup.draft_model(), state), setup.mesh)


@_register("audit_scoring", "the audit's scoring forward (specjax.exactness.audit._scored): "
           "the target's last-position logits of B prefixes", group="audit")
def _audit_scoring(setup: Setup) -> Program:
  tokens, _ = tpu.abstract_tokens(setup.mesh, setup.batch,
                                  setup.prompt_len + setup.max_new_tokens)
  rows = tokens.sharding.spec[0] if tokens.sharding.spec else None
  lengths = jax.ShapeDtypeStruct((setup.batch,), jnp.int32,
                                 sharding=NamedSharding(setup.mesh, P(rows)))
  return Program(audit._scored, (setup.target_model(), tokens, lengths), setup.mesh)


@_register("audit_control", "sj.decode under the audit's negative-control rule "
           "(specjax.exactness.audit.control_rule, a verify_impl callable)", group="audit")
def _audit_control(setup: Setup) -> Program:
  return _decode_program(setup, verify_impl=audit.control_rule)


# ---- verify kernels, called directly ------------------------------------------------------------

LOGITS_DTYPE = jnp.float32  # what the models' forward hands the verify, whatever their weights


def _per_device(setup: Setup, body):
  """`body` on each device's rows (`jax.shard_map` over the mesh, rows over `row_axis`): a
  Pallas kernel cannot be partitioned automatically, so specjax calls it this way under a mesh
  (`specjax.verify.dispatch`)."""
  rows = P(setup.row_axis)
  return jax.shard_map(body, mesh=setup.mesh, in_specs=rows, out_specs=rows, check_vma=False)


def _chain_verify_args(setup: Setup, *, draft_logits: bool, vocab_axis: bool = False):
  vocab = setup.target_model().config.vocab_size
  b, k = setup.batch, NUM_DRAFT
  return (setup.rows((b, k + 1, vocab), LOGITS_DTYPE, vocab_axis=vocab_axis),
          setup.rows((b, k, vocab), LOGITS_DTYPE, vocab_axis=vocab_axis) if draft_logits
          else None,
          setup.rows((b, k), jnp.int32), setup.rows((b,), jnp.uint32),
          setup.rows((b,), jnp.int32))


def _fused_verify_program(setup: Setup, draft_logits: bool) -> Program:
  target, draft, tokens, seeds, positions = _chain_verify_args(setup, draft_logits=draft_logits)

  def body(target, draft, tokens, seeds, positions):
    return tuple(fused_verify(target, draft, tokens, sampling=setup.sampling, seeds=seeds,
                              positions=positions))

  return Program(_per_device(setup, body), (target, draft, tokens, seeds, positions), setup.mesh)


@_register("fused_verify", f"the fused chain verify kernel directly: float32 [B, {NUM_DRAFT + 1}, "
           f"V] target and [B, {NUM_DRAFT}, V] draft logits", group="kernel")
def _fused_verify(setup: Setup) -> Program:
  return _fused_verify_program(setup, draft_logits=True)


@_register("fused_verify_point_mass", "the fused chain verify kernel directly with a point-mass "
           f"drafter (draft_logits None, as n-gram and suffix drafting): float32 [B, "
           f"{NUM_DRAFT + 1}, V]",
           group="kernel")
def _fused_verify_point_mass(setup: Setup) -> Program:
  return _fused_verify_program(setup, draft_logits=False)


def _tree_kernel_program(setup: Setup, spec) -> Program:
  vocab = setup.target_model().config.vocab_size
  b, n = setup.batch, spec.size
  sampled = spec.rule != "match"
  tree = Tree(tokens=setup.rows((b, n), jnp.int32), parents=setup.rows((b, n), jnp.int32),
              depths=setup.rows((b, n), jnp.int32), valid=setup.rows((b, n), jnp.bool_),
              logits=setup.rows((b, n, vocab), LOGITS_DTYPE) if sampled else None)
  logits = setup.rows((b, n + 1, vocab), LOGITS_DTYPE)

  def body(logits, tree, seeds, positions):
    return tuple(tree_node_results(logits, tree, rule=spec.rule, sampling=setup.sampling,
                                   seeds=seeds, positions=positions,
                                   max_children=spec.max_children))

  return Program(_per_device(setup, body),
                 (logits, tree, setup.rows((b,), jnp.uint32), setup.rows((b,), jnp.int32)),
                 setup.mesh)


def _tree_kernel_case(builder: str) -> None:
  spec = TREES[builder]
  logits = "target and per-node draft logits" if spec.rule != "match" else "target logits"
  _register(f"tree_verify_{builder}", f"the fused tree verify kernel directly at the {builder} "
            f"tree's shape (N = {spec.size} nodes, rule {spec.rule!r}): float32 {logits}",
            group="kernel")(lambda setup: _tree_kernel_program(setup, spec))


for _builder in TREES:
  _tree_kernel_case(_builder)


@_register("verify_sharded", "the vocabulary-sharded verify (specjax.verify.sharded."
           "sharded_verify) with the TPU reductions: logits split over 'model'",
           needs_model_axis=True, group="kernel")
def _verify_sharded(setup: Setup) -> Program:
  target, draft, tokens, seeds, positions = _chain_verify_args(setup, draft_logits=True,
                                                              vocab_axis=True)
  mesh = setup.mesh

  def fn(target, draft, tokens, seeds, positions):
    return sharded_verify(target, draft, tokens, sampling=setup.sampling, seeds=seeds,
                          positions=positions, mesh=mesh, vocab_ops=local_vocab_ops("auto"))

  return Program(fn, (target, draft, tokens, seeds, positions), mesh)
