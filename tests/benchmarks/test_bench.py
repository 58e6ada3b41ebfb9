"""The benchmark suites at a tiny size (they run and write well-formed results; no timings are
checked), the synthetic-acceptance rule, the bound, and the Hugging Face export round trip.

`benchmarks` is the package of the source checkout (outside the wheel); pytest runs from the
repository root, which puts it on the path."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.drafters import SuffixCorpus
from specjax.models import RopeScaling
from benchmarks import bound, cli as bench_cli, plots, real, real_models, report, synthetic, timing
from benchmarks import drafters as drafters_module
from benchmarks.models import environment
from specjax.io.export_hf import export_hf
from specjax.models import quant
from specjax.testing.models import tiny_config


@pytest.mark.slow  # ~3 min on a shared 2-core CPU (every suite compiles its own calls)
def test_tiny_suite_writes_json_plots_and_table(tmp_path):
  code = bench_cli.main(["--suite", "tiny", "--out", str(tmp_path), "--k", "1,2", "--batch", "1,2",
                     "--temperature", "1",
                     "--max-new-tokens", "6", "--repeats", "1"])
  assert code == 0
  result = json.loads((tmp_path / "tiny.json").read_text())
  assert result["environment"]["platform"] == "cpu"
  records = result["pair_records"]
  assert {r["num_draft"] for r in records} >= {1, 2}
  assert {r["batch"] for r in records} == {1, 2}
  for r in records:
    for key in ("speedup", "bound", "efficiency", "acceptance_rate", "mean_accepted_length"):
      assert np.isfinite(r[key]), key
    assert r["generate"]["tokens_per_s"] > 0 and r["decode"]["tokens_per_s"] > 0
    assert r["label"] == "exact"
    if r["temperature"] == 0.0:
      assert r["greedy_identical"]
  records = result["synthetic_records"]
  assert records and all(r["label"] == synthetic.SYNTHETIC_LABEL for r in records)
  assert all(r["synthetic_acceptance"] == 0.8 for r in records)
  peer = result["peer"]
  assert peer["greedy_streams_identical"]
  assert set(peer["tokens_per_s"]) == {"hf_generate", "hf_assisted", "specjax_generate",
                                       "specjax_decode"}
  for name in result["files"]:
    assert (tmp_path / name).is_file(), name
  pngs = [name for name in result["files"] if name.endswith(".png")]
  assert "tiny_speedup_vs_k.png" in pngs and "tiny_measured_vs_bound.png" in pngs
  assert any("synthetic" in name for name in pngs)
  for name in pngs:
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  table = (tmp_path / "tiny_table.md").read_text()
  assert "| batch |" in table and "Synthetic acceptance" in table


@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
def test_synthetic_rule_accepts_at_its_rate(acceptance):
  rule = synthetic.synthetic_verify(acceptance)
  assert synthetic.synthetic_verify(acceptance) is rule  # one function per rate: one compile
  batch, k, vocab = 512, 4, 16
  logits = jax.random.normal(jax.random.key(1), (batch, k + 1, vocab))
  drafts = jnp.zeros((batch, k), jnp.int32) + 3
  seeds = jnp.arange(batch, dtype=jnp.uint32) * 7919 + 11  # [B] per-row seeds
  positions = jnp.arange(batch, dtype=jnp.int32)
  result = rule(logits, None, drafts, sampling=sj.Sampling(), seeds=seeds, positions=positions)
  again = rule(logits, None, drafts, sampling=sj.Sampling(), seeds=seeds, positions=positions)
  np.testing.assert_array_equal(result.tokens, again.tokens)  # deterministic in the seed
  accepted = np.asarray(result.num_accepted)
  if acceptance == 0.0:
    assert (accepted == 0).all()
  elif acceptance == 1.0:
    assert (accepted == k).all()
  else:  # P(first draft accepted) = 0.5: 512 fixed draws, far from the edges
    assert 0.35 < np.mean(accepted > 0) < 0.65
  tokens = np.asarray(result.tokens)
  argmax = np.asarray(jnp.argmax(logits, -1))
  for row in range(batch):
    n = accepted[row]
    assert (tokens[row, :n] == 3).all()
    assert tokens[row, n] == argmax[row, n]  # the target's own token after the accepted drafts
  with pytest.raises(ValueError):
    synthetic.synthetic_verify(1.5)


def test_analytic_bound():
  assert bound.expected_tokens_per_round(0.0, 4) == 1.0
  assert bound.expected_tokens_per_round(1.0, 4) == 5.0
  assert bound.expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
  # 1.75 tokens per round / (2 * 0.1 + 1.2)
  assert bound.analytic_bound(0.5, 2, 0.1, 1.2) == pytest.approx(1.25)


def test_per_token_acceptance():
  # 10 rounds, k = 3: position 0 accepted 8 times, position 1 4 times (of 8 reached), position 2
  # twice (of 4 reached): a = (8 + 4 + 2) / (10 + 8 + 4).
  assert bound.per_token_acceptance([8, 4, 2], 10) == pytest.approx(14 / 22)
  assert bound.per_token_acceptance([0, 0], 0) == 0.0
  assert bound.per_token_acceptance([5, 5], 5) == 1.0


def test_first_divergence():
  assert timing.first_divergence([1, 2, 3], [1, 2, 3]) is None
  assert timing.first_divergence([1, 2, 3], [1, 5, 3]) == 1
  assert timing.first_divergence([1, 2], [1, 2, 3]) == 2


@pytest.mark.parametrize("tied", [False, True])
def test_export_hf_round_trip(tmp_path, tied):
  config = tiny_config(vocab_size=96, bos_id=1, eos_id=2, tie_embeddings=tied,
                       rope_scaling=RopeScaling() if tied else None)
  model = sj.init_params(config, jax.random.key(0))
  export_hf(model, tmp_path / "hf")
  back = sj.from_hf(tmp_path / "hf")
  assert back.config == model.config
  assert jax.tree.structure(back.params) == jax.tree.structure(model.params)
  for ours, theirs in zip(jax.tree.leaves(model.params), jax.tree.leaves(back.params)):
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))  # bitwise

  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  ids = np.random.default_rng(0).integers(0, 96, (2, 13))
  ours = np.asarray(model(jnp.asarray(ids, jnp.int32), jnp.zeros((2,), jnp.int32)).logits)
  with torch.no_grad():
    theirs = hf(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_export_hf_rejects_non_llama(tmp_path):
  from specjax.models.config import gemma_style
  model = sj.init_params(gemma_style(tiny_config()), jax.random.key(0))
  with pytest.raises(ValueError, match="Llama"):
    export_hf(model, tmp_path / "hf")


def test_real_prompt_file_is_well_formed():
  data = json.loads(real.PROMPTS_FILE.read_text())
  assert "never" in data["not_for_training"].lower()
  prompts = real.load_prompts()
  assert set(prompts) == {"multi_turn", "translation", "summarization", "qa", "math", "code"}
  ids = set()
  for category, items in prompts.items():
    assert len(items) >= 6, category
    for item in items:
      roles = [m["role"] for m in item["messages"]]
      assert roles[-1] == "user" and set(roles) <= {"user", "assistant"}
      assert all(m["content"].strip() for m in item["messages"])
      ids.add(item["id"])
  assert len(ids) == sum(len(v) for v in prompts.values())  # unique ids
  assert any(len(item["messages"]) > 1 for item in prompts["multi_turn"])
  assert len(real.load_prompts(categories=("code",), per_category=2)["code"]) == 2
  with pytest.raises(ValueError, match="unknown categories"):
    real.load_prompts(categories=("poetry",))
  with pytest.raises(ValueError, match="per category"):
    real.load_prompts(per_category=0)


def test_agent_prompt_file_is_well_formed():
  """The agent-like prompt set: three categories of at least four conversations each, and per
  category earlier conversations (`history`, the suffix corpus's source) that are never timed."""
  path = real.PROMPTS_DIR / "agent.json"
  data = json.loads(path.read_text())
  prompts = real.load_prompts(path)
  assert set(prompts) == set(data["history"]) == {"code_edit", "tool_calls", "repeat_request"}
  timed = set()
  for category, items in prompts.items():
    assert len(items) >= 4 and len(data["history"][category]) >= 2, category
    for item in items + data["history"][category]:
      roles = [m["role"] for m in item["messages"]]
      assert roles[-1] == "user" and set(roles) <= {"system", "user", "assistant"}
      assert all(m["content"].strip() for m in item["messages"])
    timed |= {json.dumps(item["messages"]) for item in items}
  history = {json.dumps(h["messages"]) for hs in data["history"].values() for h in hs}
  assert not timed & history  # a corpus answer is never one of a timed prompt
  for item in prompts["tool_calls"]:  # earlier tool calls in the conversation are valid JSON
    calls = [json.loads(m["content"]) for m in item["messages"] if m["role"] == "assistant"]
    assert calls and all(set(c) == {"tool", "arguments"} for c in calls)


@pytest.mark.slow  # the suite's machinery: 25-210 s each; CI's time budget
def test_suffix_drafters_of_the_suite_with_a_corpus():
  """`suffix` and `suffix+corpus` (its corpus set by `with_corpus`) are built on request, and greedy
  decode with the corpus equals generate."""
  config = tiny_config(vocab_size=96, bos_id=1, eos_id=2, pad_id=0, max_len=128)
  target = sj.init_params(config, jax.random.key(0))
  entries = drafters_module.library_drafters(target, num_draft=3,
                                             names=("suffix", "suffix+corpus"))
  assert [e.name for e in entries] == ["suffix", "suffix+corpus"]
  tokens = jnp.asarray([[1, 5, 6, 7, 8, 9, 10, 11]], jnp.int32)
  lengths = jnp.asarray([8], jnp.int32)
  reference = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12)
  answer = np.asarray(reference.tokens[0, :int(reference.num_tokens[0])])
  corpus = SuffixCorpus.from_sequences([np.concatenate([[5, 6, 7, 8, 9, 10, 11], answer])],
                                          capacity=256)
  with_corpus = drafters_module.with_corpus(entries[1], corpus)
  assert with_corpus.drafter.corpus is corpus and entries[1].drafter.corpus is None
  out = sj.decode(target, with_corpus.drafter, tokens, jax.random.key(0), lengths=lengths,
                  max_new_tokens=12, num_draft=3)
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  summary = out.stats.summary()  # the corpus holds this very continuation: drafts get accepted
  assert summary["accepted"] >= 6 and summary["rounds"] < 12, summary
  # The tree form, with the same corpus: the same tokens, in fewer rounds than tokens.
  tree = drafters_module.with_corpus(drafters_module.library_drafters(
      target, num_draft=3, names=("suffix-tree+corpus",))[0], corpus)
  assert tree.tree is not None and tree.drafter.corpus is corpus
  out = sj.decode(target, tree.drafter, tokens, jax.random.key(0), lengths=lengths,
                  max_new_tokens=12, **tree.decode_kwargs())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  assert out.stats.summary()["rounds"] < 12


