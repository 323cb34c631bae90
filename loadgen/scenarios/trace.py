"""Mooncake JSONL trace replay.

Each line: {"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int, ...]} with one
hash id per `block_tokens`-token block of the prompt (512 in the Mooncake release). Requests that share a
hash id share that block's text, so the trace's prefix reuse reaches the server as real shared prefixes;
prompt tokens past the listed blocks get text unique to the request. An optional "session_id" string
becomes `X-Session-ID`. `scale` shrinks lengths and the block size together (keeps the sharing pattern on
small test clusters); `speed` compresses time. Bad lines are skipped and reported by line number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loadgen.schedule import Message, RequestSpec, Session
from loadgen.text import block_text, seeded_words


@dataclass(frozen=True)
class TraceEntry:
    """One valid trace line, already scaled; `arrival_s` is from the first line's timestamp."""

    line_no: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None


@dataclass(frozen=True)
class TraceLineError:
    """A skipped line and why."""

    line_no: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line_no}: {self.message}"


def _int_field(obj: dict, key: str, minimum: int) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value!r}")
    return int(value)


def parse_line(line: str, line_no: int) -> tuple[float, int, int, tuple[int, ...], str | None]:
    """(timestamp_ms, input_length, output_length, hash_ids, session_id); ValueError says what is wrong."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise ValueError(f"timestamp must be a number of ms >= 0, got {ts!r}")
    hash_ids = obj.get("hash_ids", [])
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
        raise ValueError(f"hash_ids must be a list of integers, got {hash_ids!r}")
    sid = obj.get("session_id")
    return (float(ts), _int_field(obj, "input_length", 1), _int_field(obj, "output_length", 1),
            tuple(hash_ids), str(sid) if sid is not None else None)


def read_trace(path: Path, scale: float = 1.0) -> tuple[list[TraceEntry], list[TraceLineError]]:
    """Valid entries sorted by time, and the bad lines. OSError if the file cannot be read."""
    rows, errors = [], []
    with open(path, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append((line_no, *parse_line(line, line_no)))
            except ValueError as exc:
                errors.append(TraceLineError(line_no, str(exc)))
    rows.sort(key=lambda r: (r[1], r[0]))
    t0 = rows[0][1] if rows else 0.0
    entries = [
        TraceEntry(n, (ts - t0) / 1000.0, max(1, round(inp * scale)), max(1, round(out * scale)), hids, sid)
        for n, ts, inp, out, hids, sid in rows
    ]
    return entries, errors


class TraceWorkload:
    """Open-loop replay: unit k is entry k sent at its `arrival_s / speed`."""

    name = "trace"
    is_open_loop = True

    def __init__(self, entries: list[TraceEntry], source: str, block_tokens: int = 512, scale: float = 1.0,
                 speed: float = 1.0) -> None:
        if block_tokens < 1 or scale <= 0 or speed <= 0:
            raise ValueError(f"trace needs block_tokens >= 1, scale > 0, speed > 0; got {block_tokens}, {scale}, {speed}")
        self.entries = entries
        self.source = source
        self.block_tokens = max(1, round(block_tokens * scale))
        self.scale = scale
        self.speed = speed
        self._blocks: dict[int, str] = {}

    def describe(self) -> dict[str, str]:
        return {"source": self.source, "block_tokens": str(self.block_tokens), "scale": str(self.scale),
                "speed": str(self.speed), "num_entries": str(len(self.entries))}

    def _block(self, hash_id: int) -> str:
        if hash_id not in self._blocks:
            self._blocks[hash_id] = block_text(hash_id, self.block_tokens)
        return self._blocks[hash_id]

    def prompt(self, entry: TraceEntry) -> str:
        num_blocks = min(len(entry.hash_ids), -(-entry.input_length // self.block_tokens))
        parts = [self._block(h) for h in entry.hash_ids[:num_blocks]]
        text_words = " ".join(parts).split()[: entry.input_length]
        missing = entry.input_length - len(text_words)
        if missing > 0:
            text_words += seeded_words(f"tail:{self.source}:{entry.line_no}", missing).split()
        return " ".join(text_words)

    def session(self, index: int) -> Session | None:
        if index >= len(self.entries):
            return None
        entry = self.entries[index]
        rid = f"trace-{entry.line_no}"
        msg = Message("user", self.prompt(entry), entry.input_length)
        spec = RequestSpec(rid, (msg,), entry.output_length, entry.session_id, 0.0, entry.arrival_s / self.speed)
        return Session(entry.session_id or rid, (spec,))
