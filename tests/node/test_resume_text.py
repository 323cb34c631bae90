"""A resumed request's text layer continues the lost stream: the chunks a stream sent before it broke, followed
by the chunks of the request resumed with their token ids (`resume_token_ids`), give the uninterrupted stream's
text, token ids, log-prob offsets and usage, with no role chunk repeated; held-back bytes (half a UTF-8
character, a possible stop-string prefix) are sent by the resumed stream, not lost. No engine: the token events
are given (the engine's side is tests/engine/test_resume.py). A stream that fails (or moves out on drain) sends the
ids of the tokens whose text it still held back before its error, so the resume continues after every one."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.api import EngineFailure
from engine.model.tokenizer import ByteTokenizer
from engine.outputs import TokenEvent
from node.responses import stream_chunks
from node.textgen import GenerationResult, Limits, StreamMoved, generate_pieces, prepare
from node.tokenizer import ServerTokenizer
from serving.errors import APIError
from serving.protocol import ChatCompletionRequest, CompletionRequest

TOKENIZER = ServerTokenizer(ByteTokenizer(), 512, ByteTokenizer.eos_token_id)
LIMITS = Limits(max_context=512)
ANSWER = "héllo wörld, a stream that survives. END and more"


def _request(kind: str, **fields):
    base = {"max_tokens": 60, "stream": True, "return_token_ids": True, "logprobs": 2 if kind == "completion" else True,
            "stop": ["END"], "stream_options": {"include_usage": True}, **fields}
    if kind == "chat":
        return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **base})
    return CompletionRequest.model_validate({"prompt": "hi", **base})


def _events(ids: list[int], start: int) -> list[TokenEvent]:
    return [TokenEvent("r", tok, index=i, logprob=-0.5 - i / 64, top_logprobs=((tok, -0.5 - i / 64),))
            for i, tok in enumerate(ids, start=start)]


async def _aiter(items):
    for item in items:
        yield item


def _chunks(kind: str, events: list[TokenEvent], **fields) -> list[dict]:
    prepared = prepare(_request(kind, **fields), kind, "r", "m", TOKENIZER, LIMITS)
    result = GenerationResult()

    async def run() -> list[dict]:
        pieces = generate_pieces(_aiter(events), prepared, TOKENIZER, result)
        return [json.loads(c.model_dump_json()) async for c in stream_chunks(prepared, pieces, result, TOKENIZER)]
    return asyncio.run(run())


def _text(kind: str, chunk: dict) -> str:
    choice = chunk["choices"][0]
    return choice["delta"].get("content") or "" if kind == "chat" else choice["text"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("cut", [1, 2, 5, 9])
def test_resumed_chunks_continue_the_lost_stream(kind: str, cut: int) -> None:
    ids = list(ANSWER.encode())
    whole = _chunks(kind, _events(ids, 0))
    sent = [c for c in whole if c["choices"] and c["choices"][0].get("token_ids")][:cut]
    sent_ids = [t for c in sent for t in c["choices"][0]["token_ids"]]
    rest = _chunks(kind, _events(ids[len(sent_ids):], len(sent_ids)), resume_token_ids=sent_ids)
    assert not any(c["choices"] and (c["choices"][0].get("delta") or {}).get("role") for c in rest)
    lost = [c for c in whole if c["choices"] and c["choices"][0].get("token_ids")][cut:]
    tail = [c for c in rest if c["choices"]]
    assert [_text(kind, c) for c in tail] == [_text(kind, c) for c in lost]
    assert [c["choices"][0]["token_ids"] for c in tail] == [c["choices"][0]["token_ids"] for c in lost]
    assert [c["choices"][0]["logprobs"] for c in tail] == [c["choices"][0]["logprobs"] for c in lost]
    assert [c["choices"][0]["finish_reason"] for c in tail] == [c["choices"][0]["finish_reason"] for c in lost]
    assert rest[-1]["usage"] == whole[-1]["usage"]  # counted once: the resumed tokens are completion tokens


def test_resume_token_ids_are_checked() -> None:
    def refused(**fields) -> str:
        with pytest.raises(APIError) as info:
            prepare(_request("completion", **fields), "completion", "r", "m", TOKENIZER, LIMITS)
        return info.value.param
    assert refused(resume_token_ids=[70] * 60) == "resume_token_ids"  # leaves nothing to generate
    assert refused(resume_token_ids=[600]) == "resume_token_ids"
    assert refused(resume_token_ids=[70], echo=True) == "resume_token_ids"
    prepared = prepare(_request("completion", resume_token_ids=[70, 71]), "completion", "r", "m", TOKENIZER, LIMITS)
    assert prepared.sampling.num_resumed == 2 and prepared.sampling.max_tokens == 58
    assert prepared.prompt_token_ids[-2:] == (70, 71)


def _chunks_until_error(kind: str, events: list) -> tuple[list[dict], APIError]:
    prepared = prepare(_request(kind), kind, "r", "m", TOKENIZER, LIMITS)
    result = GenerationResult()
    chunks: list[dict] = []

    async def run() -> APIError:
        pieces = generate_pieces(_aiter(events), prepared, TOKENIZER, result)
        try:
            async for chunk in stream_chunks(prepared, pieces, result, TOKENIZER):
                chunks.append(json.loads(chunk.model_dump_json()))
        except APIError as exc:
            return exc
        raise AssertionError("the stream did not fail")
    return chunks, asyncio.run(run())


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("moved", [False, True])
def test_a_failing_stream_sends_its_held_back_token_ids_first(kind: str, moved: bool) -> None:
    ids = list(ANSWER.encode())
    num_sent = 2  # "h" and the first byte of "é": half a character, held back
    params = {"lease_id": "lease-x", "transfer_mode": "move"} if moved else None
    failure = EngineFailure("r", "the node is draining", 503, kv_transfer_params=params)
    sent, error = _chunks_until_error(kind, _events(ids[:num_sent], 0) + [failure])
    assert [t for c in sent if c["choices"] for t in c["choices"][0].get("token_ids") or ()] == ids[:num_sent]
    assert isinstance(error, StreamMoved) == moved and error.status == 503
    if moved:
        assert error.kv_transfer_params == params
    rest = _chunks(kind, _events(ids[num_sent:], num_sent), resume_token_ids=ids[:num_sent])
    whole = _chunks(kind, _events(ids, 0))
    text = "".join(_text(kind, c) for c in sent + rest if c["choices"])
    assert text == "".join(_text(kind, c) for c in whole if c["choices"])


def test_a_resumed_answer_reports_no_more_cached_tokens_than_its_prompt() -> None:
    """A resuming node's cache may hold some of the resumed tokens too: the client's cached_tokens count only its
    prompt (router/session_routing.py says which placement's figure the client sees)."""
    from engine.api import SamplingParams
    from node.responses import usage_of
    from node.textgen import PreparedRequest

    prepared = PreparedRequest(request_id="r", kind="completion", model="m", prompt_token_ids=tuple(range(10)),
                               sampling=SamplingParams(max_tokens=4, num_resumed=3), stop_strings=(), stream=True,
                               include_usage=True, echo=False, prompt_logprobs=False, kv_params=None)
    usage = usage_of(prepared, GenerationResult(num_cached_tokens=9))
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 3)
    assert usage.prompt_tokens_details.cached_tokens == 7
