"""Request parameters through the router (in-process router, fake nodes):

- `max_tokens=0` scores the prompt (`echo` or `prompt_logprobs`): accepted, and served colocated like every
  request that asks for prompt log-probs (a remote prefill hands over KV, not prompt log-probs); 0 otherwise
  is a 400 naming the field;
- log-probs, echo, penalties and the parameters the reference engine refuses (`tools`, `response_format`,
  `logit_bias`) pass through to the nodes untouched (vLLM pools honour them; the router checks no range of
  theirs); a node's 400 (a refused parameter, a penalty out of its range) reaches the client byte for byte, with
  its status;
- bounded input: a 5,000-digit `X-Expected-Context-Tokens` and a content-less user message are 400 JSON;
- error messages relayed from nodes (JSON bodies, error events inside a stream) reach the client without pod
  addresses, engine ids or lease ids.
"""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tests.router.fakes import FakeNode
from tests.router.harness import chat, completion, router_harness

LEAKY = ("KV transfer from 3f2a9c0d1e2b4a5f9c8d7e6f5a4b3c2d failed: READ from 10.42.7.19:5600 "
         "(http://prefill-0.pd.svc.cluster.local:8100/lease/9b1e) lease 9b1e3c2d4f5a6b7c8d9e0f1a2b3c4d5e expired")
SECRETS = ("10.42.7.19", "3f2a9c0d1e2b4a5f9c8d7e6f5a4b3c2d", "9b1e3c2d4f5a6b7c8d9e0f1a2b3c4d5e", "prefill-0.pd.svc",
           "5600")


def run(coro):
    return asyncio.run(coro)


class ScriptedNode(FakeNode):
    """A FakeNode whose completion routes answer `answer(body)` (status, bytes, content type) when it returns
    one; everything else (health, metrics, normal answers) is FakeNode's."""

    def __init__(self, name: str, role: str, answer, engine_label: str | None = None) -> None:
        super().__init__(name, role, engine_label=engine_label)
        self.answer = answer

    def app(self) -> FastAPI:
        outer = FastAPI()
        node = self

        async def generate(request: Request) -> Response:
            body = await request.json()
            node.bodies.append(body)
            status, content, media = node.answer(body)
            if media == "text/event-stream":
                async def events():
                    yield content
                return StreamingResponse(events(), status_code=status, media_type=media)
            return Response(content, status_code=status, media_type=media)

        outer.post("/v1/completions")(generate)
        outer.post("/v1/chat/completions")(generate)
        outer.mount("/", super().app())
        return outer


# ---------------------------------------------------------------- max_tokens=0 and prompt log-probs


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", completion(max_tokens=0, echo=True, logprobs=1)),
    ("/v1/completions", completion(max_tokens=0, prompt_logprobs=2)),
    ("/v1/completions", completion(max_tokens=5, echo=True, logprobs=0)),
    ("/v1/chat/completions", chat(max_completion_tokens=0, prompt_logprobs=1)),
    ("/v1/completions", completion(max_tokens=3, prompt_logprobs=0, stream=True)),
], ids=["zero-echo", "zero-prompt-logprobs", "echo-generates", "chat-zero-prompt-logprobs", "stream"])
def test_requests_scoring_the_prompt_are_served_colocated(path, body):
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d]) as (client, _):
            resp = await client.post(path, json=body)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pdcluster-prefill"] == "none"

    run(main())
    assert not p.bodies, "a request asking for prompt log-probs never takes the prefill leg"
    (sent,) = d.bodies
    assert "kv_transfer_params" not in sent
    assert sent == {**body}, "the body reaches the node untouched"


@pytest.mark.parametrize("body,param", [
    (completion(max_tokens=0), "max_tokens"),
    (completion(max_tokens=0, echo=False, logprobs=1), "max_tokens"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (completion(max_tokens=-1, echo=True), "max_tokens"),
], ids=["zero", "zero-echo-false", "chat-zero", "negative"])
def test_zero_max_tokens_without_prompt_scoring_is_refused(body, param):
    d = FakeNode("d0", "decode")

    async def main():
        async with router_harness([d]) as (client, _):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            resp = await client.post(path, json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text

    run(main())
    assert not d.bodies


def test_generating_requests_still_take_the_prefill_leg():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d]) as (client, _):
            resp = await client.post("/v1/completions", json=completion(logprobs=2))
            assert resp.headers["x-pdcluster-prefill"] == "p0"

    run(main())
    assert p.bodies[0]["logprobs"] == 2 and d.bodies[0]["logprobs"] == 2


# ---------------------------------------------------------------- pass-through and node refusals


PASSED = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
          "tool_choice": "auto", "response_format": {"type": "json_object"}, "presence_penalty": 0.5,
          "frequency_penalty": 0.25, "repetition_penalty": 1.1, "logit_bias": {"5": -100}, "logprobs": True,
          "top_logprobs": 3, "seed": 7, "top_k": 5}


def test_parameters_pass_through_to_vllm_pools_untouched():
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d]) as (client, _):
            resp = await client.post("/v1/chat/completions", json=chat(**PASSED))
            assert resp.status_code == 200, resp.text

    run(main())
    for leg in (p.bodies[0], d.bodies[0]):
        assert {k: leg[k] for k in PASSED} == PASSED


def _node_refusal(param: str, message: str) -> bytes:
    """What a reference node answers for a parameter it refuses (its own serialisation)."""
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                 "code": 400}}).encode()


REFUSALS = {"tools": (PASSED["tools"], "parameter 'tools' is not supported by this server"),
            "presence_penalty": (2.5, "presence_penalty must be in [-2, 2], got 2.5")}


