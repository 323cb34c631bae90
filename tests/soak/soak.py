"""Soak: mixed agent-like load against a `pdcluster up` cluster, with client cancels and one decode rank
killed and restarted; then every answer is checked against the oracle and every node against a leak.

    .venv/bin/python -m tests.soak.soak --duration 60 [--concurrency 6] [--max-requests 400] [--json OUT]

Not part of the test suite (nothing here is collected). Bounded in time (`--duration` of load, then the
checks) and in count (`--max-requests`); loopback only (the cluster binds 127.0.0.1).

Load: `--concurrency` workers, each looping until the deadline: an agent session (2-4 chat turns under
one X-Session-ID, each turn sending the whole history back), a one-off completion (short or long prompt),
streamed or not, at temperature 0; a fraction (`--cancel-rate`) of streams is dropped by the client after
a few chunks. At 40 % of the duration one rank process of the DCP decode instance is SIGKILLed; once the
router marks the instance unhealthy the instance is restarted (the requests it held fail cleanly).

Checks (each reported with counts, exit status 1 when one fails):
- leaks: once the load stopped, every node reports 0 rows used, 0 leases outstanding, nothing running (then the
  cluster stops, so the oracle has the machine);
- oracle: every completed answer equals the greedy answer of the reference engine in this process (the code of
  `pdcluster generate`, batched: tests/soak/oracle.py says why and how), token for token for non-streamed answers
  (every request asks for log-probs, whose entries name each token; `token_ids` too where the answer has
  them) and in text; a few answers are recomputed one request at a time and must be equal (`oracle_batched`),
  and two prompts are also run through the real `pdcluster generate --json` CLI to show the in-process oracle is
  that oracle;
- waits: no request took more than 5 s beyond its own prefill + decode time on the oracle engine alone on the same
  machine (a loaded machine reports the excess it saw, the counts say how many).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from cluster.config import parse_config
from cluster.launcher import Cluster
from tests.e2e.harness import ClusterHandle, run_oracle
from tests.soak.oracle import Oracle, prompt_ids_of

WAIT_LIMIT_S = 5.0
SOAK_CONFIG = {
    "model": "kimi-k3.1-mini",
    "engine": "reference",
    "router": {"port": None, "admin_token": "soak", "settings": {
        "chars_per_token": 1.0, "disagg_min_uncached_tokens": 64, "health_interval_s": 0.5,
        "unhealthy_threshold": 2, "healthy_threshold": 1, "breaker_recovery_s": 2.0,
        "prefill_timeout_s": 120.0, "first_token_timeout_s": 120.0, "stream_idle_timeout_s": 60.0}},
    "startup_timeout_s": 300,
    "pools": [
        {"name": "prefill", "role": "prefill", "tp": 2, "settings": {"prefix_cache": False}},
        {"name": "tp", "role": "decode", "tp": 1, "max_context_tokens": 1536, "settings": {"prefix_cache": False}},
        {"name": "dcp", "role": "decode", "dcp": 2, "settings": {"prefix_cache": False}},
    ],
}
WORDS = ("agent", "tool", "result", "plan", "file", "patch", "test", "error", "retry", "context", "shard", "rank")


def route_of(resp: httpx.Response) -> dict[str, str]:
    """The router's headers naming the request and where it ran (router/service.py `_route_headers`)."""
    return {k: v for k, v in resp.headers.items() if k == "x-request-id" or k.startswith("x-pdcluster-")}


def token_names_of(choice: dict) -> list[str]:
    """Token names of a choice's (or chunk's) log-probs: completions `tokens`, chat `content[].token`."""
    logprobs = choice.get("logprobs") or {}
    return list(logprobs.get("tokens") or [t["token"] for t in logprobs.get("content") or []])


