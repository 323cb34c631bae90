"""Preemption through the HTTP node: a decode node whose row pool holds four long prompts but not their answers
preempts (engine/scheduler.py `preempt`) while serving completions and chats, streamed and not, at once; every
answer still equals the oracle's (tests/oracle.py, the request alone): text, token ids, log-probs, finish reason
and usage.

The pool (13 rows, kimi-k3.1-mini at TP1: 1024-token attention rows, 2 KDA rows a request): each request's prompt
of PROMPT_TOKENS plus the look-ahead fits one attention row, so all four are admitted (12 rows); each answer of
MAX_TOKENS crosses into a second attention row, and only one is free, so the later ones are preempted and
recomputed. The node's `vllm:num_preemptions_total` says it happened.

Its own node process (not a shared topology): the test needs a pool this small, which no shared cluster has.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.node.nodes import start_node, stop_node, wait_healthy
from tests.oracle import generate
from tests.soak.oracle import prompt_ids_of

pytestmark = [pytest.mark.process, pytest.mark.timeout(900)]

MODEL = "kimi-k3.1-mini"
PROMPT_TOKENS = 1000
MAX_TOKENS = 40
NUM_ROWS = 13
WORDS = ("agent", "tool", "result", "plan", "file", "patch", "test", "error", "retry", "context", "shard", "rank")


def _text(rng: random.Random, num_chars: int) -> str:
    words: list[str] = []
    while len(" ".join(words)) < num_chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:num_chars]


def _chat_of_length(rng: random.Random, num_tokens: int) -> list[dict]:
    """A conversation whose chat-template prompt has exactly `num_tokens` ids (byte tokenizer: one id a byte)."""
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": ""}]
    overhead = len(prompt_ids_of(messages))
    messages[1]["content"] = _text(rng, num_tokens - overhead)
    assert len(prompt_ids_of(messages)) == num_tokens
    return messages


def _requests() -> list[tuple[str, str, dict, list[int]]]:
    """(name, path, body, prompt ids) of the four requests."""
    rng = random.Random(7)
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    out = []
    for stream in (False, True):
        extra = {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True} if stream else {}
        prompt = _text(rng, PROMPT_TOKENS - 1)  # + BOS
        out.append((f"completion-{'stream' if stream else 'json'}", "/v1/completions",
                    {**common, **extra, "prompt": prompt, "logprobs": 0}, prompt_ids_of(prompt)))
        messages = _chat_of_length(rng, PROMPT_TOKENS)
        out.append((f"chat-{'stream' if stream else 'json'}", "/v1/chat/completions",
                    {**common, **extra, "messages": messages, "logprobs": True}, prompt_ids_of(messages)))
    for _, _, _, ids in out:
        assert len(ids) == PROMPT_TOKENS
    return out


def _logprobs_of(choice: dict) -> list[float]:
    logprobs = choice.get("logprobs") or {}
    if "token_logprobs" in logprobs:
        return list(logprobs["token_logprobs"])
    return [entry["logprob"] for entry in logprobs.get("content") or []]


def _text_of(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


async def _ask(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """The answer as {text, token_ids, logprobs, finish_reason, usage}, streamed or not."""
    if not body.get("stream"):
        resp = await client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        answer = resp.json()
        choice = answer["choices"][0]
        return {"text": _text_of(choice), "token_ids": choice.get("token_ids"), "logprobs": _logprobs_of(choice),
                "finish_reason": choice["finish_reason"], "usage": answer["usage"]}
    got: dict = {"text": "", "token_ids": [], "logprobs": [], "finish_reason": None, "usage": None}
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                got["text"] += _text_of(choice)
                got["token_ids"] += choice.get("token_ids") or []
                got["logprobs"] += _logprobs_of(choice)
                got["finish_reason"] = choice.get("finish_reason") or got["finish_reason"]
            got["usage"] = event.get("usage") or got["usage"]
        assert done, "the stream ended without [DONE]"
    return got


def _preemptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_preemptions_total{"))


def test_preempted_answers_through_the_node_equal_the_oracle() -> None:
    requests = _requests()
    node = start_node("decode", ["--model", MODEL, "--tp", "1", "--num-rows", str(NUM_ROWS), "--no-prefix-cache"],
                      env={"DECODE_TRANSPORT": "false"})
    try:
        wait_healthy(node)
        assert _preemptions(node.url) == 0

        async def all_at_once() -> list[dict]:
            async with httpx.AsyncClient(base_url=node.url, timeout=600) as client:
                return await asyncio.gather(*(_ask(client, path, body) for _, path, body, _ in requests))

        answers = asyncio.run(all_at_once())
        assert _preemptions(node.url) >= 1, "the pool was meant to run short: nothing was preempted"
    finally:
        stop_node(node)
    for (name, _, _, prompt_ids), got in zip(requests, answers):
        want = generate(prompt_ids, MAX_TOKENS, model=MODEL, ignore_eos=True, temperature=0, logprobs=0)
        assert got["token_ids"] in (None, want["token_ids"]), name
        assert got["text"] == want["text"], name
        assert got["logprobs"] == want["logprobs"], name
        assert got["finish_reason"] == "length", name
        usage = got["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (PROMPT_TOKENS, MAX_TOKENS), (name, usage)
        assert usage["total_tokens"] == PROMPT_TOKENS + MAX_TOKENS, (name, usage)
