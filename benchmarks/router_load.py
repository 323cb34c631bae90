"""The load the router benchmarks drive, and how one window of it is measured.

- `body`: the completion request (a ~490-character prompt, so that a router runs both legs);
- `run_wrk`: wrk (C, one thread) at N keep-alive connections for a window: req/s, mean and p99 latency, errors;
- `drive_streams`: N concurrent SSE streams (asyncio on uvloop + httptools): chunks/s, TTFT p50/p99;
- `windowed`: one window with the machine's idle and steal shares over it, measured again when the hypervisor
  stole more than a bound.
Used by benchmarks/router.py and benchmarks/router_inproc.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import httptools

PROMPT = ("You are a careful assistant. Summarise the following notes about disaggregated serving, where a "
          "prefill instance computes the prompt's KV cache and hands it to a decode instance over NIXL, and "
          "the router pairs compatible instances, places long sessions on large pools and relays the stream "
          "back to the client without buffering it. Keep the answer short, precise and in plain English.  ")
WRK_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[%s]]
done = function(s, lat, req)
  local e = s.errors
  io.write(string.format('WRKJSON {"requests": %%d, "duration_us": %%d, "errors": %%d, "status_errors": %%d, '
    .. '"mean_us": %%f, "p50_us": %%d, "p99_us": %%d}\\n', s.requests, s.duration,
    e.connect + e.read + e.write + e.timeout, e.status, lat.mean, lat:percentile(50), lat:percentile(99)))
end
"""


def body(max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"model": "fake-model", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}).encode()


def run_wrk(url: str, connections: int, duration_s: float, script: Path) -> dict:
    out = subprocess.run(["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(duration_s))}s", "--timeout", "10s", "-s",
                          str(script), f"{url}/v1/completions"], capture_output=True, text=True, check=True).stdout
    stats = json.loads(next(line[8:] for line in out.splitlines() if line.startswith("WRKJSON ")))
    return {"requests": stats["requests"], "req_per_s": stats["requests"] / (stats["duration_us"] / 1e6),
            "mean_ms": stats["mean_us"] / 1e3,
            "p99_ms": stats["p99_us"] / 1e3, "errors": stats["errors"] + stats["status_errors"]}


class StreamConnection(asyncio.Protocol):
    """One keep-alive connection that sends streaming requests back to back until the deadline."""

    def __init__(self, request: bytes, deadline: float, stats: dict, done: asyncio.Future) -> None:
        self.request, self.deadline, self.stats, self.done = request, deadline, stats, done

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.send()

    def send(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.started, self.first, self.events, self.last_nl = time.perf_counter(), None, 0, False
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.stats["ttft"].append(now - self.started)
        num = data.count(b"\n\n") + (self.last_nl and data[:1] == b"\n")
        self.last_nl = data.endswith(b"\n") and not data.endswith(b"\n\n")
        self.events += num
        if now < self.deadline:
            self.stats["events"] += num

    def on_message_complete(self) -> None:
        ok = self.parser.get_status_code() == 200 and self.events == self.stats["expected_events"]
        self.stats["streams" if ok else "errors"] += 1
        if time.perf_counter() < self.deadline:
            self.send()
        else:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def drive_streams(url: str, num_streams: int, duration_s: float, num_tokens: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    payload = body(num_tokens, True)
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    loop = asyncio.get_running_loop()
    stats = {"ttft": [], "events": 0, "streams": 0, "errors": 0, "expected_events": num_tokens + 1}
    deadline = time.perf_counter() + duration_s
    done = [loop.create_future() for _ in range(num_streams)]
    for fut in done:
        await loop.create_connection(lambda fut=fut: StreamConnection(request, deadline, stats, fut), host, int(port))
    await asyncio.wait_for(asyncio.gather(*done), duration_s + 30)
    ttft = sorted(stats["ttft"]) or [float("nan")]
    num_streams_done = stats["streams"]
    return {"chunks_per_s": (stats["events"] - num_streams_done) / duration_s, "streams": num_streams_done,
            "ttft_p50_ms": ttft[len(ttft) // 2] * 1e3, "ttft_p99_ms": ttft[int(0.99 * (len(ttft) - 1))] * 1e3,
            "errors": stats["errors"]}


def cpu_ticks() -> tuple[int, int, int]:
    """(all, idle + iowait, steal) jiffies of the whole machine since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields[:8]), fields[3] + fields[4], fields[7]


def windowed(run, max_steal: float, retries: int) -> dict:
    """One measured window with the machine's idle and steal shares over it; a window in which the hypervisor
    took more than `max_steal` percent of the CPU time (other guests' load: the same code runs slower for
    reasons outside this run) is measured again, at most `retries` times, and the least-stolen attempt is
    kept. The rule is the same for every contender; `attempts` and `steal_pct` say what happened."""
    best = None
    for attempt in range(1, retries + 2):
        before = cpu_ticks()
        result = run()
        after = cpu_ticks()
        total = max(1, after[0] - before[0])
        result.update(idle_pct=100 * (after[1] - before[1]) / total, steal_pct=100 * (after[2] - before[2]) / total)
        if best is None or result["steal_pct"] < best["steal_pct"]:
            best = result
        if result["steal_pct"] <= max_steal:
            break
    best["attempts"] = attempt
    return best