@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("param", list(REFUSALS), ids=["unsupported", "out-of-range"])
def test_a_node_refusal_reaches_the_client_unchanged(leg, stream, param):
    value, message = REFUSALS[param]
    refusal = _node_refusal(param, message)

    def answer(body):
        return (400, refusal, "application/json") if param in body else (200, b"{}", "application/json")

    ref = "reference"
    nodes = [ScriptedNode(name, role, answer, ref) if leg == role else FakeNode(name, role, engine_label=ref)
             for name, role in (("p0", "prefill"), ("d0", "decode"))]

    async def main():
        async with router_harness(nodes, specs={n.name: {"engine": "reference"} for n in nodes}) as (client, _):
            resp = await client.post("/v1/completions", json=completion(stream=stream, **{param: value}))
            assert resp.status_code == 400
            assert resp.content == refusal
            assert (await client.get("/health")).status_code == 200

    run(main())
    assert nodes[0 if leg == "prefill" else 1].bodies, f"the {leg} leg was not taken"


# ---------------------------------------------------------------- bounded input


@pytest.mark.parametrize("value", ["9" * 5000, "12345678901234567890", "-5", "1e9", "²".encode("latin-1"), "abc"])
def test_expected_context_header_is_bounded(value):
    d = FakeNode("d0", "decode")

    async def main():
        async with router_harness([d]) as (client, _):
            resp = await client.post("/v1/completions", json=completion(),
                                     headers={"X-Expected-Context-Tokens": value})
            assert resp.status_code == 400, resp.text
            assert resp.headers["content-type"].startswith("application/json")
            assert resp.json()["error"]["code"] == 400
            ok = await client.post("/v1/completions", json=completion(), headers={"X-Expected-Context-Tokens": "64"})
            assert ok.status_code == 200

    run(main())


@pytest.mark.parametrize("message", [{"role": "user"}, {"role": "user", "content": None},
                                     {"role": "user", "content": []}, {"role": "system", "content": None}],
                         ids=["missing", "null", "no-parts", "system-null"])
def test_a_user_message_needs_content(message):
    d = FakeNode("d0", "decode")

    async def main():
        async with router_harness([d]) as (client, _):
            body = {"model": "fake-model", "messages": [message], "max_tokens": 2}
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages.0.content", resp.text

    run(main())
    assert not d.bodies


# ---------------------------------------------------------------- scrubbed upstream errors


def _assert_clean(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked: {text}"


@pytest.mark.parametrize("status", [400, 409, 500, 502])
def test_relayed_error_bodies_are_scrubbed(status):
    leaky = orjson.dumps({"error": {"message": LEAKY, "type": "x", "param": None, "code": status}})
    d = ScriptedNode("d0", "decode", lambda body: (status, leaky, "application/json"))

    async def main():
        async with router_harness([FakeNode("p0", "prefill"), d]) as (client, _):
            for stream in (False, True):
                resp = await client.post("/v1/completions", json=completion(stream=stream))
                assert resp.status_code >= 400 and resp.json()["error"]["message"], resp.text
                assert "KV transfer from" in resp.text, "the message keeps its meaning"
                _assert_clean(resp.text)

    run(main())


def test_relayed_non_json_error_becomes_openai_json():
    d = ScriptedNode("d0", "decode", lambda body: (500, f"Traceback: {LEAKY}".encode(), "text/plain"))

    async def main():
        async with router_harness([d]) as (client, _):
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 500 and resp.json()["error"]["code"] == 500
            _assert_clean(resp.text)
            assert "Traceback" not in resp.text

    run(main())


def test_error_event_inside_a_relayed_stream_is_scrubbed():
    event = orjson.dumps({"error": {"message": LEAKY, "type": "server_error", "param": None, "code": 502}})
    chunk = b'data: {"id":"d","choices":[{"index":0,"text":"t0 "}]}\n\ndata: ' + event + b"\n\ndata: [DONE]\n\n"
    d = ScriptedNode("d0", "decode", lambda body: (200, chunk, "text/event-stream"))

    async def main():
        async with router_harness([d]) as (client, _):
            resp = await client.post("/v1/completions", json=completion(stream=True))
            assert resp.status_code == 200 and '"t0 "' in resp.text and "data: [DONE]" in resp.text
            assert "KV transfer from" in resp.text
            _assert_clean(resp.text)

    run(main())


# ---------------------------------------------------------------- a request without `model`


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4}),
    ("/v1/chat/completions", {"model": None, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
], ids=["completions-absent", "chat-null"])
def test_a_request_without_model_is_served_by_the_clusters_one_model(path, body):
    p, d = FakeNode("p0", "prefill"), FakeNode("d0", "decode")

    async def main():
        async with router_harness([p, d]) as (client, _):
            resp = await client.post(path, json=body)
            assert resp.status_code == 200, resp.text

    run(main())
    assert d.bodies and all(sent["model"] == "fake-model" for sent in p.bodies + d.bodies)  # named to the nodes


def test_a_request_without_model_is_a_400_when_the_cluster_serves_several():
    nodes = [FakeNode("p0", "prefill"), FakeNode("d0", "decode"), FakeNode("d1", "decode", model="other-model")]

    async def main():
        async with router_harness(nodes) as (client, _):
            resp = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            error = resp.json()["error"]
            assert resp.status_code == 400 and error["param"] == "model", resp.text
            assert "fake-model" in error["message"] and "other-model" in error["message"]
            bad = await client.post("/v1/completions", json={"model": 7, "prompt": "Hello", "max_tokens": 4})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"

    run(main())
    assert not any(n.bodies for n in nodes)
