"""What a JSON request body may hold before any handler sees it: bounded nesting, and text that every later step
(tokenizers, UTF-8 encoders, orjson, the router's re-serialisation) accepts.

`check_body(raw)` parses the body and walks it without recursion; it raises `APIError(400)` naming the top-level
field (`param`) at fault when
- containers nest deeper than `MAX_JSON_DEPTH` (orjson refuses to serialise past 255 levels, Python's parser
  recurses per level: without the bound a deep body passes the parser and fails later with a 500);
- a string or key holds a lone UTF-16 surrogate (`"\\ud800"` parses to a Python str no UTF-8 encoder accepts) or
  NUL (U+0000, which no prompt, id or name needs and which C libraries end strings at).
A body that is not JSON is left to the framework's own 400. Messages never echo the offending value.
"""

from __future__ import annotations

import json
import re
from typing import Any

from serving.errors import APIError

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have (OpenAI's bodies nest a handful of levels)."""
_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")


def bad_text(text: str) -> str | None:
    """Why `text` is refused ("a lone surrogate", "NUL"), or None when it is fine."""
    found = _BAD_TEXT.search(text)
    if found is None:
        return None
    return "NUL (U+0000)" if found.group() == "\x00" else "a lone UTF-16 surrogate"


def check_body(raw: bytes) -> None:
    """Raise APIError(400) when the JSON body `raw` nests too deep or holds refused text (module docstring)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return  # not JSON (or beyond the parser): the framework answers its own 400
    stack: list[tuple[Any, int, str | None]] = [(doc, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, str):
            _check_text(value, field)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", field)
        if isinstance(value, dict):
            for key, item in value.items():
                name = key if field is None and depth == 1 else field
                _check_text(key, name if bad_text(key) is None else None)
                stack.append((item, depth + 1, name))
        else:
            stack.extend((item, depth + 1, field) for item in value)


def _check_text(text: str, field: str | None) -> None:
    reason = bad_text(text)
    if reason is not None:
        where = f"field {field!r}" if field is not None else "a field name"
        raise APIError(400, f"{where} holds {reason}: send valid Unicode text without NUL", field)
