"""Streams that survive their decode instance (router/migration.py), on real processes: a decode node killed
(SIGKILL) or one of its rank processes killed mid-stream, greedy and seeded-sampled; the client's stream
completes with the uninterrupted oracle's tokens and log-probs (one id, no duplicate or missing token, usage
counted once), and every surviving node returns to its idle row counts.

Own topology (not the shared `cluster`): these tests kill, drain and restart decode nodes, and resuming needs a second
decode instance of the same pool: one prefill instance (TP=1) and two decode instances (TP=1, NUM_ROWS rows a rank)
behind a router, on the reference engine, so every pairing gives the oracle's bits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import httpx
import pytest

from tests.oracle import generate_text

pytestmark = [pytest.mark.e2e, pytest.mark.process, pytest.mark.timeout(1500)]

MODEL = "kimi-k3.1-mini"
ADMIN_TOKEN = "resume-admin-token"
NUM_ROWS = 24
"""Packed rows per decode rank: one stream of PROMPT takes 3 (an attention row and two KDA group rows, kimi-k3.1-mini
at TP=1), so 8 streams run on an instance and the next imports wait in its import queue."""
CONFIG = {
    "model": MODEL,
    "engine": "reference",
    "router": {"port": None, "admin_token": ADMIN_TOKEN, "settings": {
        "health_interval_s": 0.5, "unhealthy_threshold": 2, "healthy_threshold": 1, "disagg_min_uncached_tokens": 1,
        # two shared cores: generous leg bounds, still finite
        "prefill_timeout_s": 180.0, "first_token_timeout_s": 180.0, "stream_idle_timeout_s": 120.0,
        "breaker_recovery_s": 2.0}},
    "startup_timeout_s": 300,
    "pools": [{"name": "prefill", "role": "prefill", "tp": 1,
               "settings": {"lease_seconds": 300.0}},  # an import queued for rows keeps its lease up to the expiry
              # a SIGTERM hands the running streams off at once (the router moves them); NUM_ROWS rows a rank, and
              # imports wait that long for rows (the drain test queues two)
              {"name": "tp", "role": "decode", "tp": 1, "count": 2,
               "settings": {"drain_hand_off_s": 0, "num_rows": NUM_ROWS, "import_queue_wait_s": 300.0}}],
}
PROMPT = "Streams that survive: the router resumes a request on another decode instance, bit for bit. " * 3
MAX_TOKENS = 48
KILL_AFTER_TOKENS = 6
DRAIN_TOKENS = 128
"""Long enough that the first streams still run when the last one streams its first token (their P legs run one
after another), so that all 8 run when the SIGTERM lands; the test checks that they do. Measured at load ~8: the
streams had sent 36-62 tokens each at the SIGTERM, so 128 leaves the first one twice what it used."""
HEALTH_BOUND_S = 60
CASES = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 1234}}


@pytest.fixture(scope="module")
def resume_cluster(tmp_path_factory: pytest.TempPathFactory):
    from cluster.config import parse_config
    from cluster.launcher import Cluster
    from tests.e2e.harness import ClusterHandle

    config = parse_config(CONFIG, "tests/e2e/test_resume_cluster.py")
    handle = ClusterHandle(Cluster(config, tmp_path_factory.mktemp("resume-logs"), python=sys.executable).start())
    try:
        yield handle
    finally:
        handle.stop()


def _stream(cluster, body: dict, on_tokens, arrivals: list[float] | None = None) -> tuple[list[dict], dict[str, str]]:
    """POST a streamed completion; `on_tokens(n, headers)` after each token chunk (whose arrival times go to
    `arrivals`). Returns (chunks, headers)."""
    chunks, num_tokens = [], 0
    with httpx.stream("POST", f"{cluster.router_url}/v1/completions", json=body, timeout=600.0) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            chunks.append(chunk)
            if chunk.get("choices") and chunk["choices"][0].get("token_ids"):
                num_tokens += len(chunk["choices"][0]["token_ids"])
                if arrivals is not None:
                    arrivals.append(time.monotonic())
                on_tokens(num_tokens, resp.headers)
        return chunks, dict(resp.headers)


def _killer(cluster, kill) -> tuple[callable, list[str]]:
    """on_tokens that kills the serving decode instance once KILL_AFTER_TOKENS tokens arrived."""
    killed: list[str] = []

    def on_tokens(num_tokens: int, headers) -> None:
        if num_tokens >= KILL_AFTER_TOKENS and not killed:
            killed.append(headers["x-pdcluster-decode"])
            kill(killed[0])
    return on_tokens, killed


def _check_against_oracle(chunks: list[dict], case: str, max_tokens: int = MAX_TOKENS, **sampling) -> None:
    oracle = generate_text(PROMPT, max_tokens, model=MODEL, logprobs=0, ignore_eos=True,
                           **{**CASES[case], **sampling})
    assert not [c for c in chunks if "error" in c], chunks
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    token_ids = [t for choice in choices for t in choice.get("token_ids") or ()]
    assert token_ids == oracle["token_ids"]  # no duplicate, no missing token, the uninterrupted stream's
    logprobs = [lp for choice in choices if choice.get("logprobs") for lp in choice["logprobs"]["token_logprobs"]]
    assert logprobs == oracle["logprobs"]
    assert "".join(choice["text"] for choice in choices) == oracle["text"]
    offsets = [o for choice in choices if choice.get("logprobs") for o in choice["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and len(offsets) == len(token_ids)
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens  # counted once, over both instances


def _body(case: str) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "logprobs": 0,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True},
            **CASES[case]}


_left_down: list[str] = []
"""Nodes a test killed or drained: the next test restarts them before it starts (`_ready`), so the module's last
victim is not restarted only to be stopped with the cluster."""


def _ready(cluster) -> None:
    """Restart what the test before left down, then wait until the router sees every node healthy."""
    while _left_down:
        cluster.restart(_left_down.pop())
    _wait_healthy(cluster)


def _wait_healthy(cluster) -> None:
    for node in cluster.nodes:
        cluster.wait_until(lambda node=node: cluster.router_sees_healthy(node.name) is True, HEALTH_BOUND_S,
                           f"the router to see {node.name} healthy")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fault", ["node_sigkill", "rank_sigkill"])
def test_a_stream_survives_its_decode_instance(resume_cluster, case: str, fault: str) -> None:
    cluster = resume_cluster
    _ready(cluster)
    idle = cluster.idle_snapshot()
    before = cluster.metrics("router")
    moved_before = before.get("pdcluster_migrations_total") or 0.0
    kv_legs_before = before.get("pdcluster_leg_duration_seconds_count", leg="kv_transfer") or 0.0
    kill = cluster.kill if fault == "node_sigkill" else cluster.kill_rank
    on_tokens, killed = _killer(cluster, kill)
    chunks, headers = _stream(cluster, _body(case), on_tokens)
    assert killed, "the stream ended before the kill"
    _check_against_oracle(chunks, case)
    after = cluster.metrics("router")
    assert after.value("pdcluster_migrations_total") == moved_before + 1
    assert after.value("pdcluster_resume_latency_seconds_count") >= 1
    # both legs imported KV from the prefill node: the decode nodes' X-KV-Transfer-Seconds feed the leg
    assert after.value("pdcluster_leg_duration_seconds_count", leg="kv_transfer") >= kv_legs_before + 1
    survivors = {name: load for name, load in idle.items() if name != killed[0]}
    cluster.wait_until(lambda: {n: cluster.node_load(n) for n in survivors} == survivors, 120,
                       f"surviving nodes back to their idle counts {survivors}")
    _left_down.append(killed[0])


def test_a_rows_count_and_oracle_hold_for_concurrent_streams_when_one_instance_dies(resume_cluster) -> None:
    """Three streams at once (both instances busy), one instance killed: every stream still ends as the
    oracle's, and no node keeps rows."""
    cluster = resume_cluster
    _ready(cluster)
    idle = cluster.idle_snapshot()
    results: dict[int, list[dict]] = {}
    victim = cluster.nodes_of(role="decode")[0].name
    seen = threading.Event()

    def run(index: int) -> None:
        def on_tokens(num_tokens: int, headers) -> None:
            if headers["x-pdcluster-decode"] == victim and num_tokens >= KILL_AFTER_TOKENS and not seen.is_set():
                seen.set()
                cluster.kill(victim)
        results[index] = _stream(cluster, _body("seeded"), on_tokens)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    assert seen.is_set(), "no stream ran on the victim"
    for index in range(3):
        _check_against_oracle(results[index], "seeded")
    survivors = {name: load for name, load in idle.items() if name != victim}
    cluster.wait_until(lambda: {n: cluster.node_load(n) for n in survivors} == survivors, 120,
                       "surviving nodes back to their idle counts")
    _left_down.append(victim)


