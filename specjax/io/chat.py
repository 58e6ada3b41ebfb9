"""Chat templates: the Jinja2 template a model ships, rendered as `transformers` renders it.

The template comes from the GGUF metadata (`tokenizer.chat_template`), from `chat_template` in
tokenizer_config.json (a string, or a list of named templates of which "default" is used), or from
a chat_template.jinja file. It is rendered in a sandboxed Jinja2 environment with `trim_blocks` and
`lstrip_blocks`, the variables `messages`, `add_generation_prompt` and the special token strings
(`bos_token`, `eos_token`, ...), and the helpers templates use (`raise_exception`, `strftime_now`,
a `tojson` that keeps non-ASCII characters).
"""

from __future__ import annotations

import datetime
import functools
import json
import pathlib
from typing import Any, Sequence


class ChatTemplateError(ValueError):
  """The template raised (via `raise_exception`) or could not be compiled."""


@functools.lru_cache(maxsize=16)
def _compile(source: str):
  import jinja2
  from jinja2 import ext, sandbox

  def raise_exception(message):
    raise ChatTemplateError(f"chat template: {message}")

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  try:
    return env.from_string(source)
  except jinja2.TemplateError as error:
    raise ChatTemplateError(f"chat template does not compile: {error}") from None


def check_messages(messages: Sequence[dict]) -> list[dict]:
  """Validates a conversation: a non-empty list of {"role": str, "content": str} dicts."""
  if isinstance(messages, dict) or not isinstance(messages, (list, tuple)) or not messages:
    raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
  for i, message in enumerate(messages):
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
      raise ValueError(f"messages[{i}] must be a dict with a string 'role', got {message!r}")
  return [dict(m) for m in messages]


def render(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
           special_tokens: dict[str, str | None] | None = None, **variables: Any) -> str:
  """The text of a conversation under a chat template.

  Args:
    template: the Jinja2 source.
    messages: [{"role": "system" | "user" | "assistant", "content": str}, ...].
    add_generation_prompt: end with the header that opens the assistant's reply.
    special_tokens: {"bos_token": "<s>", "eos_token": ..., ...} as the template expects them.
    **variables: extra template variables (e.g. `tools=None`, `enable_thinking=False`).

  Raises:
    ValueError: malformed messages, or the template raised / does not compile.
  """
  messages = check_messages(messages)
  context = dict(special_tokens or {}, **variables)
  try:
    return _compile(template).render(messages=messages,
                                     add_generation_prompt=add_generation_prompt, **context)
  except ChatTemplateError:
    raise
  except Exception as error:  # jinja2 errors from inside the template
    raise ChatTemplateError(f"chat template failed: {type(error).__name__}: {error}") from None


def template_from_directory(directory: pathlib.Path, config: dict) -> str | None:
  """The chat template of a Hugging Face tokenizer directory, or None."""
  jinja = directory / "chat_template.jinja"
  if jinja.is_file():
    return jinja.read_text()
  value = config.get("chat_template")
  if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
    value = named.get("default") or next(iter(named.values()), None)
  return value if isinstance(value, str) else None


# Fallbacks for files that ship no template (e.g. a base model's GGUF). Gemma: the system prompt
# opens the first user turn; the assistant's role is "model".
_BUILTIN = {
    "gemma": (
        "{{ bos_token }}"
        "{% if messages[0]['role'] == 'system' %}"
        "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
        "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
        "{% for m in turns %}"
        "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + m['content'] | trim"
        " + '<end_of_turn>\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>'"
        " + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
}


def builtin_template(name: str) -> str:
  """A built-in chat template: "gemma" (Gemma's turn format) or "chatml"."""
  if name not in _BUILTIN:
    raise ValueError(f"no built-in chat template {name!r}; known: {', '.join(_BUILTIN)}")
  return _BUILTIN[name]


def default_template_for(family: str) -> str:
  """The built-in template for a model family (Gemma's turn format for Gemma, else ChatML)."""
  return builtin_template("gemma" if family.startswith("gemma") else "chatml")


def with_chat_template(tokenizer, family: str):
  """`tokenizer` if it has a chat template; else a shallow copy carrying the built-in template for
  `family` (`default_template_for`): a base model's file (Gemma 3 270M's) carries none."""
  if getattr(tokenizer, "chat_template", None):
    return tokenizer
  import copy
  copied = copy.copy(tokenizer)
  copied.chat_template = default_template_for(family)
  return copied