@pytest.mark.slow  # the suite's machinery: 25-210 s each; CI's time budget
def test_the_suites_vocabulary_self_drafts():
  """`self-int8+vocab` and `self-q4+vocab` are built on request with the target's tokenizer (not
  without one): the int8 and the 4-bit copies over the `draft_vocab_size` ids the target uses most
  (counted once for both) and each row's recent tokens; greedy decode with each equals generate."""
  config = tiny_config(vocab_size=96, bos_id=1, eos_id=2, pad_id=0, max_len=128,
                       tie_embeddings=True)
  target = sj.init_params(config, jax.random.key(0))
  counted = []

  class Ids:  # prompts as ids: `frequent_vocab` only encodes and reads the end-of-turn ids
    eos_ids = (2,)
    chat_template = None

    def encode_batch(self, texts):
      counted.append(len(texts))
      rows = [[3 + (7 * i + j) % 90 for j in range(6)] for i, _ in enumerate(texts)]
      return np.asarray(rows, np.int32), np.full((len(rows),), 6, np.int32)

  names = ("self-int8+vocab", "self-q4+vocab")
  with pytest.raises(ValueError, match="needs the target's tokenizer"):
    drafters_module.library_drafters(target, num_draft=3, names=names[1:])
  entries = drafters_module.library_drafters(target, num_draft=3, names=names, tokenizer=Ids(),
                                             log=lambda line: None)
  assert [e.name for e in entries] == list(names) and len(counted) == 1
  assert drafters_module.draft_vocab_size(96) == 24
  tokens = jnp.asarray([[1, 5, 6, 7, 8, 9, 10, 11], [1, 40, 41, 0, 0, 0, 0, 0]], jnp.int32)
  lengths = jnp.asarray([8, 3], jnp.int32)
  want = sj.generate(target, tokens, jax.random.key(0), lengths=lengths, max_new_tokens=12)
  for entry, bits in zip(entries, (8, 4)):
    assert entry.drafter.draft_ids.shape == (24,) and 2 in np.asarray(entry.drafter.draft_ids)
    assert entry.drafter.context_vocab == drafters_module.DRAFT_CONTEXT
    layer = entry.drafter.model.params["layers"]
    assert {leaf.bits for leaf in jax.tree.leaves(layer, is_leaf=quant.is_quantized)
            if quant.is_quantized(leaf)} == {bits}
    out = sj.decode(target, entry.drafter, tokens, jax.random.key(0), lengths=lengths,
                    max_new_tokens=12, num_draft=3)
    np.testing.assert_array_equal(out.tokens, want.tokens)


