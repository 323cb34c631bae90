"""A checkpoint's Jinja chat template, rendered the way Hugging Face chat templates are written to be rendered.

The environment: Jinja2's immutable sandbox (a template from a checkpoint is untrusted code: no attribute of
Python internals, no mutation of the inputs), `trim_blocks` and `lstrip_blocks` on, the `loopcontrols` extension
(`{% break %}`, `{% continue %}`), a `{% generation %}...{% endgeneration %}` block that renders its body (templates
mark the assistant's tokens with it), and the names templates rely on: `raise_exception(message)` (a template's
refusal of a conversation, surfaced as `ChatTemplateError` with its message), `strftime_now(format)`, a `tojson`
filter that keeps non-ASCII text and HTML characters as they are (`ensure_ascii`, `indent`, `separators`,
`sort_keys` as in `json.dumps`). The context: `messages` (dicts; keys whose value is None left out),
`add_generation_prompt`, `tools` and `documents` (None), and every named special token (`bos_token`, `eos_token`,
...) as its text. The rendered text is then encoded without adding special tokens (the template writes them).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or failed to render; the message says why."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}`: renders `body` (the marker matters only for training masks)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled chat template (compile once per tokenizer, render per request)."""

    def __init__(self, source: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the checkpoint's chat template does not compile: {exc.message} "
                                    f"(line {exc.lineno})") from None
        self.source = source

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               special_tokens: Mapping[str, str]) -> str:
        """The conversation as text; raises ChatTemplateError when the template refuses it or fails."""
        plain = [{key: value for key, value in message.items() if value is not None} for message in messages]
        context = {**special_tokens, "messages": plain, "add_generation_prompt": add_generation_prompt,
                   "tools": None, "documents": None}
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed on this conversation: {exc}") from None
