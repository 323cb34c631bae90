"""Bad input answers OpenAI-style 4xx and the router stays up; admin endpoints need the bearer token."""

from __future__ import annotations

import asyncio

import pytest

from tests.router.fakes import FakeNode
from tests.router.harness import admin_headers, chat, completion, router_harness

BAD_REQUESTS = [
    ("malformed-json", "/v1/completions", b'{"model": "fake-model", "prompt": ', 400, None),
    ("not-an-object", "/v1/completions", b'["fake-model"]', 400, None),
    ("unknown-model", "/v1/completions", {**completion(), "model": "nope"}, 404, "model"),
    ("model-not-a-string", "/v1/completions", {"model": 5, "prompt": "x"}, 400, "model"),
    ("missing-prompt", "/v1/completions", {"model": "fake-model"}, 400, "prompt"),
    ("prompt-wrong-type", "/v1/completions", completion(prompt={"a": 1}), 400, "prompt"),
    ("prompt-empty-list", "/v1/completions", completion(prompt=[]), 400, "prompt"),
    ("messages-missing", "/v1/chat/completions", {"model": "fake-model"}, 400, "messages"),
    ("messages-not-list", "/v1/chat/completions", {"model": "fake-model", "messages": "hi"}, 400, "messages"),
    ("message-no-role", "/v1/chat/completions", {"model": "fake-model", "messages": [{"content": "x"}]}, 400,
     "messages.0"),
    ("content-wrong-type", "/v1/chat/completions",
     {"model": "fake-model", "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("max-tokens-zero", "/v1/completions", completion(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-huge", "/v1/completions", completion(max_tokens=10**9), 400, "max_tokens"),
    ("max-tokens-string", "/v1/completions", completion(max_tokens="5"), 400, "max_tokens"),
    ("max-completion-tokens-bad", "/v1/chat/completions", chat(max_completion_tokens=-1), 400,
     "max_completion_tokens"),
    ("n-two", "/v1/chat/completions", chat(n=2), 400, "n"),
    ("stream-not-bool", "/v1/completions", completion(stream="yes"), 400, "stream"),
    ("stream-options-not-object", "/v1/completions", completion(stream=True, stream_options=[1]), 400,
     "stream_options"),
    ("temperature-string", "/v1/completions", completion(temperature="hot"), 400, "temperature"),
    ("oversized", "/v1/completions", completion(prompt="x" * 5000), 413, None),
]


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_is_an_openai_error(name, path, body, status, param):
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d], max_body_bytes=4096) as (client, _):
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            resp = await client.post(path, headers={"content-type": "application/json"}, **kwargs)
            assert resp.status_code == status, resp.text
            error = resp.json()["error"]
            assert error["code"] == status and error["message"] and error["type"]
            assert error["param"] == param
            ok = await client.post("/v1/completions", json=completion())
            assert ok.status_code == 200, "the router keeps serving after a bad request"

    asyncio.run(main())
    assert len(d.bodies) == 1, "a rejected request never reaches a node"


def test_oversized_body_without_content_length_is_refused():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d], max_body_bytes=1024) as (client, _):
            async def chunks():
                yield b'{"model": "fake-model", "prompt": "'
                yield b"y" * 4000
                yield b'"}'
            resp = await client.post("/v1/completions", content=chunks())
            assert resp.status_code == 413 and resp.json()["error"]["code"] == 413

    asyncio.run(main())


@pytest.mark.parametrize("headers,status", [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 403),
    ({"Authorization": "Basic dGVzdA=="}, 401),
    (admin_headers(), 200),
], ids=["missing", "wrong", "not-bearer", "right"])
def test_admin_endpoints_need_the_token(headers, status):
    async def main():
        async with router_harness([FakeNode("p0", "prefill"), FakeNode("d0", "decode")]) as (client, _):
            for method, path in (("GET", "/v1/pools"), ("POST", "/admin/instances/d0/drain"),
                                 ("GET", "/admin/sessions")):
                resp = await client.request(method, path, headers=headers)
                assert resp.status_code == status, (path, resp.text)
                if status != 200:
                    assert resp.json()["error"]["code"] == status

    asyncio.run(main())


def test_admin_disabled_without_configured_token():
    async def main():
        async with router_harness([FakeNode("d0", "decode")], admin_token=None) as (client, _):
            resp = await client.get("/v1/pools", headers={"Authorization": "Bearer"})
            assert resp.status_code == 403

    asyncio.run(main())