@pytest.mark.slow  # the suite's machinery: 25-210 s each; CI's time budget
def test_real_suite_machinery_on_a_tiny_model(tmp_path):
  """The real suite's measurement, summary, table and plots on a tiny random Llama and its
  `transformers` twin (exported weights), with prompts that repeat so lookup drafts get accepted."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = tiny_config(vocab_size=96, bos_id=1, eos_id=2, pad_id=0, max_len=128)
  target = sj.init_params(config, jax.random.key(0))
  peer = transformers.LlamaForCausalLM.from_pretrained(
      export_hf(target, tmp_path / "hf"), dtype=torch.float32).eval()
  cases = [real.PromptCase("code", "code-0", (1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6)),
           real.PromptCase("math", "math-0", tuple(range(3, 25)) + (3, 4, 5))]  # one width: 32
  everything = drafters_module.library_drafters(target, num_draft=2)
  assert [d.name for d in everything] == ["ngram", "suffix", "self-int8", "self-int4", "self-q4"]
  drafters = drafters_module.library_drafters(target, num_draft=2,
                                              names=("ngram", "self-int8", "suffix-tree"))
  assert [d.name for d in drafters] == ["ngram", "suffix-tree", "self-int8"]
  assert drafters[1].tree is not None and drafters[1].verify_k == drafters[1].tree.size
  with pytest.raises(ValueError, match="not available"):
    drafters_module.library_drafters(target, num_draft=2, names=("eagle-nonexistent",))
  measured = real.measure_suite(
      target, cases, drafters, samplings={"greedy": sj.Sampling(), "T=1": sj.Sampling(1.0)},
      max_new_tokens=6, eos=(2,), peer_model=peer, log=lambda line: None)
  assert measured["costs"]["draft_round_s"]["ngram"] > 0  # the lookup is timed, not assumed free
  assert len(measured["records"]) == 2 * len(cases)
  for record in measured["records"]:
    assert record["width"] == 32 and record["calls"]["generate"]["new_tokens"] >= 1
    assert set(record["calls"]) == {"generate", "ngram", "suffix-tree", "self-int8"}
  summary = measured["summary"]
  assert {(r["sampling"], r["category"]) for r in summary} == {
      (s, c) for s in ("greedy", "T=1") for c in ("code", "math", "all")}
  for r in summary:
    for key in ("acceptance_per_token", "tokens_per_round", "speedup", "bound",
                "generate_tokens_per_s", "decode_tokens_per_s"):
      assert np.isfinite(r[key]) and r[key] >= 0, key
    # The loop speedup is measured where every call outlasted its prefill, and only there (a
    # 6-token call on a loaded machine may not); the flag is checked against the records.
    group = [rec for rec in measured["records"] if rec["sampling"] == r["sampling"]
             and r["category"] in ("all", rec["category"])]
    resolved = all(rec["calls"][n]["seconds"] > rec["prefill_s"]
                   for rec in group for n in ("generate", r["drafter"]))
    assert r["loop_resolved"] == resolved
    for key in ("speedup_excl_prefill", "efficiency"):
      assert (np.isfinite(r[key]) and r[key] > 0) if resolved else np.isnan(r[key]), key
    assert 1.0 <= r["tokens_per_round"] <= r["num_draft"] + 1
    assert r["tree_nodes"] == (None if r["drafter"] != "suffix-tree" else drafters[1].tree.size)
    if r["sampling"] == "greedy":
      assert r["greedy_identical"]
      assert r["hf_generate_tokens_per_s"] > 0 and r["hf_prompt_lookup_tokens_per_s"] > 0
  overall = next(r for r in summary if r["sampling"] == "greedy" and r["category"] == "all")
  assert overall["new_tokens"] == sum(r["calls"]["ngram"]["new_tokens"]
                                      for r in measured["records"] if r["sampling"] == "greedy")
  for p in measured["peer_records"]:  # same weights, same ids: the same greedy tokens
    assert all(d is None for d in p["first_divergence_from_specjax_generate"].values()), p
  result = {"model": "tiny", "model_description": "tiny random Llama", "wall_s": 1.0,
            "load_s": 0.0, "environment": environment(),
            "settings": {"prompts": 2, "prompts_per_category": 1, "max_new_tokens": 6},
            **measured}
  table = report.real_table(result)
  assert "| **overall** | ngram | 2 |" in table and "transformers prompt lookup" in table
  assert "| generate tok/s | decode tok/s | speedup |" in table  # greedy
  assert "| generate ms/token | decode ms/token | per-token speedup |" in table  # T=1
  assert "**Per round (ms)**" in table and "| greedy | **overall** | ngram |" in table
  assert (f"| **overall** | suffix-tree | {drafters[1].num_draft} (tree, {drafters[1].tree.size}) |"
          in table)
  files = plots.plot_real(result, tmp_path, "real_tiny")
  assert files == ["real_tiny_speedup.png", "real_tiny_peer.png"]
  for name in files:
    assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_real_model_names_are_checked():
  with pytest.raises(ValueError, match="unknown real model"):
    real_models.gguf_path("llama-70b")
  assert real_models.load_draft_model("smollm2-135m") is None  # a self-drafting model: none


def test_the_draft_model_at_each_width_is_its_own_drafter():
  """`draft_model` as a dict (the suite's `DRAFT_MODELS`: int8 and 4-bit) gives one entry per
  width, each with its own drafter, and only the ones asked for; a model without a separate
  draft model builds none."""
  config = tiny_config(vocab_size=96, bos_id=1, eos_id=2, pad_id=0, max_len=128)
  target = sj.init_params(config, jax.random.key(0))
  small = sj.init_params(dataclasses.replace(config, num_layers=1), jax.random.key(1))
  models = {"draft-int8": (sj.ModelDrafter(sj.quantize(small, 8)), "int8"),
            "draft-q4": (sj.ModelDrafter(sj.quantize(small, 4, asymmetric=True)), "q4")}
  names = [e.name for e in drafters_module.library_drafters(target, num_draft=2,
                                                              draft_model=models)]
  assert names[-2:] == ["draft-int8", "draft-q4"]
  (entry,) = drafters_module.library_drafters(target, num_draft=2, names=("draft-q4",),
                                              draft_model=models)
  assert entry.drafter is models["draft-q4"][0] and entry.description == "q4"
  assert set(drafters_module.DRAFT_MODELS) == {"draft-int8", "draft-q4"}
  assert real._draft_models("smollm2-135m", ("draft-q4",)) == {}


def test_a_separate_draft_model_joins_the_suite():
  """A model with a draft model of its own (the Qwen2.5-Coder 1.5B's 0.5B) gets a `draft-int8`
  entry: built only where there is one, run like any drafter, greedy output as `generate`'s."""
  config = tiny_config(vocab_size=96, bos_id=1, eos_id=2, pad_id=0, max_len=128)
  target = sj.init_params(config, jax.random.key(0))
  small = sj.init_params(dataclasses.replace(config, num_layers=1), jax.random.key(1))
  draft = (sj.ModelDrafter(sj.quantize(small, 8)), "a one-layer draft model in int8")
  everything = drafters_module.library_drafters(target, num_draft=2, draft_model=draft)
  assert [d.name for d in everything] == ["ngram", "suffix", "self-int8", "self-int4", "self-q4",
                                          "draft-int8"]
  (entry,) = drafters_module.library_drafters(target, num_draft=2, names=("draft-int8",),
                                              draft_model=draft)
  assert entry.drafter is draft[0] and entry.description == draft[1] and entry.num_draft == 2
  with pytest.raises(ValueError, match="not available"):
    drafters_module.library_drafters(target, num_draft=2, names=("draft-int8",))
  cases = [real.PromptCase("code", "code-0", (1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6))]
  measured = real.measure_suite(target, cases, [entry], samplings={"greedy": sj.Sampling()},
                                max_new_tokens=6, eos=(2,), log=lambda line: None)
  assert measured["costs"]["draft_round_s"]["draft-int8"] > 0
  (record,) = measured["records"]
  assert record["calls"]["draft-int8"]["first_divergence_from_generate"] is None
  assert record["calls"]["draft-int8"]["new_tokens"] == len(record["generate_tokens"])
  (row,) = [r for r in measured["summary"] if r["category"] == "all"]  # its round's cost, in ms
  assert row["verify_ms"] == 1e3 * measured["costs"]["verify_s"][2]
  assert row["draft_ms"] == 1e3 * measured["costs"]["draft_round_s"]["draft-int8"]
  assert row["target_step_ms"] == 1e3 * measured["costs"]["target_step_s"]
  call = record["calls"]["draft-int8"]
  if row["loop_resolved"]:
    assert row["round_ms"] == pytest.approx(
        1e3 * (call["seconds"] - record["prefill_s"]) / call["rounds"])
    assert row["other_ms"] == pytest.approx(row["round_ms"] - row["draft_ms"] - row["verify_ms"])
  else:
    assert np.isnan(row["round_ms"]) and np.isnan(row["other_ms"])


def test_the_real_suite_refuses_two_draft_lengths_before_loading(tmp_path):
  """Every drafter of a real-suite run drafts at one k: `--k 5,6` used to run k = 5 alone."""
  import types
  settings = types.SimpleNamespace(model="smollm2-135m", num_drafts=(5, 6))
  with pytest.raises(ValueError, match="one draft length per run"):
    real.run_real(settings, tmp_path, plots=False, log=lambda *_: None)


def test_a_parallel_head_checkpoint_is_named_apart_and_drafts_at_most_its_slots(tmp_path):
  """A parallel head sits beside the shipped sequential one in the suite's list (its own name),
  and drafts at most its `parallel + 2` tokens a round whatever `--k`."""
  from specjax.drafters.eagle import network as eagle
  config = tiny_config(vocab_size=96, num_layers=4, max_len=128)
  target = sj.init_params(config, jax.random.key(0))
  head = eagle.init_head(eagle.head_config_for(config, draft_vocab_size=48, parallel=2), target,
                         jax.random.key(1), np.arange(0, 96, 2))
  eagle.save_head(head, tmp_path / "parallel")
  entry = drafters_module.load_head_drafter(target, tmp_path / "parallel", num_draft=6)
  assert (entry.name, entry.num_draft) == ("eagle3-parallel", 4)


@pytest.mark.slow  # compiles decode for two heads (~1-2 min on a shared 2-core CPU)
def test_real_suite_takes_trained_head_checkpoints(tmp_path):
  """Head checkpoints join the drafter list by kind, are timed like any drafter, and (greedy)
  give `generate`'s tokens; untrained heads, so nothing is asserted about acceptance."""
  from specjax.drafters.eagle import network as eagle
  from specjax.drafters.medusa import network as medusa
  config = tiny_config(vocab_size=96, num_layers=4, bos_id=1, eos_id=2, pad_id=0, max_len=128)
  target = sj.init_params(config, jax.random.key(0))
  draft_ids = np.arange(0, 96, 2)
  head = eagle.init_head(eagle.head_config_for(config, draft_vocab_size=48), target,
                         jax.random.key(1), draft_ids)
  eagle.save_head(head, tmp_path / "eagle")
  heads = medusa.init_medusa(medusa.MedusaConfig(embed_dim=config.embed_dim, num_heads=2,
                                                 draft_vocab_size=48, vocab_size=96),
                             target, draft_ids)
  medusa.save_medusa(heads, tmp_path / "medusa")
  drafters = drafters_module.library_drafters(target, num_draft=3,
                                   names=("ngram", "eagle3", "medusa"),
                                   heads=(tmp_path / "eagle", tmp_path / "medusa"))
  assert [(d.name, d.num_draft) for d in drafters] == [("ngram", 3), ("eagle3", 3), ("medusa", 2)]
  with pytest.raises(ValueError, match="no head checkpoint"):
    drafters_module.load_head_drafter(target, tmp_path / "missing", num_draft=3)
  cases = [real.PromptCase("code", "code-0", (1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6))]
  measured = real.measure_suite(target, cases, drafters, samplings={"greedy": sj.Sampling()},
                                max_new_tokens=6, eos=(2,), log=lambda line: None)
  assert all(measured["costs"]["draft_round_s"][d.name] > 0 for d in drafters)
  for r in measured["summary"]:
    assert r["greedy_identical"], r["drafter"]
    assert r["draft_ratio"] > 0 and np.isfinite(r["bound"])


@pytest.mark.slow  # the suite's machinery: 25-210 s each; CI's time budget
def test_the_shipped_head_joins_the_suite_at_the_asked_k():
  """With SmolLM2 as the target, `eagle3` (the shipped head alone) and `eagle3+lookup` (the
  shipped hybrid drafter) join the list at the asked k: a sequential head has no bound on k
  (its `max_draft` is None)."""
  pair = sj.load_default()
  entries = drafters_module.library_drafters(pair.target, num_draft=5,
                                             names=("eagle3", "eagle3+lookup"))
  assert [(e.name, e.num_draft) for e in entries] == [("eagle3", 5), ("eagle3+lookup", 5)]


@pytest.mark.slow  # the suite's machinery: 25-210 s each; CI's time budget
def test_real_suite_runs_a_drafter_inside_adaptive_drafter():
  """`NAME+adaptive` names build NAME and wrap it in `specjax.adaptive_drafter` (under a given
  calibration here), take the plan's K as their k, and run through the suite like any drafter:
  greedy output identical to `generate`."""
  from specjax.drafters.adaptive import costs
  from specjax.drafters.adaptive.drafter import AdaptiveDrafter
  from specjax.tuning.calibrate import measure_acceptance, measure_costs
  config = tiny_config(vocab_size=96, bos_id=1, eos_id=2, pad_id=0, max_len=128)
  target = sj.init_params(config, jax.random.key(0))
  names = ("ngram+adaptive", "self-int8")
  assert drafters_module.base_names(names) == ("ngram", "self-int8")
  entries = drafters_module.library_drafters(target, num_draft=2,
                                             names=drafters_module.base_names(names))
  ids = jnp.asarray([[1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]], jnp.int32)
  lengths = jnp.asarray([12], jnp.int32)
  ngram = entries[0].drafter
  calibration = costs.Calibration(
      measure_costs(target, ngram, batch=1, max_width=4, repeats=1),
      measure_acceptance(target, ngram, ids, lengths, num_draft=3, sampling=sj.Sampling(),
                         max_new_tokens=8))
  drafters = drafters_module.with_adaptive(target, None, entries, names, calibration=calibration,
                                           max_draft=3, log=lambda line: None)
  assert [d.name for d in drafters] == ["self-int8", "ngram+adaptive"]
  adaptive = drafters[1]
  assert isinstance(adaptive.drafter, AdaptiveDrafter) and adaptive.drafter.drafter is ngram
  assert adaptive.num_draft == adaptive.drafter.max_draft <= 3
  cases = [real.PromptCase("code", "code-0", (1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6))]
  measured = real.measure_suite(target, cases, drafters, samplings={"greedy": sj.Sampling()},
                                max_new_tokens=6, eos=(2,), log=lambda line: None)
  assert set(measured["records"][0]["calls"]) == {"generate", "self-int8", "ngram+adaptive"}
  for r in measured["summary"]:
    assert r["greedy_identical"], r["drafter"]
