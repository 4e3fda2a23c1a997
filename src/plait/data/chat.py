"""Conversations through a model's chat template: the text a chat model was tuned on,
and which of its characters are the assistant's.

A Hugging Face model directory keeps its chat template (a Jinja template over
`messages`, `bos_token`, `eos_token`, `add_generation_prompt`) in
`chat_template.jinja` or in tokenizer_config.json's "chat_template"; `plait
import` copies both files into the run beside tokenizer.json, where `plait
data --chat` and `plait sample --chat` find them. The template is rendered in
Jinja's sandbox with the same settings and helpers transformers gives it
(trim_blocks, lstrip_blocks, loop controls, raise_exception, strftime_now, a
tojson that keeps non-ASCII), so the text is the one the model was tuned on.

Which tokens the loss keeps: each assistant turn is the text that rendering the
conversation up to it adds to the conversation before it with the generation
prompt (`spans`), the part a model must produce itself; a template that does
not render conversations as prefixes of each other is refused in one line.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from plait.data.tokenizer import HFTokenizer
from plait.errors import UserError

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
FILES = (CONFIG_FILE, TEMPLATE_FILE)  # what import and export carry beside tokenizer.json


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A chat template and the special tokens it is rendered with."""

    def __init__(self, text: str, bos: str | None, eos: str | None, where: str):
        try:
            from jinja2 import TemplateError
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise UserError("chat templates need jinja2: pip install jinja2 (or pip install "
                            "'plait[chat]')") from None

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators=None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(text)
        except TemplateError as e:
            raise UserError(f"the chat template of {where} is not valid Jinja ({e}); fix it "
                            "or pass another with --chat-template") from None
        self.bos, self.eos, self.where = bos, eos, where
        self._error: type[Exception] = TemplateError

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=
                                        add_generation_prompt, bos_token=self.bos or "",
                                        eos_token=self.eos or "", tools=None,
                                        documents=None)
        except self._error as e:
            raise UserError(f"the chat template of {self.where} refused a conversation "
                            f"({e})") from None

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the [start, end) characters of each assistant turn):
        what rendering up to the turn adds to the conversation before it with the
        generation prompt."""
        text = self.render(messages)
        spans = []
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            asked = self.render(messages[:k], add_generation_prompt=True)
            upto = self.render(messages[:k + 1])
            if not (upto.startswith(asked) and text.startswith(upto)):
                raise UserError(f"the chat template of {self.where} does not render a "
                                "conversation as the continuation of its first turns, so the "
                                "assistant's turns cannot be told apart; use another "
                                "template (--chat-template)")
            spans.append((len(asked), len(upto)))
        return text, spans


def find(tokenizer: str | Path, explicit: str | Path | None = None) -> ChatTemplate:
    """The chat template for a tokenizer.json: `explicit` (a .jinja file or a
    tokenizer_config.json), else chat_template.jinja or tokenizer_config.json beside it."""
    tokenizer = Path(tokenizer)
    candidates = [Path(explicit)] if explicit else [tokenizer.parent / TEMPLATE_FILE,
                                                    tokenizer.parent / CONFIG_FILE]
    config_path = tokenizer.parent / CONFIG_FILE
    config: dict = {}
    if config_path.is_file():
        config = _read_json(config_path)
    for path in candidates:
        if not path.is_file():
            if explicit:
                raise UserError(f"chat template '{path}' not found (--chat-template)")
            continue
        if path.suffix == ".json":
            config = _read_json(path)
            text = config.get("chat_template")
            if isinstance(text, list):  # named templates: the default one
                text = next((t.get("template") for t in text if t.get("name") == "default"),
                            None)
            if not isinstance(text, str):
                if explicit:
                    raise UserError(f"'{path}' has no chat_template; pass a .jinja file")
                continue
        else:
            text = path.read_text(encoding="utf-8")
        return ChatTemplate(text, _token_text(config.get("bos_token")),
                            _token_text(config.get("eos_token")), str(path))
    raise UserError(f"no chat template beside {tokenizer} ({TEMPLATE_FILE}, or "
                    f"{CONFIG_FILE} with a chat_template); import the model with plait "
                    "import, or pass one with --chat-template")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise UserError(f"{path} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} is not a JSON object; pass a tokenizer_config.json")
    return value


def conversation(value: Any, where: str) -> list[dict]:
    """A record's messages, checked: a list of {"role": str, "content": str}."""
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise UserError(f"{where} is not a conversation: --chat reads a list of messages, "
                        "each {\"role\": ..., \"content\": ...}")
    return value


def encode(conversations: list[list[dict]], template: ChatTemplate, tok: HFTokenizer
           ) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask) of each conversation: its rendered text encoded as the template
    wrote it (the template places the begin- and end-of-text tokens itself), 1 for each
    token that starts inside an assistant turn."""
    rendered = [template.spans(c) for c in conversations]
    encoded = tok.encode_with_offsets([text for text, _ in rendered])
    return [(ids, [int(any(a <= start < b for a, b in spans)) for start, _ in offsets])
            for (ids, offsets), (_, spans) in zip(encoded, rendered, strict=True)]