@dataclass
class Record:
    kind: str
    stream: bool
    prompt_ids: list[int]
    max_tokens: int
    started: float
    outcome: str = "pending"
    """ok | cancelled | shed | error"""
    status: int = 0
    text: str = ""
    token_ids: list[int] | None = None
    token_names: list[str] = field(default_factory=list)
    """Each token's name from its log-prob entry (node/logprobs.py `token_name`)."""
    e2e_s: float = 0.0
    during_fault: bool = False
    error: str = ""
    route: dict[str, str] = field(default_factory=dict)
    """The router's `x-request-id` and `x-pdcluster-*` headers: the request id and the instances that served it."""
    finish_reason: str | None = None
    usage: dict | None = None
    num_events: int = 0
    """Stream events (chunks) received."""

    def sample(self, expected_ids: list[int], expected_text: str, expected_names: list[str]) -> dict:
        """What a mismatch report shows of this answer next to the oracle's."""
        return {"request_id": self.route.get("x-request-id"), "kind": self.kind, "stream": self.stream,
                "route": {k.removeprefix("x-pdcluster-"): v for k, v in self.route.items() if k != "x-request-id"},
                "finish_reason": self.finish_reason, "usage": self.usage, "num_events": self.num_events,
                "max_tokens": self.max_tokens, "num_prompt_tokens": len(self.prompt_ids),
                "started_s": round(self.started, 2), "e2e_s": round(self.e2e_s, 2), "during_fault": self.during_fault,
                "got": self.text[:80], "want": expected_text[:80],
                "got_token_ids": self.token_ids, "want_token_ids": expected_ids,
                "got_token_names": self.token_names[:40], "want_token_names": expected_names[:40]}


@dataclass
class Soak:
    handle: ClusterHandle
    args: argparse.Namespace
    rng: random.Random
    records: list[Record] = field(default_factory=list)
    fault_window: list[float] = field(default_factory=list)
    deadline: float = 0.0
    faults: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(max_workers=1))
    """Runs the restart off the event loop (one at a time)."""

    async def in_fault_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.faults, fn, *args)

    def text(self, num_words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(num_words))

    async def request(self, client: httpx.AsyncClient, path: str, body: dict, kind: str, prompt_ids: list[int],
                      session: str | None = None) -> Record:
        stream = bool(body.get("stream"))
        rec = Record(kind, stream, prompt_ids, body["max_tokens"], time.monotonic())
        self.records.append(rec)
        headers = {"x-session-id": session} if session else {}
        if stream:
            body = {**body, "stream_options": {"include_usage": True}}
        cancel_after = self.rng.randint(1, 3) if stream and self.rng.random() < self.args.cancel_rate else None
        try:
            if stream:
                await self._stream(client, path, body, headers, rec, cancel_after)
            else:
                resp = await client.post(path, json=body, headers=headers)
                rec.status, rec.route = resp.status_code, route_of(resp)
                if resp.status_code == 200:
                    answer = resp.json()
                    choice = answer["choices"][0]
                    rec.finish_reason, rec.usage = choice.get("finish_reason"), answer.get("usage")
                    rec.text = choice.get("text") if "text" in choice else choice["message"]["content"]
                    rec.token_ids = choice.get("token_ids")
                    rec.token_names = token_names_of(choice)
                    rec.outcome = "ok"
                else:
                    rec.outcome, rec.error = ("shed" if resp.status_code in (429, 503) else "error"), resp.text[:200]
        except httpx.HTTPError as exc:
            rec.outcome, rec.error = "error", f"{type(exc).__name__}: {exc}"[:200]
        rec.e2e_s = time.monotonic() - rec.started
        return rec

    def mark_fault_overlap(self) -> None:
        """Requests that ran while the decode instance was down or restarting may fail (cleanly)."""
        if not self.fault_window:
            return
        start, end = self.fault_window[0], (self.fault_window[1:] or [float("inf")])[0]
        for rec in self.records:
            rec.during_fault = rec.started <= end and rec.started + rec.e2e_s >= start

    async def _stream(self, client, path, body, headers, rec: Record, cancel_after: int | None) -> None:
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            rec.status, rec.route = resp.status_code, route_of(resp)
            if resp.status_code != 200:
                await resp.aread()
                rec.outcome = "shed" if resp.status_code in (429, 503) else "error"
                rec.error = resp.text[:200]
                return
            pieces, num_events, done = [], 0, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rec.outcome, rec.error = "error", str(event["error"].get("message"))[:200]
                    return
                for choice in event.get("choices", []):
                    pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                    rec.token_names += token_names_of(choice)
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                rec.usage = event.get("usage") or rec.usage
                num_events += 1
                rec.num_events = num_events
                if cancel_after is not None and num_events >= cancel_after:
                    rec.outcome = "cancelled"
                    return  # leaving the block closes the connection mid-stream
            rec.text = "".join(pieces)
            rec.outcome = "ok" if done else "error"

    async def agent_session(self, client: httpx.AsyncClient, worker: int) -> None:
        session = f"soak-{worker}-{self.rng.getrandbits(32):08x}"
        messages = [{"role": "system", "content": "You are a coding agent. " + self.text(20)},
                    {"role": "user", "content": self.text(self.rng.randint(20, 120))}]
        for _ in range(self.rng.randint(2, 4)):
            if time.monotonic() > self.deadline:
                return
            body = {"model": self.handle.model, "messages": messages, "max_tokens": self.rng.randint(4, 24),
                    "temperature": 0, "stream": self.rng.random() < 0.5, "logprobs": True, "top_logprobs": 0}
            rec = await self.request(client, "/v1/chat/completions", body, "chat", prompt_ids_of(messages), session)
            if rec.outcome != "ok":
                return
            messages = messages + [{"role": "assistant", "content": rec.text},
                                   {"role": "user", "content": "tool output: " + self.text(self.rng.randint(10, 200))}]

    async def one_off(self, client: httpx.AsyncClient) -> None:
        prompt = self.text(self.rng.choice((8, 40, 300)))
        body = {"model": self.handle.model, "prompt": prompt, "max_tokens": self.rng.randint(4, 32), "temperature": 0,
                "stream": self.rng.random() < 0.5, "logprobs": 0}
        await self.request(client, "/v1/completions", body, "completion", prompt_ids_of(prompt))

    async def worker(self, index: int) -> None:
        async with httpx.AsyncClient(base_url=self.handle.router_url, timeout=300.0) as client:
            while time.monotonic() < self.deadline and len(self.records) < self.args.max_requests:
                if self.rng.random() < 0.6:
                    await self.agent_session(client, index)
                else:
                    await self.one_off(client)

    async def fault(self) -> None:
        """Kill one rank of the DCP decode instance, wait until the router sees it, restart the instance."""
        await asyncio.sleep(self.args.duration * 0.4)
        node = self.handle.nodes_of(role="decode", pool="dcp")[0].name
        self.fault_window.append(time.monotonic())
        pid = self.handle.kill_rank(node)
        print(f"[soak] killed rank pid {pid} of {node}", flush=True)
        await self.in_fault_thread(self.handle.wait_until, lambda: self.handle.router_sees_healthy(node) is False,
                                   60, f"the router to mark {node} unhealthy")
        await self.in_fault_thread(self.handle.restart, node)
        await self.in_fault_thread(self.handle.wait_until, lambda: self.handle.router_sees_healthy(node) is True,
                                   120, f"the router to mark {node} healthy")
        self.fault_window.append(time.monotonic())
        print(f"[soak] {node} restarted and healthy", flush=True)

    async def run(self) -> None:
        self.deadline = time.monotonic() + self.args.duration
        workers = [asyncio.create_task(self.worker(i)) for i in range(self.args.concurrency)]
        await asyncio.gather(self.fault(), *workers)


