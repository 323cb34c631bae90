"""`benchmarks/transfer.py --device cuda`: the same three descriptor shapes (packed rows, per-layer pages, one
descriptor) moved VRAM -> VRAM between two processes on GPU 0 by NIXL READs, next to what the GPU itself does.
With `--gpus 2` the writer's pool lives on GPU 1 and the reader's on GPU 0 (P and D on two GPUs of one host,
UCX cuda_ipc over NVLink), and the rate the READs are held against is a torch peer-to-peer copy from GPU 1 to
GPU 0 in one process (1 GiB, CUDA events), measured in the same run.

Each side is one spawned process with its pool a torch uint8 CUDA tensor on GPU 0 registered with NIXL as VRAM
(kv_transfer.nixl_agent.NixlTransport, the nodes' agent). Per scenario and method: one READ checked byte for byte
(sha256 of the ranges on both sides), then `rounds` timed READs (post to DONE), methods interleaved, medians.
In the same run: the GPU's own copy bandwidth (a 1 GiB device-to-device copy in one process, CUDA events) and
the same packed ranges copied by the reader through torch's CUDA IPC mapping of the writer's pool (the ceiling
for two processes on one GPU). GB/s counts bytes moved once (a copy of N bytes: N / t), so `packed / copy` is
the fraction of the GPU's copy rate the packed READ reaches; `copy_rw` counts read + write (2N / t).
`env` (UCX_*, PYTORCH_NO_CUDA_MEMORY_CACHING) is set in both processes before torch and UCX start.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import statistics
import time
import traceback
from typing import Any

COPY_BYTES = 1 << 30


def _digest(pool: Any, ranges: list[tuple[int, int]]) -> str:
    import torch

    data = torch.cat([pool[off:off + length] for off, length in ranges]).cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def _copy_gbps(torch: Any, src_device: str = "cuda", dst_device: str = "cuda") -> float:
    """Bytes moved once per second by a device-to-device copy of COPY_BYTES (median of 10 after 3 warm-ups);
    `src_device` != `dst_device`: a peer-to-peer copy between two GPUs, timed on the destination's stream."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=src_device)
    dst = torch.empty(COPY_BYTES, dtype=torch.uint8, device=dst_device)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return COPY_BYTES / statistics.median(times) / 1e9