def _prefill_legs(cluster) -> float:
    return cluster.metrics("router").get("pdcluster_leg_duration_seconds_count", leg="prefill") or 0.0


@pytest.mark.parametrize("case", list(CASES))
def test_a_prefill_node_killed_mid_prefill_costs_the_client_nothing(resume_cluster, case: str) -> None:
    """The only prefill instance dies while it prefills: the decode instance computes the prefill itself
    (`prefill_fallback: decode_only`) and the stream is the oracle's."""
    cluster = resume_cluster
    _ready(cluster)
    prefill = cluster.nodes_of(role="prefill")[0].name
    prompt = ("job: the prefill rank computes the whole prompt before the decode instance reads it. " * 80)[:5000]
    legs = _prefill_legs(cluster)
    body = {**_body(case), "prompt": prompt, "max_tokens": 8}
    legs_at_kill: list[float] = []

    def kill() -> None:  # node gauges move only between steps: "mid-prefill" is 1 s after sending
        legs_at_kill.append(_prefill_legs(cluster))
        cluster.kill(prefill)
    killer = threading.Timer(1.0, kill)
    killer.start()
    chunks, _ = _stream(cluster, body, lambda *_: None)
    killer.join()
    assert legs_at_kill == [legs], "the prefill leg ended before the kill"
    assert _prefill_legs(cluster) == legs  # no P leg completed: the decode instance prefilled
    oracle = generate_text(prompt, 8, model=MODEL, logprobs=0, ignore_eos=True, **CASES[case])
    assert not [c for c in chunks if "error" in c], chunks
    token_ids = [t for c in chunks if c.get("choices") for t in c["choices"][0].get("token_ids") or ()]
    assert token_ids == oracle["token_ids"]
    _left_down.append(prefill)


