"""What a JSON request body may hold before any handler sees it: bounded nesting, and text that every later step
(tokenizers, UTF-8 encoders, orjson, the router's re-serialisation) accepts.

`check_body(raw)` parses the body and walks it without recursion; it raises `APIError(400)` naming the top-level
field (`param`) at fault when
- containers nest deeper than `MAX_JSON_DEPTH` (orjson refuses to serialise past 255 levels, Python's parser
  recurses per level: without the bound a deep body passes the parser and fails later with a 500);
- a string or key holds a lone UTF-16 surrogate (`"\\ud800"` parses to a Python str no UTF-8 encoder accepts);
- a string or key outside model text holds NUL (`refused_nul`).
A body that is not JSON is left to the framework's own 400. Messages never echo the offending value.

The NUL rule (the router applies the same one, router/validation.py): NUL (U+0000) is text a byte-level model may
write, so a client sending a conversation back sends it; it is accepted in text that goes to the tokenizer
(`is_model_text`: the completion `prompt`, string or list of strings; a chat message's `content`, string or a part's
`text`; a message's tool call `arguments`) and refused everywhere else: identifiers and control fields (`model`,
`user`, `cache_salt`, request ids, names, `response_format`, ...), field names, and `stop` strings (a control field
matched by the server; a client stops at byte 0 with `stop_token_ids`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from serving.errors import APIError

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have (OpenAI's bodies nest a handful of levels)."""
_SURROGATE = re.compile("[\ud800-\udfff]")
Path = tuple[str | int, ...]


def is_model_text(path: Path) -> bool:
    """A string at `path` (keys and list indices from the body's top) is text for the tokenizer, where NUL is
    accepted (module docstring)."""
    match path:
        case ("prompt",) | ("prompt", int()):
            return True
        case ("messages", int(), "content") | ("messages", int(), "content", int(), "text"):
            return True
        case ("messages", int(), "tool_calls", int(), "function", "arguments"):
            return True
    return False


def strings(doc: Any, max_depth: int) -> Iterator[tuple[Path, str, bool]]:
    """Every string of the JSON document `doc`, keys included, as (path, text, is_key), without recursion; a key's
    path is that of its value. Raises APIError(400) naming the top-level field for containers nested deeper than
    `max_depth` (the document itself is level 1)."""
    stack: list[tuple[Any, Path]] = [(doc, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            yield path, value, False
            continue
        if len(path) >= max_depth:
            raise APIError(400, f"the request body nests deeper than {max_depth} levels", _field(path))
        if isinstance(value, dict):
            for key, item in value.items():
                yield (*path, key), key, True
                if isinstance(item, (str, dict, list)):
                    stack.append((item, (*path, key)))
        else:
            stack.extend(((item, (*path, i)) for i, item in enumerate(value) if isinstance(item, (str, dict, list))))


def refused_nul(path: Path, text: str, is_key: bool) -> bool:
    """`text` holds a NUL where the rule refuses one (a field name, or a value outside model text)."""
    return "\x00" in text and (is_key or not is_model_text(path))


def nul_error(path: Path, is_key: bool) -> APIError:
    """The 400 for a refused NUL: names the top-level field (none when that field's own name holds it), never the
    value."""
    param = None if is_key and len(path) == 1 else _field(path)
    where = "a field name" if is_key else f"field {param!r}"
    return APIError(400, f"{where} holds NUL (U+0000): NUL is accepted only in text for the model (prompt, message "
                         f"content, tool call arguments), not in names, ids or control fields", param)


def check_body(raw: bytes) -> None:
    """Raise APIError(400) when the JSON body `raw` nests too deep or holds refused text (module docstring)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return  # not JSON (or beyond the parser): the framework answers its own 400
    if not isinstance(doc, (dict, list)):
        doc = [doc]
    for path, text, is_key in strings(doc, MAX_JSON_DEPTH):
        if _SURROGATE.search(text) is not None:
            param = None if is_key and len(path) == 1 else _field(path)
            where = "a field name" if is_key else f"field {param!r}"
            raise APIError(400, f"{where} holds a lone UTF-16 surrogate: send valid Unicode text", param)
        if refused_nul(path, text, is_key):
            raise nul_error(path, is_key)


def _field(path: Path) -> str | None:
    return path[0] if path and isinstance(path[0], str) else None
