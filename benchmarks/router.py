"""PD router side by side with vllm-router (Rust) in one run: the same fake engines, port and load.

Fake vLLM-protocol engines (tests/router/wire_fake.py: `/v1/models`, `/metrics` with
`vllm:cache_config_info`, a P leg answering `kv_transfer_params`, a D leg answering 16 tokens or streaming
256) run in their own process. Each contender is started in turn on the same port, alternating the order
per round: vllm-router 0.1.17 with `--policy round_robin` (the anchor: two legs per request, like ours),
vllm-router with its default `cache_aware` policy (which also calls `/v1/completions/render` on P and D
for every request: four upstream calls), our router, optionally our router at an older git revision, and
`floor` (benchmarks/router_floor.py: the two legs in Python with none of the router's features; `--only ... floor`),
and our router's app under a kept HTTP server instead of router/server.py (benchmarks/router_asgi.py, `--only ...
uvicorn granian`: uvicorn on httptools + uvloop, granian; the app as of `--asgi-rev`, whose completion routes were
ASGI). Each is driven by
- wrk (C; one thread) at 1, 16, 64 and 256 connections, non-streaming: req/s, mean and p99 latency, each point
  after `--warmup` seconds of the same load (discarded), so that opening the routers' upstream connections for a
  higher concurrency is not billed to that point's short window;
- 64 concurrent SSE streams x 256 tokens (an asyncio client on uvloop + httptools): chunks/s, TTFT p50/p99.
Each window also records the CPU time the contender's processes spent per request (per SSE chunk), from /proc:
on a machine that other work shares, req/s follows the CPU share a contender wins (a server with more threads
wins more), CPU per request does not.
Every run checks that the engines saw as many P legs as D legs (both routers run both legs). Every window
records the machine's idle and steal shares (/proc/stat); a window in which the hypervisor stole more than
`--max-steal` percent of the CPU time is measured again (at most `--steal-retries` times, least-stolen attempt
kept), the same rule for every contender: on this VM, steal of 18-21% after heavy load was seen to cut a
1-connection window's req/s by 40-48%. By default each
contender runs its whole sweep in turn; with `--per-point` every contender (started afresh) runs one load point
before any runs the next, so that the windows a ratio compares are seconds apart rather than minutes (this VM's
speed drifts by up to ~1.8x within minutes).
The `direct` row (client -> D engine, one leg) is the load generators' and fakes' own ceiling. The `static` row
(when `nginx` is installed: one nginx worker answering the D leg's JSON from memory, in C, for every request;
Debian `nginx-light`) is wrk against the cheapest server this machine can run: how its throughput moves
between loads with no Python and no upstream at all.

    python benchmarks/router.py [--duration 5] [--rounds 2] [--workers 2] [--baseline-rev REV] [--json out.json]
Headline: router_pd_throughput_ratio_c64 = ours / vllm-router (round_robin) req/s at 64 connections, worst round.
    python benchmarks/router.py --clients    upstream HTTP clients (ours, aiohttp, httpx) against one fake P
    python benchmarks/router.py --only pdcluster uvicorn granian --points c64 c256 stream --per-point
        our HTTP server (router/server.py) against uvicorn and granian serving the same app (`--asgi-rev`)
    python benchmarks/router.py --alternate 64 256 [--pairs 5] [--only ...] [--json out.json]
        pairs of windows at 64 then 256 connections in one process per contender (and `direct`): the median and
        spread of c256 / c64 req/s; headline router_throughput_ratio_c256_over_c64_median (ours).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the repo's `router` package, not this file
from router_load import (PROMPT, WRK_LUA, body, drive_streams, run_wrk,  # noqa: E402 - benchmarks/router_load.py
                         windowed)

BIN = Path(sys.executable).parent
CONNECTIONS = (1, 16, 64, 256)
ASGI_SERVERS = ("uvicorn", "granian")
"""Contenders that serve our router's app under a kept ASGI server (benchmarks/router_asgi.py)."""
ASGI_REV = "cca74d5"
"""A revision whose router app serves the completion routes as ASGI (router/fastpath.py, removed after it)."""