def _handle(cmd: str, kw: dict, state: dict) -> Any:
    import torch

    pool, t = state["pool"], state["transport"]
    if cmd in ("fill", "zero"):
        if cmd == "fill":
            gen = torch.Generator(device="cuda").manual_seed(kw["seed"])
            pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8, device="cuda", generator=gen))
        else:
            pool.zero_()
        torch.cuda.synchronize()
        t.set_row_bytes(pool.numel())
        return t.endpoint(0)
    if cmd == "read":  # [(wall s, backend descriptors, transfer-only s)] of `repeat` READs of `ops`
        ops, split = kw["ops"], max(1, min(kw.get("split", 1), len(kw["ops"])))
        parts = [ops[i::split] for i in range(split)]  # `split` transfer requests posted at once
        out = []
        for _ in range(kw["repeat"]):
            t0 = time.perf_counter()
            handles = [t.post_read(kw["endpoint"], part) for part in parts]
            results = [t.wait(handle, 300) for handle in handles]
            wall = time.perf_counter() - t0
            for handle in handles:
                t.release(handle)
            if any(res.state.value != "DONE" for res in results):
                raise RuntimeError(f"READ ended {[res.state for res in results]}")
            descs = sum(res.backend_descriptors or 0 for res in results)
            xfer = max((res.backend_xfer_s for res in results if res.backend_xfer_s is not None), default=None)
            out.append((wall, descs, xfer))
        return out
    if cmd == "digest":
        return _digest(pool, kw["ranges"])
    if cmd == "copy_gbps":
        return _copy_gbps(torch)
    if cmd == "p2p_gbps":  # from GPU `src` to this process's GPU
        if not torch.cuda.can_device_access_peer(state["gpu"], kw["src"]):
            raise RuntimeError(f"GPU {state['gpu']} cannot access GPU {kw['src']} as a peer")
        return _copy_gbps(torch, f"cuda:{kw['src']}", f"cuda:{state['gpu']}")
    if cmd == "share":  # torch's CUDA IPC handle of this pool (the reader maps it)
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(pool)
    if cmd == "ipc_copy":  # the packed ranges copied from the writer's IPC-mapped pool: [wall s]
        rebuild, args = kw["shared"]
        src = state.setdefault("peer", rebuild(*args))
        out = []
        for _ in range(kw["repeat"]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for op in kw["ops"]:
                pool[op.d_offset:op.d_offset + op.length].copy_(src[op.p_offset:op.p_offset + op.length])
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out
    raise ValueError(f"unknown command {cmd}")


def _serve(conn: Any, name: str, pool_bytes: int, settings: dict, env: dict, gpu: int = 0) -> None:
    os.environ.update(env)
    try:
        import torch

        from kv_transfer.nixl_agent import NixlTransport
        from kv_transfer.ucx_env import KVTransferSettings

        torch.cuda.set_device(gpu)
        pool = torch.zeros(pool_bytes, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        transport = NixlTransport(name, pool, pool_bytes, KVTransferSettings(**settings))
        state = {"pool": pool, "transport": transport, "gpu": gpu}
        conn.send(("ok", {"ucx_tls": transport.ucx_tls, "mem_type": transport.mem_type}))
    except Exception:  # noqa: BLE001 - the parent reports it
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        cmd, kw = conn.recv()
        if cmd == "stop":
            state.pop("peer", None)
            transport.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", _handle(cmd, kw, state)))
        except Exception:  # noqa: BLE001
            conn.send(("err", traceback.format_exc()))


class _Side:
    def __init__(self, ctx: Any, name: str, pool_bytes: int, settings: dict, env: dict, gpu: int = 0) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, name, pool_bytes, settings, env, gpu), daemon=True)
        self.proc.start()
        self.info = self._answer(300)

    def _answer(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"no answer within {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, cmd: str, timeout: float = 300, **kw: Any) -> Any:
        self.conn.send((cmd, kw))
        return self._answer(timeout)

    def stop(self) -> None:
        try:
            self.call("stop", timeout=60)
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


def run(scs: list[dict], rounds: int, settings: dict, env: dict, split: int = 1, gpus: int = 1) -> dict:
    """Every scenario's three methods as NIXL VRAM READs, the IPC ceiling and the copy rate they are held against:
    one GPU's own copy (`gpus` 1: both pools on GPU 0), or the peer copy from GPU 1 to GPU 0 (`gpus` 2: the
    writer's pool on GPU 1, the reader's on GPU 0)."""
    if gpus not in (1, 2):
        raise ValueError(f"gpus must be 1 or 2, not {gpus}")
    ctx = multiprocessing.get_context("spawn")
    pool = max(s["pool"] for s in scs)
    p = _Side(ctx, "bench-P-cuda", pool, settings, env, gpu=gpus - 1)
    d = _Side(ctx, "bench-D-cuda", pool, settings, env, gpu=0)
    rows = []
    try:
        ep = p.call("fill", seed=1)
        d.call("zero")
        copy = p.call("copy_gbps") if gpus == 1 else d.call("p2p_gbps", src=1)
        shared = p.call("share")
        for sc in scs:
            times: dict[str, list[float]] = {m: [] for m in sc["methods"]}
            descs = {}
            for m, ops in sc["methods"].items():  # warm-up + correctness
                descs[m] = d.call("read", endpoint=ep, ops=ops, repeat=1, split=split)[0][1]
                same = p.call("digest", ranges=[(o.p_offset, o.length) for o in ops]) == \
                    d.call("digest", ranges=[(o.d_offset, o.length) for o in ops])
                assert same, f"{sc['name']} {m}: bytes differ after the READ"
                d.call("zero")
            names = list(sc["methods"])
            for k in range(rounds):
                for m in names[k % len(names):] + names[:k % len(names)]:
                    times[m] += [w for w, _, _ in d.call("read", endpoint=ep, ops=sc["methods"][m], repeat=3,
                                                         split=split)]
            ipc = d.call("ipc_copy", shared=shared, ops=sc["methods"]["packed"], repeat=max(3, rounds))
            row: dict[str, Any] = {"scenario": sc["name"], "bytes": sc["bytes"]}
            for m, ops in sc["methods"].items():
                med = statistics.median(times[m])
                row[m] = {"descriptors": len(ops), "backend_descriptors": descs[m], "median_s": med,
                          "GBps": sc["bytes"] / med / 1e9, "best_GBps": sc["bytes"] / min(times[m]) / 1e9}
            row["ipc_packed_GBps"] = sc["bytes"] / statistics.median(ipc) / 1e9
            row["packed_over_copy"] = row["packed"]["GBps"] / copy
            rows.append(row)
    finally:
        d.stop()
        p.stop()
    return {"gpus": gpus, "copy_GBps": copy, "copy_rw_GBps": 2 * copy, "split": split, "ucx_tls": p.info["ucx_tls"],
            "mem_type": p.info["mem_type"], "settings": settings, "env": env, "scenarios": rows}


def print_table(result: dict) -> None:
    what = "peer copy GPU 1 -> GPU 0" if result.get("gpus") == 2 else "GPU copy"
    print(f"{what} (1 GiB, one process): {result['copy_GBps']:.0f} GB/s moved ({result['copy_rw_GBps']:.0f} GB/s "
          f"read + write); pools {result['mem_type']}, UCX_TLS={result['ucx_tls']}, settings {result['settings']}, "
          f"env {result['env']}, each READ as {result['split']} transfer request(s)")
    head = (f"{'scenario':38s} {'MB':>7s} | {'packed GB/s (descs)':>20s} | {'per-layer GB/s (descs)':>23s} | "
            f"{'single GB/s':>11s} | {'IPC packed':>10s} | {'packed/copy':>11s}")
    print(head)
    print("-" * len(head))
    for r in result["scenarios"]:
        cell = lambda m: f"{r[m]['GBps']:7.2f} ({r[m]['descriptors']:>5d})"  # noqa: E731
        print(f"{r['scenario']:38s} {r['bytes'] / 1e6:7.1f} | {cell('packed'):>20s} | {cell('per_layer'):>23s} | "
              f"{r['single']['GBps']:11.2f} | {r['ipc_packed_GBps']:10.1f} | {r['packed_over_copy']:11.4f}")
