"""An open P-D link breaker steers placement while both ends stay usable, on real processes (router/breaker.py,
router/state.py `usable_pairs`, router/placement.py).

Own topology (not the shared `cluster`): the link must fail while both of its ends stay healthy, so one decode
node is configured to fail its hand-offs: `near` (TP=1, the pool short requests fit) bounds a KV import at
1 microsecond (`kv.timeout_s`), so its claim at the prefill node times out (or, when a preempted client finds the
answer already there, its READs are past their deadline and never posted: kv_transfer/reads.py), and answers 502
instead of prefilling itself (`kv_load_failure_policy: fail`). A request with a P leg placed there fails on that link (and
the router moves it to `far`, router/migration.py); a colocated request there succeeds. `far` (TP=1, no
capacity bound: long requests) imports normally. The router opens the (prefill, near) link after
`breaker_failure_threshold` (2) failures on it, and then:
- short requests still go to `near`, colocated (x-pdcluster-prefill `none`), and equal the oracle;
- long requests still pair the prefill node with `far`, and equal the oracle;
- neither instance's own breaker opened (`pdcluster_pair_healthy` shows the one open link).
"""

from __future__ import annotations

import sys

import httpx
import pytest

from tests.oracle import generate_text

pytestmark = [pytest.mark.e2e, pytest.mark.process, pytest.mark.timeout(900)]

MODEL = "kimi-k3.1-mini"
NEAR_CAPACITY = 1024
CONFIG = {
    "model": MODEL,
    "engine": "reference",
    "router": {"port": None, "settings": {
        "health_interval_s": 0.5, "unhealthy_threshold": 2, "healthy_threshold": 1, "disagg_min_uncached_tokens": 1,
        "breaker_failure_threshold": 2, "breaker_recovery_s": 3600.0, "chars_per_token": 1.0,
        "session_growth_tokens": 0,  # one-off requests: the prompt and max_tokens alone pick the pool
        # two shared cores: generous leg bounds, still finite
        "prefill_timeout_s": 180.0, "first_token_timeout_s": 180.0, "stream_idle_timeout_s": 120.0}},
    "startup_timeout_s": 300,
    "pools": [{"name": "prefill", "role": "prefill", "tp": 1},
              {"name": "near", "role": "decode", "tp": 1, "max_context_tokens": NEAR_CAPACITY,
               # no peer list: the params' address is used as is (a list would be scanned with that
               # bound too, and a prefill engine it cannot find is refused with 403, not a link failure)
               "settings": {"prefill_peers": [], "kv": {"timeout_s": 1e-6}, "kv_load_failure_policy": "fail"}},
              {"name": "far", "role": "decode", "tp": 1}],
}
MAX_TOKENS = 12
SHORT = "A link breaker steers placement: "
LONG = "Both instances stay usable while one link is open. " * 30  # past `near`'s capacity


@pytest.fixture(scope="module")
def link_cluster(tmp_path_factory: pytest.TempPathFactory):
    from cluster.config import parse_config
    from cluster.launcher import Cluster
    from tests.e2e.harness import ClusterHandle

    config = parse_config(CONFIG, "tests/e2e/test_link_breaker_cluster.py")
    handle = ClusterHandle(Cluster(config, tmp_path_factory.mktemp("link-logs"), python=sys.executable).start())
    try:
        yield handle
    finally:
        handle.stop()


def _complete(cluster, prompt: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
            **extra}
    resp = httpx.post(f"{cluster.router_url}/v1/completions", json=body, timeout=600.0)
    assert resp.status_code == 200, resp.text
    return resp


def _oracle_ids(prompt: str) -> list[int]:
    return generate_text(prompt, MAX_TOKENS, model=MODEL)["token_ids"]


def _pairs(cluster) -> dict[tuple[str, str], float]:
    return {(s.labels["prefill"], s.labels["decode"]): s.value for s in cluster.metrics().samples
            if s.name == "pdcluster_pair_healthy"}


def test_an_open_link_steers_placement_and_both_ends_keep_serving(link_cluster) -> None:
    cluster = link_cluster
    prefill = cluster.nodes_of("prefill")[0].name
    near, far = cluster.nodes_of(pool="near")[0].name, cluster.nodes_of(pool="far")[0].name
    assert _pairs(cluster)[(prefill, near)] == 1.0

    for turn in range(2):  # each: a P leg to `near` fails on the link and the request moves; then a colocated
        # request on `near` succeeds (a prompt-scoring request is always colocated), so `near`'s own breaker
        # never sees two failures in a row
        prompt = f"{SHORT}turn {turn}"
        resp = _complete(cluster, prompt)
        assert resp.headers["x-pdcluster-prefill"] == prefill and resp.headers["x-pdcluster-decode"] == far
        assert resp.json()["choices"][0]["token_ids"] == _oracle_ids(prompt)
        scored = _complete(cluster, f"{SHORT}scored {turn}", echo=True, logprobs=0)
        assert scored.headers["x-pdcluster-decode"] == near and scored.headers["x-pdcluster-prefill"] == "none"

    cluster.wait_until(lambda: _pairs(cluster)[(prefill, near)] == 0.0, 30, "the (prefill, near) link to open")
    assert _pairs(cluster)[(prefill, far)] == 1.0

    resp = _complete(cluster, SHORT)  # `near` still takes what fits it, now without a P leg
    assert resp.headers["x-pdcluster-decode"] == near and resp.headers["x-pdcluster-prefill"] == "none"
    assert resp.json()["choices"][0]["token_ids"] == _oracle_ids(SHORT)
    resp = _complete(cluster, LONG)  # the prefill node still serves `far`
    assert resp.headers["x-pdcluster-decode"] == far and resp.headers["x-pdcluster-prefill"] == prefill
    assert resp.json()["choices"][0]["token_ids"] == _oracle_ids(LONG)
    metrics = cluster.metrics()
    assert metrics.get("pdcluster_migrations_total", reason="error_status") == 2.0
    assert _pairs(cluster)[(prefill, near)] == 0.0  # still open: nothing tried that link since
