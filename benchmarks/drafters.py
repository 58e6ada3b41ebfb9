"""The drafters a benchmark runs: one `DrafterEntry` each, from the library and from checkpoints.

A new drafter joins every suite that takes this list by being added in `library_drafters`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

from specjax.pretrained.pairs import DRAFT_CONTEXT, DRAFT_VOCAB_SIZE, GGUF_Q4_COPY


@dataclasses.dataclass(frozen=True)
class DrafterEntry:
  """One drafter of the suite.

  Attributes:
    name: its label in the results.
    drafter: what `specjax.decode` takes as `draft`.
    num_draft: `k`.
    draft_ratio: the cost of one draft step over one target step (`c` of the bound); None =
      measured (`benchmarks.drafter_cost`: the round's propose + observe over `k` target steps).
    description: one line for the table.
    tree: a `specjax.TreeSpec` the drafter drafts (`decode(..., tree=...)`), or None for a
      chain; `num_draft` is then its depth.
  """

  name: str
  drafter: Any
  num_draft: int
  draft_ratio: float | None = None
  description: str = ""
  tree: Any = None

  @property
  def verify_k(self) -> int:
    """The drafts one verify scores: `k` for a chain, the tree's node budget `N`."""
    return self.num_draft if self.tree is None else self.tree.size

  def decode_kwargs(self) -> dict:
    """What `specjax.decode` takes for this entry's draft shape."""
    return dict(num_draft=self.num_draft) if self.tree is None else dict(tree=self.tree)

  def round_drafter(self, target):
    """The drafter one round runs (`decode` builds a tree's from `drafter` and `tree`)."""
    if self.tree is None:
      return self.drafter
    from specjax.drafters.tree import tree_drafter
    return tree_drafter(target, self.drafter, self.tree)


def load_head_drafter(target, path, *, num_draft: int) -> DrafterEntry:
  """A trained head checkpoint (`save_head` or `save_medusa`) as a drafter for `target`."""
  from specjax.drafters.eagle.drafter import EagleDrafter
  from specjax.drafters.medusa.drafter import MedusaDrafter
  from specjax.drafters.medusa.network import MEDUSA_KIND, load_medusa
  from specjax.drafters.eagle.network import load_head
  from specjax.io.orbax import read_tree_metadata

  path = pathlib.Path(path)
  if not path.is_dir():
    raise ValueError(f"no head checkpoint directory at {path}")
  if read_tree_metadata(path).get("kind") == MEDUSA_KIND:
    drafter = MedusaDrafter(load_medusa(path))
  else:
    drafter = EagleDrafter(load_head(path), target.params["embed"])
  num_draft = min(num_draft, drafter.max_draft or num_draft)  # Medusa's heads, parallel slots
  return DrafterEntry(_head_name(drafter), drafter, num_draft, None, f"head from {path.name}")


# The target's own quantized copies, by name: `specjax.self_drafter` settings. `self-q4` keeps a
# 4-bit GGUF's blocks (asymmetric int4 per 32: Q4_1, Q4_K) with the embedding in int8 per 32
# (Q8_0's blocks): on SmolLM2's file (Q4_1 layers, Q8_0 embedding) the target's weights exactly.
SELF_DRAFTS = {"self-int8": dict(bits=8), "self-int4": dict(bits=4),
               "self-q4": GGUF_Q4_COPY}
SUFFIX_TREES = ("suffix-tree", "suffix-tree+corpus")  # built only when asked for
# A copy over a draft vocabulary (`specjax.tuning.draft_vocab.frequent_vocab`, counted on the
# target's own answers to training-template conversations) and each row's recent tokens, by name:
# the int8 copy and the 4-bit one; built only when asked for (the counting runs the target).
VOCAB_DRAFTS = {"self-int8+vocab": SELF_DRAFTS["self-int8"],
                "self-q4+vocab": SELF_DRAFTS["self-q4"]}
# Its ids kept (at most a quarter of the vocabulary: `draft_vocab_size`) and recent tokens per row
# also draftable are those of `sj.load_pair("gemma3-270m")`: DRAFT_VOCAB_SIZE, DRAFT_CONTEXT.
CORPUS = "+corpus"  # a suffix drafter whose corpus the suite sets (`with_corpus`)
DRAFT_MODEL = "draft-int8"  # a separate draft model of the target, quantized to int8
# The separate draft model's widths by name: `bits` of `specjax.pretrained.pairs.
# packaged_draft_model` (int8 per 128; asymmetric int4 per 32, output projection included).
DRAFT_MODELS = {DRAFT_MODEL: 8, "draft-q4": 4}
# That draft model over the draft vocabulary (`specjax.drafters.with_draft_vocab`): its output
# projection (Qwen2.5-Coder-0.5B: 136M of its 494M weights) read for those ids only.
DRAFT_MODEL_VOCAB = DRAFT_MODEL + "+vocab"
# That draft model with its KV cache in 8-bit floats (`ModelDrafter(cache_dtype=...)`): what the
# cache's halved memory costs in acceptance.
DRAFT_MODEL_FP8 = DRAFT_MODEL + "+fp8-cache"
FP8_CACHE = "float8_e4m3fn"
ADAPTIVE = "+adaptive"  # `NAME+adaptive`: NAME's drafter inside `specjax.adaptive_drafter`


def _suffix_tree_spec():
  from specjax.trees.structure import TreeSpec
  # Depth 12, 4 paths: on the agent-like set (SmolLM2-135M, greedy, 12 prompts, 64 new tokens)
  # tau 3.63 / 3.80 with the corpus, against 3.00 / 3.15 for the depth-6 chain; depth 8: 3.40 /
  # 3.51, depth 10: 3.55 / 3.67; 8 paths at depth 8: 3.44 / 3.61 (benchmarks/results/real_agent).
  return TreeSpec("ngram", depth=12, width=4, widths=(2, 4, 8, 16))


def draft_vocab_size(vocab_size: int) -> int:
  """The suite's draft vocabulary size: `DRAFT_VOCAB_SIZE`, at most a quarter of `vocab_size`."""
  return min(DRAFT_VOCAB_SIZE, vocab_size // 4)


def base_names(names) -> tuple[str, ...]:
  """The drafters `names` needs built: each `NAME+adaptive` needs `NAME`."""
  return tuple(dict.fromkeys(n[:-len(ADAPTIVE)] if n.endswith(ADAPTIVE) else n for n in names))


def with_adaptive(target, tokenizer, entries: list[DrafterEntry], names, *, calibration=None,
                  max_draft: int = 7, log=print) -> list[DrafterEntry]:
  """`entries` with an `NAME+adaptive` entry for each such name in `names` (in the order of
  `names`; the plain `NAME` only where asked for too): `specjax.adaptive_drafter` around NAME's
  drafter, under `calibration` (a `specjax calibrate` directory) or, without one, a calibration
  measured here at batch 1 (`specjax.tuning.calibrate.measure_costs`, and an acceptance profile on
  `profile_prompts`: the training templates' conversations, never a benchmark prompt). Its `k`
  is the plan's `K`; the suite's bound for it prices a fixed-`K` chain (indicative only: rows
  draft fewer)."""
  import specjax as sj
  from specjax.drafters.adaptive import costs

  wanted = [n for n in names if n.endswith(ADAPTIVE)]
  if not wanted:
    return entries
  by_name = {e.name: e for e in entries}
  built = {}
  for name in wanted:
    base = by_name[name[:-len(ADAPTIVE)]]
    measured = calibration
    if measured is None:
      from specjax.tuning.calibrate import measure_acceptance, measure_costs, profile_prompts
      ids, lengths = profile_prompts(tokenizer)
      table = measure_costs(target, base.drafter, batch=1, max_width=max_draft + 1, repeats=3)
      profile = measure_acceptance(target, base.drafter, ids, lengths, num_draft=max_draft,
                                   sampling=sj.Sampling(), max_new_tokens=48)
      measured = costs.Calibration(table, profile)
    drafter = sj.adaptive_drafter(base.drafter, calibration=measured, max_draft=max_draft)
    log(f"{name}: K = {drafter.max_draft}, widths {drafter.widths}, plain {drafter.plain}")
    built[name] = DrafterEntry(name, drafter, drafter.max_draft, None,
                               f"{base.description}; each row its own k <= {drafter.max_draft} "
                               "per round (specjax.adaptive_drafter)")
  keep = [n for n in names if not n.endswith(ADAPTIVE)]
  return [e for e in entries if e.name in keep] + [built[n] for n in wanted]


def library_drafters(target, *, num_draft: int, names=(), heads=(), tokenizer=None,
                     draft_model=None, vocab_ids=None, log=print) -> list[DrafterEntry]:
  """Every drafter the library has for `target` (or the `names` asked for).

  The n-gram (prompt lookup) drafter and the target's own quantized copies (`self-int8`,
  `self-int4`: `specjax.self_drafter`, symmetric per group of 64 / 32; `self-q4`: asymmetric int4
  per 32 with an int8 embedding; the prompt's cache shared) need no training. A trained head joins the list when the library ships one for this target
  (`specjax.load_pair("smollm2-head")` whose target has `target`'s config); it is named by its kind
  (`eagle3`, `mtp`, `medusa`). Entries are built only when asked for (or when `names` is
  empty): a quantized copy costs memory. `self-int8+vocab` and `self-q4+vocab` (only when named,
  with `tokenizer`) are those copies over a draft vocabulary (`VOCAB_DRAFTS`). `draft_model`,
  `(drafter, description)`, is a separate draft model of the target (`DRAFT_MODEL`; over the
  draft vocabulary: `DRAFT_MODEL_VOCAB`), or a dict of such pairs by name (`DRAFT_MODELS`: the
  same model at other widths). `vocab_ids`: the draft vocabulary, if not to be counted here (the
  shipped one, made by the same recipe).
  """
  import specjax as sj
  from specjax.drafters import with_draft_vocab
  from specjax.drafters.model import default_group

  entries = [DrafterEntry("ngram", sj.NGramDrafter(), num_draft, None,
                          "prompt lookup (n-gram 3..1, no weights)"),
             DrafterEntry("suffix", sj.SuffixDrafter(), num_draft, None,
                          "suffix drafting over the row's own text (longest match up to 32 "
                          "tokens, frequency walk, no weights)")]
  if "suffix+corpus" in names:  # its corpus (earlier answers) is set by the suite: with_corpus
    entries.append(DrafterEntry("suffix+corpus", sj.SuffixDrafter(), num_draft, None,
                                "suffix drafting over the row's text and a corpus of the "
                                "target's answers to earlier requests of the same kind"))
  for name in (n for n in SUFFIX_TREES if n in names):
    spec = _suffix_tree_spec()
    corpus = name.endswith(CORPUS)
    entries.append(DrafterEntry(
        name, sj.SuffixDrafter(), spec.depth, None,
        f"suffix tree: the {spec.width} best continuations of the longest match, merged into a "
        f"trie of depth {spec.depth} (<= {spec.size} nodes, verified at the smallest of widths "
        f"{spec.widths} that holds them), over the row's text"
        + (" and the corpus of earlier answers" if corpus else ""), tree=spec))
  for name, settings in SELF_DRAFTS.items():
    if not names or name in names:
      bits = settings["bits"]
      what = (f"int{bits} (groups of {settings.get('group') or default_group(target, bits)})"
              if not settings.get("asymmetric") else
              "asymmetric int4 per 32 (a scale and an offset per group) with the embedding in "
              "int8 per 32")
      entries.append(DrafterEntry(
          name, sj.self_drafter(target, **settings), num_draft, None,
          f"the target's own weights quantized to {what}, no training"))
  models = ({} if draft_model is None else draft_model if isinstance(draft_model, dict)
            else {DRAFT_MODEL: draft_model})
  for name, (drafter, description) in models.items():
    if not names or name in names:
      entries.append(DrafterEntry(name, drafter, num_draft, None, description))
  draft_model = models.get(DRAFT_MODEL)
  wanted = [n for n in VOCAB_DRAFTS if n in names]
  with_model = draft_model is not None and DRAFT_MODEL_VOCAB in names
  if wanted or with_model:
    ids = vocab_ids  # counted once for every drafter over it
    if ids is None:
      ids = _draft_vocab(target, tokenizer, (wanted or [DRAFT_MODEL_VOCAB])[0], log)
    entries += [_vocab_draft(target, name, ids, num_draft) for name in wanted]
    if with_model:
      entries.append(DrafterEntry(
          DRAFT_MODEL_VOCAB, with_draft_vocab(draft_model[0], ids, context=DRAFT_CONTEXT),
          num_draft, None, f"{draft_model[1]}, drafting over the {len(ids)} ids the target uses "
          f"most and each row's last {DRAFT_CONTEXT} tokens"))
  if not names or set(names) - {"ngram", "suffix", "suffix+corpus", *SUFFIX_TREES, *SELF_DRAFTS,
                                *VOCAB_DRAFTS, *DRAFT_MODELS, DRAFT_MODEL_VOCAB,
                                DRAFT_MODEL_FP8}:
    entries += _shipped_heads(target, num_draft)
  entries += [load_head_drafter(target, path, num_draft=num_draft) for path in heads]
  known = ({e.name for e in entries} | set(SELF_DRAFTS) | set(SUFFIX_TREES)
           | {"suffix+corpus", *VOCAB_DRAFTS})
  known |= set(models)
  if draft_model is not None:
    known |= {DRAFT_MODEL_VOCAB}
  missing = [n for n in names if n not in known]
  if missing:
    raise ValueError(f"drafters {missing} are not available; available: {', '.join(known)}")
  return [e for e in entries if not names or e.name in names]


def _draft_vocab(target, tokenizer, name: str, log):
  import time

  from specjax.tuning.draft_vocab import frequent_vocab

  if tokenizer is None:
    raise ValueError(f"{name} needs the target's tokenizer (its draft vocabulary is "
                     "counted on the target's answers to chat prompts)")
  size = draft_vocab_size(target.config.vocab_size)
  start = time.perf_counter()
  ids = frequent_vocab(target, tokenizer, size)
  log(f"{name}: {size} ids counted in {time.perf_counter() - start:.0f}s")
  return ids


def _vocab_draft(target, name: str, ids, num_draft: int) -> DrafterEntry:
  import specjax as sj

  settings = VOCAB_DRAFTS[name]
  what = "int8 copy" if settings["bits"] == 8 else "4-bit copy (as self-q4)"
  return DrafterEntry(
      name, sj.self_drafter(target, **settings, vocab=ids, context=DRAFT_CONTEXT), num_draft,
      None, f"the {what} drafting over the {len(ids)} ids the target uses most (counted on its "
      f"own answers to 256 training-template conversations) and each row's last {DRAFT_CONTEXT} "
      "tokens, no training")


def with_corpus(entry: DrafterEntry, corpus) -> DrafterEntry:
  """`entry` (a `SuffixDrafter`) drafting over `corpus` as well as each row's own text."""
  return dataclasses.replace(entry, drafter=dataclasses.replace(entry.drafter, corpus=corpus))


def _head_name(drafter) -> str:
  kind = type(drafter).__name__
  if kind == "EagleDrafter":
    name = "eagle3" if tuple(drafter.taps) else "mtp"
    return name + "-parallel" if drafter.head.config.parallel else name
  if kind == "MedusaDrafter":
    return "medusa"
  return kind.lower()


def _shipped_heads(target, num_draft: int) -> list[DrafterEntry]:
  """The shipped head pair's head ("smollm2-head"), if it was trained for this very target."""
  import specjax as sj
  from specjax.drafters import HybridDrafter

  try:
    pair = sj.load_pair("smollm2-head")
  except (FileNotFoundError, ValueError, ImportError):
    return []
  draft = pair.draft
  if not hasattr(draft, "observe") or pair.target.config != target.config:
    return []  # the shipped draft is a model of its own, or a head for another target
  k = min(num_draft, draft.max_draft or num_draft)  # None: no bound
  if not isinstance(draft, HybridDrafter):
    return [DrafterEntry(_head_name(draft), draft, k, None,
                         f"the shipped {type(draft).__name__} (load_pair('smollm2-head'))")]
  name = _head_name(draft.drafter)
  return [DrafterEntry(name, draft.drafter, k, None, f"the shipped head alone ({name})"),
          DrafterEntry(f"{name}+lookup", draft, k, None,
                       f"the shipped drafter (load_pair('smollm2-head')): prompt lookup where the "
                       f"last {draft.ngram} tokens recur, the {name} head elsewhere")]
