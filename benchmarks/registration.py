"""What registering each lease's rows with NIXL would cost, next to registering the whole pool once (issue #34).

Today a prefill rank registers its whole row pool once, so a peer that holds the agent metadata can address every
row. The bound the issue asks for registers, per lease, only the lease's rows, hands the reader the partial
metadata of those regions alone, and deregisters them when the lease ends. This measures, with real NIXL (UCX
backend) in one process per side:
- `pool`: one registration of the whole pool (what a rank does at start), and its deregistration;
- per lease, on P: register the lease's rows (scattered rows, adjacent ones merged into one region), build the
  partial metadata of just those regions (`get_partial_agent_metadata`), deregister at the lease's end;
- per lease, on D: load that partial metadata into the reader's agent (`add_remote_agent`), then one READ of the
  lease's rows (so the figure sits next to the transfer it would precede);
- the metadata sizes (full agent metadata vs a lease's partial one).
Medians over `rounds` leases, microseconds. `--device cuda` registers torch CUDA tensors as VRAM.

    python benchmarks/registration.py [--pool-mib 256] [--row-kib 296] [--rows 2,6,34] [--rounds 50] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kv_transfer.ucx_env import nixl_api  # noqa: E402


def _pool(nbytes: int, device: str) -> tuple[Any, int, str, int]:
    """(buffer kept alive, address, NIXL memory type, device id)."""
    if device == "cuda":
        import torch

        buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        return buf, buf.data_ptr(), "VRAM", buf.device.index or 0
    import numpy as np

    buf = np.zeros(nbytes, dtype=np.uint8)
    buf[:] = 1  # touch every page: the registration pins resident memory, as a warmed-up pool's
    return buf, buf.ctypes.data, "DRAM", 0


def _regions(rows: list[int], row_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the rows, adjacent rows merged."""
    out: list[tuple[int, int]] = []
    for r in sorted(rows):
        off = r * row_bytes
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + row_bytes)
        else:
            out.append((off, row_bytes))
    return out


def _agent(api: Any, name: str) -> Any:
    agent = api.nixl_agent(name, api.nixl_agent_config(backends=[]))
    agent.create_backend("UCX", {})
    return agent


def _wait(agent: Any, xfer: Any) -> None:
    state = agent.transfer(xfer)
    while state == "PROC":
        state = agent.check_xfer_state(xfer)
    if state != "DONE":
        raise RuntimeError(f"READ ended {state}")


def measure(pool_bytes: int, row_bytes: int, rows_per_lease: list[int], rounds: int, device: str) -> dict:
    api = nixl_api()
    p_buf, p_base, mem, dev = _pool(pool_bytes, device)
    d_buf, d_base, _, _ = _pool(pool_bytes, device)
    p_agent, d_agent = _agent(api, "reg-P"), _agent(api, "reg-D")
    d_agent.register_memory([(d_base, pool_bytes, dev, "")], mem)
    t0 = time.perf_counter()
    whole = p_agent.register_memory([(p_base, pool_bytes, dev, "")], mem)
    pool_reg_us = (time.perf_counter() - t0) * 1e6
    full_md = len(p_agent.get_agent_metadata())
    t0 = time.perf_counter()
    p_agent.deregister_memory(whole)
    pool_dereg_us = (time.perf_counter() - t0) * 1e6
    empty = api.nixlBind.nixlRegDList(api.nixlBind.VRAM_SEG if mem == "VRAM" else api.nixlBind.DRAM_SEG)
    peer = d_agent.add_remote_agent(p_agent.get_partial_agent_metadata(empty, True, ["UCX"]))
    num_rows = pool_bytes // row_bytes
    rng = random.Random(0)
    out: dict[str, Any] = {"device": device, "pool_bytes": pool_bytes, "row_bytes": row_bytes,
                           "pool_register_us": round(pool_reg_us, 1), "pool_deregister_us": round(pool_dereg_us, 1),
                           "full_metadata_bytes": full_md, "leases": {}}
    for k in rows_per_lease:
        samples: dict[str, list[float]] = {"register_us": [], "partial_metadata_us": [], "deregister_us": [],
                                           "load_metadata_us": [], "read_us": []}
        md_bytes = 0
        for _ in range(rounds):
            rows = rng.sample(range(num_rows), k)
            regions = _regions(rows, row_bytes)
            t0 = time.perf_counter()
            reg = p_agent.register_memory([(p_base + off, length, dev, "") for off, length in regions], mem)
            t1 = time.perf_counter()
            md = p_agent.get_partial_agent_metadata(reg, False, ["UCX"])
            t2 = time.perf_counter()
            d_agent.add_remote_agent(md)
            t3 = time.perf_counter()
            local = d_agent.get_xfer_descs([(d_base + off, length, dev) for off, length in regions], mem)
            remote = d_agent.get_xfer_descs([(p_base + off, length, dev) for off, length in regions], mem)
            xfer = d_agent.initialize_xfer("READ", local, remote, peer, b"")
            _wait(d_agent, xfer)
            d_agent.release_xfer_handle(xfer)
            t4 = time.perf_counter()
            p_agent.deregister_memory(reg)
            t5 = time.perf_counter()
            md_bytes = len(md)
            for key, value in (("register_us", t1 - t0), ("partial_metadata_us", t2 - t1),
                               ("load_metadata_us", t3 - t2), ("read_us", t4 - t3), ("deregister_us", t5 - t4)):
                samples[key].append(value * 1e6)
        out["leases"][k] = {key: round(statistics.median(v), 1) for key, v in samples.items()}
        out["leases"][k]["partial_metadata_bytes"] = md_bytes
        out["leases"][k]["lease_bytes"] = k * row_bytes
    del p_buf, d_buf
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--row-kib", type=int, default=296, help="row size (kimi-k3.1-mini TP1: 296 KiB)")
    ap.add_argument("--rows", default="2,6,34", help="rows per lease (comma-separated)")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    os.environ.setdefault("UCX_TLS", "cuda_ipc,cuda_copy,sm,cma,self,tcp" if args.device == "cuda" else "sm,cma,self,tcp")
    result = measure(args.pool_mib << 20, args.row_kib << 10, [int(x) for x in args.rows.split(",")], args.rounds,
                     args.device)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