def health_of(url: str) -> int | str:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def check(soak: Soak, oracle: Oracle) -> dict:
    """Node leaks (the cluster is then stopped: the oracle gets the machine), oracle equality, waits; the report
    (counts) with `failed` checks listed."""
    soak.mark_fault_overlap()
    recs = soak.records
    outcomes = {k: sum(r.outcome == k for r in recs) for k in ("ok", "cancelled", "shed", "error")}
    errors_outside_fault = [r for r in recs if r.outcome == "error" and not r.during_fault]
    done = [r for r in recs if r.outcome == "ok"]
    loads, leaks = leak_check(soak.handle)
    soak.handle.stop()
    started = time.monotonic()
    oracle.run_all([(r.prompt_ids, r.max_tokens) for r in done])
    alone = oracle.check_alone()
    mismatches, excess = [], []
    for r in done:
        expected = oracle.generate(r.prompt_ids, r.max_tokens)
        names = oracle.token_names(expected.token_ids)
        same = r.token_names == names and r.text == expected.text and \
            (r.token_ids is None or r.token_ids == expected.token_ids)
        if not same:
            mismatches.append(r.sample(expected.token_ids, expected.text, names))
        excess.append(r.e2e_s - expected.work_s)
    cli = [run_oracle(sys.executable, soak.handle.cluster.config.model, p, 8) for p in ("soak cli check", "tool plan")]
    cli_same = all(list(c.token_ids) == oracle.generate(prompt_ids_of(p), 8).token_ids
                   for c, p in zip(cli, ("soak cli check", "tool plan")))
    for sample in mismatches:  # what the cluster's logs say about the request (its legs carry its id)
        sample["log_lines"] = logged(soak.handle.cluster.log_dir, sample["request_id"])
    over = sorted(e for e in excess if e > WAIT_LIMIT_S)
    report = {
        "requests": len(recs), "outcomes": outcomes, "errors_outside_fault": len(errors_outside_fault),
        "error_samples": [r.error for r in errors_outside_fault[:5]],
        "completed_checked": len(done), "oracle_mismatches": len(mismatches), "mismatch_samples": mismatches[:20],
        "streamed_checked": sum(r.stream for r in done), "non_streamed_checked": sum(not r.stream for r in done),
        "oracle_s": round(time.monotonic() - started, 1), "oracle_batched": alone,
        "in_process_oracle_equals_cli": cli_same, "node_loads_after": loads, "leaking_nodes": sorted(leaks),
        "wait_excess_s": {"max": round(max(excess, default=0.0), 2), "over_limit": len(over),
                          "p50": round(sorted(excess)[len(excess) // 2], 2) if excess else 0.0},
        "fault_window_s": round(soak.fault_window[1] - soak.fault_window[0], 1) if len(soak.fault_window) == 2 else None,
    }
    report["failed"] = [name for name, bad in (
        ("oracle", bool(mismatches)), ("oracle_batched", not alone["batched_equals_alone"]),
        ("oracle_cli", not cli_same), ("leaks", bool(leaks)),
        ("errors_outside_fault", bool(errors_outside_fault)), ("waits", bool(over)),
        ("fault_not_done", report["fault_window_s"] is None)) if bad]
    return report


def logged(log_dir: Path, request_id: str | None, limit: int = 20) -> list[str]:
    """The cluster's log lines naming `request_id` (its legs' ids start with it), prefixed by the log's name."""
    if not request_id:
        return []
    lines = []
    for path in sorted(log_dir.glob("*.log")):
        lines += [f"{path.stem}: {line.rstrip()[:300]}" for line in path.read_text(errors="replace").splitlines()
                  if request_id in line]
    return lines[:limit]


def leak_check(handle: ClusterHandle) -> tuple[dict, dict]:
    """Once every node is idle (or 120 s passed): each node's load, and those that hold anything."""
    try:
        handle.wait_until(lambda: all(load.is_quiet and load.rows_used == 0 for load in handle.loads().values()), 120,
                          "every node to be idle")
    except AssertionError as exc:
        print(f"[soak] {exc}", flush=True)
    loads = {}
    for node in handle.nodes:
        try:
            loads[node.name] = asdict(handle.node_load(node.name))
        except (httpx.HTTPError, KeyError) as exc:
            loads[node.name] = {"error": f"{handle.metrics_urls[node.name]}: {type(exc).__name__}: {exc}"[:300],
                                "http_port_health": health_of(node.url)}
    leaks = {name: load for name, load in loads.items()
             if "error" in load or load["rows_used"] or load["leases"] or load["running"] or load["waiting"]}
    return loads, leaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-requests", type=int, default=2000)
    parser.add_argument("--cancel-rate", type=float, default=0.15, help="share of streams the client drops")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the report here too")
    args = parser.parse_args(argv)
    if not 10 <= args.duration <= 3600 or not 1 <= args.max_requests <= 100_000:
        parser.error("--duration must be 10..3600 s and --max-requests 1..100000")
    log_dir = Path(tempfile.mkdtemp(prefix="pdcluster-soak-"))
    handle = ClusterHandle(Cluster(parse_config(SOAK_CONFIG, "tests/soak/soak.py"), log_dir).start())
    print(f"[soak] cluster up at {handle.router_url} (logs {log_dir})", flush=True)
    soak = Soak(handle, args, random.Random(args.seed))
    try:
        asyncio.run(soak.run())
        print(f"[soak] load done: {len(soak.records)} requests; checking", flush=True)
        report = check(soak, Oracle(handle.cluster.config.model))
    finally:
        handle.stop()
        soak.faults.shutdown()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
