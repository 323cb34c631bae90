"""Scrub internal names out of error messages before a client sees them.

An error message may name a peer (`10.2.3.4:5600`, `http://prefill-0.pool:8100/...`, `[fd00::1]:80`), an engine
id or a lease id (uuid hex). Clients get the message with those replaced by `<internal>` / `<id>`; the full
message stays in the server's own log. Messages without such names are returned unchanged (same object), so
a node's 400 relayed by the router is byte-identical. serving/errors.py applies it to every error body.
"""

from __future__ import annotations

import re

INTERNAL = "<internal>"
ID = "<id>"
_PATTERNS = (
    (re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+"), INTERNAL),  # URLs
    (re.compile(r"\[[0-9a-fA-F:.]*:[0-9a-fA-F:.]*\](?::\d+)?"), INTERNAL),  # [IPv6](:port)
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), INTERNAL),  # IPv4(:port)
    (re.compile(r"(?<![\w:])[0-9a-fA-F]{0,4}(?::[0-9a-fA-F]{0,4}){2,7}(?![\w:])"), INTERNAL),  # bare IPv6
    (re.compile(r"\b(?=[a-zA-Z0-9.-]*[a-zA-Z])[a-zA-Z0-9][a-zA-Z0-9.-]*:\d{2,5}\b"), INTERNAL),  # host:port
    (re.compile(r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"), ID),  # uuid
    (re.compile(r"\b[0-9a-fA-F]{16,}\b"), ID),  # hex ids (engine ids, lease ids, fingerprints)
    (re.compile(r"\b(lease(?:_id)?[\s=:'\"]+)(?!<id>)[^\s'\",;)]+", re.IGNORECASE), r"\1" + ID),  # any lease id
)
MAX_MESSAGE_CHARS = 2000


def scrub_message(message: str) -> str:
    """`message` without peer addresses, engine ids or lease ids (the same object when there are none)."""
    out = message[:MAX_MESSAGE_CHARS] + ("..." if len(message) > MAX_MESSAGE_CHARS else "")
    for pattern, replacement in _PATTERNS:
        out = pattern.sub(replacement, out)
    return message if out == message else out