async def compare_clients(url: str, num_requests: int = 4000) -> None:
    """Requests/s and this process's CPU per request, sending P legs through each client 1, 64 and 256 at a time
    (why router/upstream.py). The CPU per request is what the machine's other load disturbs least."""
    import aiohttp  # noqa: PLC0415 - a dependency of the bench extra (vllm-router)

    from router.upstream import UpstreamPool  # noqa: PLC0415

    payload = json.dumps({"model": "fake-model", "prompt": PROMPT, "max_tokens": 1,
                          "kv_transfer_params": {"do_remote_decode": True}}).encode()
    headers = {"X-Request-Id": "bench", "Content-Type": "application/json"}
    pool = UpstreamPool(connect_timeout_s=5)
    hx = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    aio = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def ours() -> None:
        await (await pool.send(url, "/v1/completions", payload, headers)).aread()

    async def via_httpx() -> None:
        await (await hx.post(f"{url}/v1/completions", content=payload, headers=headers)).aread()

    async def via_aiohttp() -> None:
        async with aio.post(f"{url}/v1/completions", data=payload, headers=headers) as resp:
            await resp.read()

    clients = (("router/upstream.py", ours), ("aiohttp", via_aiohttp), ("httpx", via_httpx))
    for concurrency in (1, 64, 256):
        for attempt in range(2):  # the clients alternate, twice: the machine's drift shows as the spread
            for name, one in clients:
                count = num_requests if name != "httpx" or concurrency == 1 else num_requests // 4

                async def loop(k: int, one=one) -> None:
                    for _ in range(k):
                        await one()

                await asyncio.gather(*(loop(2) for _ in range(concurrency)))  # open the connections first
                wall, cpu = time.perf_counter(), time.process_time()
                await asyncio.gather(*(loop(count // concurrency) for _ in range(concurrency)))
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                print(f"{name:<20} {concurrency:>3} at a time, try {attempt + 1}: {count / wall:>9,.0f} req/s, "
                      f"{1e6 * cpu / count:6.1f} us CPU per request", flush=True)
    await aio.close()
    await hx.aclose()
    pool.close()


def contender_command(name: str, tree: Path, port: int, p_url: str, d_url: str, workers: int) -> list[str]:
    if name == "floor":  # two legs and nothing else (benchmarks/router_floor.py)
        return [sys.executable, str(ROOT / "benchmarks" / "router_floor.py"), "--port", str(port), "--prefill", p_url,
                "--decode", d_url, "--workers", str(workers)]
    if name in ASGI_SERVERS:  # our app, as of --asgi-rev (PYTHONPATH), under uvicorn or granian
        return [sys.executable, str(ROOT / "benchmarks" / "router_asgi.py"), "--server", name, "--prefill", p_url,
                "--decode", d_url, "--port", str(port), "--workers", str(workers)]
    if name.startswith("vllm-router"):
        policy = ["--policy", "round_robin"] if name == "vllm-router" else []
        return [str(BIN / "vllm-router"), "--vllm-pd-disaggregation", *policy, "--prefill", p_url, "--decode", d_url,
                "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(port + 3), "--log-level", "warning"]
    args = ["--prefill", p_url, "--decode", d_url, "--engine", "vllm", "--port", str(port),
            "--log-level", "warning"]
    if name == "pdcluster":
        args += ["--workers", str(workers)]
    return [sys.executable, "-c", "import sys; from router.cli import main; sys.exit(main(sys.argv[1:]))", *args]


def wait_ready(url: str, name: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}")
        try:
            resp = httpx.post(f"{url}/v1/completions", content=body(4, False), timeout=5,
                              headers={"content-type": "application/json"})
            if resp.status_code == 200 and resp.headers.get("x-pdcluster-prefill", "p") != "none":
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{name} not ready at {url} within {timeout_s} s")


def legs(engine_url: str) -> tuple[int, int]:
    """(completion legs, render calls) the engine has served so far."""
    stats = httpx.get(f"{engine_url}/stats", timeout=5).json()
    return int(stats["requests"]), int(stats["render"])


POINTS = (*(f"c{c}" for c in CONNECTIONS), "stream")
REFERENCES = ("direct", "static")
"""Rows that are not routers: no P legs, so no P/D leg check."""


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds so far of process `pid` and its live descendants (/proc): a contender's
    supervisor and workers."""
    parents, cpu = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            parents[int(entry.name)] = int(fields[1])
            cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent and child not in tree]
        tree.update(children)
        frontier += children
    return sum(cpu.get(p, 0.0) for p in tree)


def measure(name: str, url: str, p_url: str, d_url: str, args, script: Path,
            points: tuple[str, ...] = POINTS, pid: int | None = None) -> dict:
    """One contender's windows; with `pid` (the contender's process), each wrk window also records the CPU its
    processes spent per request (`cpu_us_per_req`), which the machine's other load disturbs far less than
    req/s."""
    row: dict = {}
    (p0, pr0), (d0, dr0) = legs(p_url), legs(d_url)
    if args.warmup <= 0:  # with --warmup every point warms itself up
        subprocess.run(["wrk", "-t1", "-c16", "-d1s", "-s", str(script), f"{url}/v1/completions"], capture_output=True)
    for point in points:
        if point == "stream":
            def streams() -> dict:
                before = tree_cpu_s(pid) if pid is not None else 0.0
                result = uvloop.run(drive_streams(url, 64, args.duration, 256))
                if pid is not None:
                    num_chunks = max(1.0, result["chunks_per_s"] * args.duration)
                    result["cpu_us_per_chunk"] = 1e6 * (tree_cpu_s(pid) - before) / num_chunks
                return result

            row["stream"] = windowed(streams, args.max_steal, args.steal_retries)
            continue
        c = int(point[1:])

        def one(c: int = c) -> dict:
            if args.warmup > 0:  # discarded: the upstream pools open their connections for this load here
                run_wrk(url, c, args.warmup, script)
            before = tree_cpu_s(pid) if pid is not None else 0.0
            result = run_wrk(url, c, args.duration, script)
            if pid is not None:
                result["cpu_us_per_req"] = 1e6 * (tree_cpu_s(pid) - before) / max(1, result["requests"])
            return result

        row[point] = windowed(one, args.max_steal, args.steal_retries)
    (p1, pr1), (d1, dr1) = legs(p_url), legs(d_url)
    num_p, num_d = p1 - p0, d1 - d0
    row["legs"] = {"prefill": num_p, "decode": num_d, "render": pr1 - pr0 + dr1 - dr0}
    print(f"{name}: " + ", ".join(f"c={p[1:]} {row[p]['req_per_s']:,.0f} req/s" if p != "stream"
                                  else f"SSE {row['stream']['chunks_per_s']:,.0f} chunks/s" for p in points), flush=True)
    in_flight = sum(int(p[1:]) for p in points if p != "stream") + 64 * ("stream" in points)  # cut off at ends
    in_flight *= 2 if args.warmup > 0 else 1  # each warmup window ends with as many cut off
    if name not in REFERENCES and abs(num_p - num_d) > in_flight + 0.01 * num_d:
        raise RuntimeError(f"{name}: {num_p} P legs but {num_d} D legs: not every request ran both legs")
    return row


def start_fakes(ports: list[int]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tests.router.wire_fake", "--ports", *map(str, ports)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", "fake engines did not start"
    return proc


NGINX_CONF = """worker_processes 1;
daemon off;
pid %(tmp)s/nginx.pid;
error_log %(tmp)s/nginx-error.log;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path %(tmp)s;
  keepalive_requests 1000000000;
  keepalive_timeout 300s;
  server {
    listen 127.0.0.1:%(port)d backlog=4096;
    location / { default_type application/json; return 200 '%(body)s'; }
  }
}
"""


def start_static(port: int, tmp: Path) -> subprocess.Popen | None:
    """One nginx worker answering the D leg's JSON for every request (no Python, no upstream), or None (with a
    note) when nginx is not installed."""
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        print("static: nginx not found (apt-get install nginx-light): no static row", flush=True)
        return None
    answer = json.dumps({"id": "d", "choices": [{"index": 0, "text": "".join(f"t{i} " for i in range(16)),
                                                 "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 100, "completion_tokens": 16, "total_tokens": 116}})
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF % {"tmp": tmp, "port": port, "body": answer})
    proc = subprocess.Popen([nginx, "-e", str(tmp / "nginx-error.log"), "-p", str(tmp), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", f"nginx (log: {tmp / 'nginx-error.log'})", proc, timeout_s=30)
    except RuntimeError:
        proc.terminate()
        raise
    return proc


def baseline_tree(rev: str, tmp: Path) -> Path:
    tree = tmp / f"baseline-{rev}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                   capture_output=True)
    return tree


def alternate(name: str, url: str, args, script: Path) -> list[dict]:
    """`--pairs` pairs of windows at the two `--alternate` loads, low then high, in one process of a contender:
    how its throughput moves from the lower load to the higher with the VM's drift spread over both."""
    low, high = args.alternate
    pairs = []
    for _ in range(args.pairs):
        pair = {}
        for c in (low, high):
            def one(c: int = c) -> dict:
                if args.warmup > 0:
                    run_wrk(url, c, args.warmup, script)
                return run_wrk(url, c, args.duration, script)
            pair[f"c{c}"] = windowed(one, args.max_steal, args.steal_retries)
        pair["ratio"] = pair[f"c{high}"]["req_per_s"] / pair[f"c{low}"]["req_per_s"]
        lo_rps, hi_rps = pair[f"c{low}"]["req_per_s"], pair[f"c{high}"]["req_per_s"]
        print(f"{name}: c={low} {lo_rps:,.0f} req/s, c={high} {hi_rps:,.0f} req/s, ratio {pair['ratio']:.3f}",
              flush=True)
        pairs.append(pair)
    return pairs


def print_table(rounds: list[dict], points: tuple[str, ...] = POINTS) -> None:
    wrk_points = [p for p in points if p != "stream"]
    head = f"{'round':<5} {'contender':<24}" + "".join(f"{f'c={p[1:]} req/s (mean ms)':>23}" for p in wrk_points)
    print(head + f"{'SSE chunks/s (TTFT p50/p99 ms)':>34}   max steal % (re-measured windows)")
    for i, rnd in enumerate(rounds, 1):
        for name, row in rnd.items():
            cells = "".join(f"{row[p]['req_per_s']:>12,.0f} ({row[p]['mean_ms']:6.2f})"
                            + (f" {row[p]['cpu_us_per_req']:4.0f}us" if "cpu_us_per_req" in row[p] else "   ")
                            for p in wrk_points)
            s = row.get("stream")
            windows = [row[p] for p in POINTS if p in row]
            steal = max(w.get("steal_pct", 0.0) for w in windows)
            again = sum(w.get("attempts", 1) - 1 for w in windows)
            sse = f"{s['chunks_per_s']:>14,.0f} ({s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f})" if s else f"{'-':>20}"
            print(f"{i:<5} {name:<24}{cells}{sse}"
                  + f"  errors {sum(row[p]['errors'] for p in wrk_points) + (s['errors'] if s else 0)}"
                  + f"  steal {steal:.1f} ({again})")


def print_server_ratios(rounds: list[dict], points: tuple[str, ...]) -> None:
    """Ours (router/server.py) against the same app under each kept ASGI server, per round and point: throughput
    ours / theirs, and CPU per request (per SSE chunk) of their processes / ours (above 1: ours spends less)."""
    rate = {p: "chunks_per_s" if p == "stream" else "req_per_s" for p in points}
    cost = {p: "cpu_us_per_chunk" if p == "stream" else "cpu_us_per_req" for p in points}
    for other in ASGI_SERVERS:
        for i, rnd in enumerate(rounds, 1):
            if "pdcluster" in rnd and other in rnd:
                ours, theirs = rnd["pdcluster"], rnd[other]
                print(f"round {i} vs {other}: " + ", ".join(
                    f"{p} throughput {ours[p][rate[p]] / theirs[p][rate[p]]:.2f} "
                    f"cpu {theirs[p][cost[p]] / ours[p][cost[p]]:.2f}" for p in points))


def ratios(rnd: dict, ours: str = "pdcluster", anchor: str = "vllm-router") -> dict:
    a, b = rnd[ours], rnd[anchor]
    out = {f"throughput_c{c}": a[f"c{c}"]["req_per_s"] / b[f"c{c}"]["req_per_s"] for c in CONNECTIONS}
    out["mean_latency_c1"] = a["c1"]["mean_ms"] / b["c1"]["mean_ms"]
    out["stream_chunks"] = a["stream"]["chunks_per_s"] / b["stream"]["chunks_per_s"]
    if "vllm-router+cache_aware" in rnd:
        out["throughput_c64_vs_cache_aware"] = a["c64"]["req_per_s"] / rnd["vllm-router+cache_aware"]["c64"]["req_per_s"]
    out["ours_monotonic_1_to_256"] = all(a[f"c{x}"]["req_per_s"] <= a[f"c{y}"]["req_per_s"] * 1.02
                                         for x, y in zip(CONNECTIONS, CONNECTIONS[1:]))
    return out


def _with_contender(name: str, trees: dict, args, tmp: Path, url: str, p_url: str, d_url: str,  # type: ignore[no-untyped-def]
                    work):
    """Start contender `name` on the benchmark port, run `work(pid)` once it answers, stop it."""
    env = {**os.environ, "PYTHONPATH": str(trees[name])}
    cmd = contender_command(name, trees[name], args.port, p_url, d_url, args.workers)
    proc = subprocess.Popen(cmd, cwd=trees[name], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / f"{name.replace('/', '_')}.log", "a"))
    try:
        wait_ready(url, name, proc)
        return work(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def report_alternate(results: dict[str, list[dict]], args) -> int:  # type: ignore[no-untyped-def]
    low, high = args.alternate
    print(f"{'contender':<24} {'median c' + str(high) + '/c' + str(low):>16} {'min':>7} {'max':>7} "
          f"{'pairs >= 0.98':>14}")
    summary = {}
    for name, pairs in results.items():
        r = sorted(p["ratio"] for p in pairs)
        med = r[len(r) // 2] if len(r) % 2 else (r[len(r) // 2 - 1] + r[len(r) // 2]) / 2
        summary[name] = {"median": med, "min": r[0], "max": r[-1], "held": sum(x >= 0.98 for x in r), "pairs": len(r)}
        print(f"{name:<24} {med:>16.3f} {r[0]:>7.3f} {r[-1]:>7.3f} {summary[name]['held']:>9}/{len(r)}")
    if args.json:
        head = summary.get("pdcluster", next(iter(summary.values())))
        args.json.write_text(json.dumps({
            "headline": {"metric": f"router_throughput_ratio_c{high}_over_c{low}_median", "value": head["median"],
                         "goal": ">= 1.0 (throughput does not fall as connections rise)"},
            "summary": summary, "pairs": results, "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per load point")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=1.0,
                        help="seconds of the same load, discarded, before each measured wrk point (0: none)")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="our router's worker processes")
    parser.add_argument("--baseline-rev", help="also run our router as of this git revision")
    parser.add_argument("--asgi-rev", default=ASGI_REV,
                        help="git revision of our router that the uvicorn and granian contenders serve")
    parser.add_argument("--only", nargs="+", choices=["vllm-router", "vllm-router+cache_aware", "pdcluster",
                                                      "baseline", "floor", *ASGI_SERVERS],
                        help="run only these contenders (ratios need vllm-router and pdcluster)")
    parser.add_argument("--per-point", action="store_true",
                        help="alternate the contenders at each load point (each restarted per point) instead of "
                             "running each one's whole sweep in turn")
    parser.add_argument("--max-steal", type=float, default=5.0,
                        help="re-measure a window in which the hypervisor stole more than this %% of the CPU time")
    parser.add_argument("--steal-retries", type=int, default=2, help="re-measurements per window at most")
    parser.add_argument("--port", type=int, default=18500)
    parser.add_argument("--points", nargs="+", choices=POINTS, default=POINTS,
                        help="load points of the sweep (default: all; the ratios to vllm-router need all)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--clients", action="store_true", help="compare upstream HTTP clients instead")
    parser.add_argument("--alternate", type=int, nargs=2, metavar=("LOW", "HIGH"),
                        help="instead of the sweep: --pairs pairs of windows at LOW then HIGH connections in one "
                             "process per contender (median and spread of HIGH / LOW req/s)")
    parser.add_argument("--pairs", type=int, default=5, help="window pairs per contender with --alternate")
    args = parser.parse_args(argv)
    args.points = tuple(p for p in POINTS if p in args.points)
    if args.alternate and (args.alternate[0] >= args.alternate[1] or args.alternate[0] < 1 or args.pairs < 1):
        parser.error("--alternate takes LOW < HIGH, both >= 1, and --pairs >= 1")
    if args.clients:
        fakes = start_fakes([args.port + 1])
        try:
            uvloop.run(compare_clients(f"http://127.0.0.1:{args.port + 1}"))
        finally:
            fakes.terminate()
        return 0
    p_url, d_url = f"http://127.0.0.1:{args.port + 1}", f"http://127.0.0.1:{args.port + 2}"
    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        script = tmp / "post.lua"
        script.write_text(WRK_LUA % body(16, False).decode())
        trees = {"vllm-router": ROOT, "vllm-router+cache_aware": ROOT, "pdcluster": ROOT, "floor": ROOT}
        if args.baseline_rev:
            trees[f"pdcluster@{args.baseline_rev[:7]}"] = baseline_tree(args.baseline_rev, tmp)
        if args.only:
            trees = {k: v for k, v in trees.items() if k in args.only
                     or ("baseline" in args.only and "@" in k)}
            if any(name in args.only for name in ASGI_SERVERS):
                asgi_tree = baseline_tree(args.asgi_rev, tmp)
                trees.update({name: asgi_tree for name in ASGI_SERVERS if name in args.only})
        else:
            trees.pop("floor")
        fakes = start_fakes([args.port + 1, args.port + 2])
        static = start_static(args.port + 4, tmp)
        static_url = f"http://127.0.0.1:{args.port + 4}"
        rounds = []
        try:
            if args.alternate:  # `direct` and `static` first: the load generator's and the machine's own move
                results = {"direct": alternate("direct", d_url, args, script)}
                if static is not None:
                    results["static"] = alternate("static", static_url, args, script)
                for name in trees:
                    results[name] = _with_contender(name, trees, args, tmp, url, p_url, d_url,
                                                    lambda _, name=name: alternate(name, url, args, script))
                return report_alternate(results, args)
            for i in range(args.rounds):
                order = list(trees) if i % 2 == 0 else list(reversed(trees))
                rnd = {"direct": measure("direct", d_url, p_url, d_url, args, script, args.points)} if i == 0 else {}
                if i == 0 and static is not None:
                    rnd["static"] = measure("static", static_url, p_url, d_url, args, script,
                                            tuple(p for p in args.points if p != "stream"))
                # --per-point: every contender (restarted) at one load point before the next point, so that the
                # windows compared are seconds apart, not minutes
                for points in ([(p,) for p in args.points] if args.per_point else [args.points]):
                    for name in order:
                        rnd.setdefault(name, {}).update(_with_contender(
                            name, trees, args, tmp, url, p_url, d_url,
                            lambda pid, name=name, points=points: measure(name, url, p_url, d_url, args, script,
                                                                          points, pid)))
                rounds.append(rnd)
        finally:
            fakes.terminate()
            if static is not None:
                static.terminate()
                static.wait(timeout=30)
            for tree in {tree for tree in trees.values() if tree != ROOT}:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                               capture_output=True)
    print_table(rounds, args.points)
    print_server_ratios(rounds, args.points)
    if args.points != POINTS or not all("pdcluster" in rnd and "vllm-router" in rnd for rnd in rounds):
        return 0
    per_round = [ratios(rnd) for rnd in rounds]
    for i, r in enumerate(per_round, 1):
        print(f"round {i}: ours/vllm-router " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                          for k, v in r.items()))
    headline = min(r["throughput_c64"] for r in per_round)
    if args.json:
        args.json.write_text(json.dumps({
            "headline": {"metric": "router_pd_throughput_ratio_c64", "value": headline,
                         "goal": ">= 0.8 (goal 1.0) x vllm-router req/s at 64 connections, worst round"},
            "ratios": per_round, "rounds": rounds, "machine": os.uname().nodename, "cpus": os.cpu_count(),
            "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
