"""The relay's side parser (router/relay.py `StreamAccounting`) against a plain per-event reading of the same
bytes: whatever the chunking, it finds the same token events, usage, error and [DONE], and the gaps between
token events it reports are those of a per-event timeline (events of one chunk arrive together)."""

from __future__ import annotations

import json
import random

import pytest

from router.local_metrics import HistogramChild
from router.relay import StreamAccounting


def _event(payload, compact: bool = False) -> bytes:
    """One SSE event; `compact` as engines write it (no spaces: what the relay's byte-level fast path reads)."""
    text = json.dumps(payload, separators=(",", ":")) if compact else json.dumps(payload)
    return b"data: " + text.encode() + b"\n\n"


TRICKY_TEXTS = ['"quoted"', '"usage"', '{"error": 1}', '\\"text\\":\\"', 'a"b', '"', "\\", "é ☃"]


def tricky(rng: random.Random, i: int) -> bytes:
    """Compact events whose values hold the byte patterns the fast path looks for, or that it must leave to the
    JSON reading (usage with text, role-only, empty content)."""
    text = rng.choice(TRICKY_TEXTS)
    return rng.choice([
        _event({"id": "x", "choices": [{"index": 0, "text": text}]}, True),
        _event({"id": "x", "choices": [{"index": 0, "delta": {"content": text}}]}, True),
        _event({"id": "x", "choices": [{"index": 0, "text": f"t{i}"}], "usage": {"prompt_tokens": 3,
                                                                                 "completion_tokens": i}}, True),
        _event({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, True),
        _event({"id": "x", "choices": [{"index": 0, "delta": {"reasoning_content": text}}]}, True),
        _event({"id": "x", "choices": [{"index": 0, "text": "", "logprobs": {"text_offset": [0]}}]}, True),
        _event({"id": "x", "choices": [{"index": 0, "text": text}], "error": {"message": f"late {i}"}}, True),
        b'data: {"choices":[{"text":"a"}]}\ndata: {"choices":[{"text":"b"}]}\n\n',  # two tokens in one event
        b': a comment {"choices":[{"text":"a"}]}\n\n',  # not data
    ])


def stream(rng: random.Random) -> bytes:
    events = [_event({"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})]
    for i in range(rng.randint(1, 40)):
        if rng.random() < 0.4:  # compact: the form engines stream
            events.append(_event({"id": "x", "choices": [{"index": 0, "text": f"t{i} "}]}, True)
                          if rng.random() < 0.6 else tricky(rng, i))
            continue
        kind = rng.random()
        if kind < 0.6:
            events.append(_event({"id": "x", "choices": [{"index": 0, "text": f"t{i} "}]}))
        elif kind < 0.7:
            events.append(_event({"id": "x", "choices": [{"index": 0, "delta": {"content": f"c{i}"}}]}))
        elif kind < 0.75:
            events.append(_event({"id": "x", "choices": [{"index": 0, "delta": {"reasoning_content": "r"}}]}))
        elif kind < 0.8:
            events.append(_event({"id": "x", "choices": [{"index": 0, "delta": {"tool_calls": [{"id": "c"}]}}]}))
        elif kind < 0.85:
            events.append(_event({"id": "x", "choices": [{"index": 0, "text": ""}]}))  # no output
        elif kind < 0.9:
            events.append(b": keep-alive comment\n\n")
        elif kind < 0.93:  # two data lines in one event, each with output
            events.append(b'data: {"choices": [{"text": "a"}]}\ndata: {"choices": [{"text": "b"}]}\n\n')
        elif kind < 0.95:  # two data lines in one event, one with output
            events.append(b'data: {"choices": [{"text": "a"}]}\ndata: {"choices": [{"text": ""}]}\n\n')
        else:
            events.append(b"data: not json\n\n")
    if rng.random() < 0.3:
        events.append(_event({"error": {"message": "boom", "type": "x"}}, rng.random() < 0.5))
    if rng.random() < 0.7:  # else the last usage, if any, is one that came with a token (continuous usage)
        events.append(_event({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}}))
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)


def per_event(chunks: list[bytes], times: list[float]) -> dict:
    """The plain reading: each complete event at the time of the chunk that completed it."""
    token_times, usage, error, done = [], None, None, False
    buffer = b""
    for chunk, now in zip(chunks, times):
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                body = line[5:].strip()
                if body == b"[DONE]":
                    done = True
                    continue
                try:
                    payload = json.loads(body)
                except ValueError:
                    continue
                if "error" in payload:
                    error = payload["error"]["message"]
                if "usage" in payload:
                    usage = payload["usage"]
                for choice in payload.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if choice.get("text") or delta.get("content") or delta.get("reasoning_content") \
                            or delta.get("tool_calls"):
                        token_times.append(now)
                        break
    return {"token_times": token_times, "usage": usage, "error": error, "done": done}


@pytest.mark.parametrize("seed", range(40))
def test_accounting_matches_a_per_event_reading(seed: int) -> None:
    rng = random.Random(seed)
    data = stream(rng)
    cuts = sorted({rng.randint(1, len(data)) for _ in range(rng.randint(1, 12))} | {len(data)})
    times = [10.0 + i * 0.25 + rng.random() * 0.1 for i in range(len(cuts))]
    chunks = [data[a:b] for a, b in zip([0, *cuts], cuts)]
    want = per_event(chunks, times)
    acct = StreamAccounting(started=9.0)
    for chunk, now in zip(chunks, times):
        acct.feed(chunk, now)
    assert acct.num_token_events == len(want["token_times"])
    assert acct.usage == want["usage"] and acct.error == want["error"] and acct.is_done == want["done"]
    expected_gaps = [b - a for a, b in zip(want["token_times"], want["token_times"][1:])]
    assert acct.itls() == pytest.approx(expected_gaps, abs=0)
    assert acct.ttft_s == (want["token_times"][0] - 9.0 if want["token_times"] else None)
    # The histogram fed through observe_many holds what one observe per gap would.
    one, many = HistogramChild((0.001, 0.1, float("inf"))), HistogramChild((0.001, 0.1, float("inf")))
    for gap in expected_gaps:
        one.observe(gap)
    for gap, num in acct.itl_counts():
        many.observe_many(gap, num)
    assert one.counts == many.counts and one.sum == pytest.approx(many.sum)