def _admin(cluster, name: str, action: str) -> None:
    resp = httpx.post(f"{cluster.router_url}/admin/instances/{name}/{action}", timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert resp.status_code == 200, resp.text


def test_sigterm_moves_8_streams_and_hands_back_2_queued_imports(resume_cluster) -> None:
    """Drain by SIGTERM (`drain_hand_off_s: 0`) of a decode node running 8 streams (all its rows) with 2 more imports
    queued for rows. The 8 running streams move with their KV (decode_node/moves.py): the other instance READs each
    stream's rows and KDA state and continues it (no P leg, no recompute; `migrations_total{drain}`). The 2 queued
    imports, which hold no rows there, are handed back at once with a plain 503 and placed again on the other
    instance with a new P leg (`migrations_total{error_status}`), not started on the draining node after the moves
    free its rows. All 10 end as their oracle (greedy and seeded, each running stream with its own seed), the node
    exits 0; the longest pause a client saw is printed."""
    cluster = resume_cluster
    _ready(cluster)
    victim, other = (node.name for node in cluster.nodes_of(role="decode"))
    before = cluster.metrics("router")
    moved_before = before.get("pdcluster_migrations_total", reason="drain") or 0.0
    handed_back_before = before.get("pdcluster_migrations_total", reason="error_status") or 0.0
    reader_before = cluster.metrics(other)
    reads_before = reader_before.get("pdcluster_kv_moved_requests_total") or 0.0
    bytes_before = reader_before.get("pdcluster_kv_moved_bytes_total") or 0.0
    _admin(cluster, other, "drain")  # every request starts on the victim
    results: dict[int, list[dict]] = {}
    arrivals: dict[int, list[float]] = {i: [] for i in range(10)}
    placed: dict[int, str] = {}
    counts: dict[int, int] = {}

    def request_of(index: int) -> tuple[str, dict, int]:
        """(case, further sampling, max_tokens): 0-7 the running streams, greedy or seeded with their own seeds;
        8 and 9 the imports queued for rows."""
        if index >= 8:
            return ("greedy" if index == 8 else "seeded"), {}, MAX_TOKENS
        return ("greedy", {}, DRAIN_TOKENS) if index % 2 == 0 else ("seeded", {"seed": 100 + index}, DRAIN_TOKENS)

    def run(index: int) -> None:
        def on_tokens(num_tokens: int, headers) -> None:
            counts[index] = num_tokens
            placed.setdefault(index, headers["x-pdcluster-decode"])
        case, extra, max_tokens = request_of(index)
        body = {**_body(case), **extra, "max_tokens": max_tokens}
        results[index] = _stream(cluster, body, on_tokens, arrivals[index])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(10)]
    for thread in threads[:8]:
        thread.start()
    cluster.wait_until(lambda: len(placed) == 8, 600, "all 8 streams to send a token", poll_s=0.05)
    assert set(placed.values()) == {victim}
    prefill = cluster.nodes_of(role="prefill")[0].name
    exported_at_drain = cluster.metrics(prefill).value("pdcluster_node_rows_exported_total")
    for thread in threads[8:]:
        thread.start()
    # a stream that ended first freed rows, so the imports were admitted and will never queue: say so at once
    ended_first = lambda: sorted(i for i in range(8) if i in results)  # noqa: E731
    cluster.wait_until(lambda: ended_first() or cluster.metrics(victim).value("pdcluster_node_import_queue_depth") == 2,
                       600, "2 imports queued for rows beside the 8 streams", poll_s=0.1)
    assert not ended_first(), (f"streams {ended_first()} ended ({DRAIN_TOKENS} tokens) before the 2 imports queued "
                               "for rows: too short for this machine's load (DRAIN_TOKENS)")
    queued_rows = cluster.metrics(prefill).value("pdcluster_node_rows_exported_total") - exported_at_drain
    assert queued_rows > 0  # the queued imports' P legs
    _admin(cluster, other, "undrain")
    process = cluster.cluster.children[victim].popen
    os.kill(process.pid, signal.SIGTERM)
    streamed = dict(counts)  # tokens each client had when the SIGTERM was sent
    # 8 running streams: each streamed a token and none had ended (its last chunk comes after its last token); the
    # 2 queued imports streamed nothing
    assert sorted(streamed) == list(range(8)) and all(0 < n < DRAIN_TOKENS for n in streamed.values()), (
        f"not 8 running streams and 2 queued imports at the SIGTERM: {streamed}")
    for thread in threads:
        thread.join(900)
    for index in range(10):
        case, extra, max_tokens = request_of(index)
        _check_against_oracle(results[index], case, max_tokens, **extra)
    assert process.wait(120) == 0
    after = cluster.metrics("router")
    assert after.value("pdcluster_migrations_total", reason="drain") == moved_before + 8
    assert after.value("pdcluster_migrations_total", reason="error_status") == handed_back_before + 2
    # P legs after the 8 streams started: the queued imports' first and their second, none for a moved stream
    assert cluster.metrics(prefill).value("pdcluster_node_rows_exported_total") == exported_at_drain + 2 * queued_rows
    reader = cluster.metrics(other)  # the KV was READ decode-to-decode, once per moved stream
    assert reader.value("pdcluster_kv_moved_requests_total") == reads_before + 8
    moved_bytes = reader.value("pdcluster_kv_moved_bytes_total") - bytes_before
    assert moved_bytes > 0
    pause = max(max(b - a for a, b in zip(times, times[1:])) for times in list(arrivals.values())[:8])
    print(f"drain of {victim} with 8 streams ({streamed} tokens streamed at the SIGTERM) and 2 queued imports: "
          f"8 moved with their KV ({moved_bytes:.0f} bytes READ), 2 handed back; longest pause a client saw "
          f"{pause:.2f} s")
    _left_down.append(victim)
