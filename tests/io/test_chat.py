"""Chat templates: where they are found, how they render (token-identical to transformers'
apply_chat_template on a saved tokenizer directory), and clear errors."""

import json

import pytest

from specjax.io import load_tokenizer
from specjax.io import chat

TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] + '\\n' }}"
            "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "  What is 2+2?  "},
                {"role": "assistant", "content": "4"},
                {"role": "user", "content": "Now café 3+3 — with unicode ✓"}]


@pytest.fixture(scope="module")
def hf_dir(chatml_tokenizer_dir):
  """A transformers tokenizer directory (byte-level BPE with <|im_start|>/<|im_end|>)."""
  return chatml_tokenizer_dir(TEMPLATE, "What is two plus two? Four. Be brief, be kind.")


def test_matches_transformers_apply_chat_template(hf_dir):
  transformers = pytest.importorskip("transformers")
  reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
  tokenizer = load_tokenizer(hf_dir)
  assert tokenizer.chat_template == TEMPLATE
  for add in (True, False):
    want = reference.apply_chat_template(CONVERSATION, add_generation_prompt=add, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=add) == list(want)
    assert tokenizer.render_chat(CONVERSATION, add) == reference.apply_chat_template(
        CONVERSATION, add_generation_prompt=add, tokenize=False)


def test_template_sources(tmp_path, hf_dir):
  config = json.loads((hf_dir / "tokenizer_config.json").read_text())
  jinja = hf_dir / "chat_template.jinja"
  source = jinja.read_text() if jinja.is_file() else config["chat_template"]
  assert source == TEMPLATE
  # tokenizer_config.json: a string, or a list of named templates ("default" is used)
  assert chat.template_from_directory(tmp_path, {"chat_template": "A"}) == "A"
  named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
  assert chat.template_from_directory(tmp_path, {"chat_template": named}) == "D"
  assert chat.template_from_directory(tmp_path, {}) is None
  (tmp_path / "chat_template.jinja").write_text("J")  # the .jinja file wins
  assert chat.template_from_directory(tmp_path, {"chat_template": "A"}) == "J"


def test_variables_and_helpers():
  text = chat.render("{{ bos_token }}{{ messages | tojson }}{% if extra %}!{% endif %}",
                     [{"role": "user", "content": "é"}], special_tokens={"bos_token": "<s>"},
                     extra=True)
  assert text == '<s>[{"role": "user", "content": "é"}]!'
  assert chat.render("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                     "{{ m.content }}{% endfor %}", [{"role": "user", "content": "a"},
                                                    {"role": "user", "content": "b"}]) == "a"


def test_builtin_gemma_template():
  text = chat.render(chat.builtin_template("gemma"), CONVERSATION,
                     special_tokens={"bos_token": "<bos>"})
  assert text == ("<bos><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n"
                  "<start_of_turn>model\n4<end_of_turn>\n"
                  "<start_of_turn>user\nNow café 3+3 — with unicode ✓<end_of_turn>\n"
                  "<start_of_turn>model\n")
  assert chat.default_template_for("gemma3_text") == chat.builtin_template("gemma")
  assert chat.default_template_for("llama") == chat.builtin_template("chatml")


def test_with_chat_template_keeps_a_files_own_and_fills_in_a_missing_one():
  import types
  own = types.SimpleNamespace(chat_template="{{ messages }}")
  assert chat.with_chat_template(own, "gemma3_text") is own
  base = types.SimpleNamespace(chat_template=None)
  filled = chat.with_chat_template(base, "gemma3_text")
  assert filled.chat_template == chat.builtin_template("gemma") and base.chat_template is None


def test_errors(hf_dir, tmp_path):
  with pytest.raises(ValueError, match="chat template: roles must alternate"):
    chat.render("{{ raise_exception('roles must alternate') }}", CONVERSATION)
  with pytest.raises(ValueError, match="does not compile"):
    chat.render("{% for %}", CONVERSATION)
  with pytest.raises(ValueError, match="non-empty list"):
    chat.render(TEMPLATE, [])
  with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with a string 'role'"):
    chat.render(TEMPLATE, [{"content": "no role"}])
  with pytest.raises(ValueError, match="no built-in chat template 'zephyr'"):
    chat.builtin_template("zephyr")
  (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
  tokenizer = load_tokenizer(tmp_path)  # tokenizer.json alone: no template
  with pytest.raises(ValueError, match="has no chat template.*chat_template="):
    tokenizer.apply_chat_template(CONVERSATION)
