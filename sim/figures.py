"""GPU profiles fitted to published figures: one NVIDIA H200 (benchmarks/RESULTS.md) and GB300 x 8 (SPEC.md).

`build("h200")` / `build("gb300")` return a profile dict: step costs fitted by least squares to the points marked
`fit=True`, every other point kept as a prediction (`fit` list, measured vs modelled), so the profile says how well
it reproduces figures it was not fitted to. `pdcluster sim calibrate --figures h200|gb300 --out FILE` writes one.

H200, `benchmarks/k31_pro_rank.json` on one GPU (fast kernels, compiled segments, CUDA graphs): decode step
times at (context, batch) and fast+compile prefill times, RESULTS.md 2026-12-03 and 2026-12-04 (afternoon).

GB300 x 8, Kimi K3.1 Pro, TP8 (and DCP8), SPEC.md "Token-sharded prefill" and "Decode context parallelism":
one-request TTFT at 27K / 108K / 340K tokens (token-sharded), TPOT at concurrency 1 at 32K and 128K for TP8 and
DCP8. Fitted: TTFT 27K and 340K, TPOT TP8 32K, DCP8 32K, the cached-prefix append's attention (2K new on 150K
cached: 15 ms, sets the attention-to-cache term). Predicted: TTFT 108K, TPOT TP8 128K, DCP8 128K. Not in
any point, so assumed and stated: how a decode step grows with batch (the H200 pro-rank's per-request cost
relative to its batch-1 step, scaled to the GB300 batch-1 step), TP4 instances (twice the per-token prefill cost
and 1.7x the decode step of TP8: half the GPUs for the same weights and work). The seed's AgentX throughput points
(37.8K tok/s/GPU at ~54 tok/s/user, 19.2K at >100 tok/s/user, 375.9 tok/s single-user) are not reproduced: they
come from AgentX's own workload and speculative decoding (DSpark), neither modelled here (docs/PLANNING.md).
"""

from __future__ import annotations

import numpy as np

from sim.calibrate import nonneg_lstsq

H200_DECODE = (  # (context, batch, ms per step, fit?)  fast+compile+graph, pro-rank, RESULTS.md 2026-12-04 (afternoon)
    (32768, 1, 1.298, True), (32768, 32, 2.278, True), (131072, 32, 2.706, True), (32768, 128, 3.682, True),
    (131072, 1, 1.342, False), (8192, 128, 3.361, False), (131072, 128, 5.020, False),
)
H200_PREFILL = (  # (tokens, seconds, fit?)  pro-rank, RESULTS.md 2026-12-03 (fast A at 4K; fast+compile B otherwise)
    (4096, 0.058, True), (32768, 0.375, True), (131072, 1.801, False),
)
GB300_TTFT = ((27_000, 0.71, True), (108_000, 2.89, False), (340_000, 9.42, True))
"""SPEC.md: measured on 8 GB300, TP8, one request, token-sharded prefill."""
GB300_APPEND = (2_000, 150_000, 0.015)
"""SPEC.md: cached-prefix append (150K cached + 2K new), indexer + sparse MLA 15 ms per GPU with token sharding:
sets `prefill_ctx_s` (attention of new tokens to cached ones)."""
GB300_TPOT = (("tp8", 32_768, 9.35, True), ("tp8", 131_072, 9.45, False), ("dcp8", 32_768, 11.48, True),
              ("dcp8", 131_072, 11.58, False))
"""SPEC.md: TPOT at concurrency 1 (ms)."""
TP4_PREFILL_FACTOR = 2.0
TP4_DECODE_FACTOR = 1.7


def _point(name: str, measured: float, modelled: float, fit: bool, source: str) -> dict:
    return {"name": name, "measured": measured, "modelled": float(modelled), "used_for_fit": fit, "source": source}


def _decode_fit(points) -> tuple[float, float, float]:
    rows = [[1.0, b, b * c] for c, b, _, fit in points if fit]
    y = [ms / 1000 for c, b, ms, fit in points if fit]
    base, seq, ctx = nonneg_lstsq(np.array(rows), np.array(y))
    return float(base), float(seq), float(ctx)


def _prefill_fit(points, base: float) -> tuple[float, float]:
    rows = [[t, t * t / 2] for t, _, fit in points if fit]
    y = [s - base for t, s, fit in points if fit]
    tok, attn = nonneg_lstsq(np.array(rows), np.array(y))
    return float(tok), float(attn)


def h200() -> dict:
    base, seq, ctx = _decode_fit(H200_DECODE)
    tok, attn = _prefill_fit(H200_PREFILL, base)
    fit = [_point(f"decode ctx {c} b{b}", ms / 1000, base + seq * b + ctx * b * c, f, "RESULTS.md 2026-12-04 (afternoon)")
           for c, b, ms, f in H200_DECODE]
    fit += [_point(f"prefill {t}", s, base + tok * t + attn * t * t / 2, f, "RESULTS.md 2026-12-03") for t, s, f in H200_PREFILL]
    return {"name": "h200-pro-rank", "model": "benchmarks/k31_pro_rank.json", "device": "1x NVIDIA H200",
            "template": {"kind": "words", "tokens_per_message": 4},
            "steps": [{"tp": 1, "dcp": 1, "base_s": base, "prefill_token_s": tok, "prefill_attn_s": attn,
                       "decode_seq_s": seq, "decode_ctx_s": ctx}],
            "transfer": {"setup_s": 0.0, "per_descriptor_s": 15e-6, "bytes_per_s": 1.0e12},
            "http": {"router_s": 0.0005, "prefill_leg_s": 0.002, "decode_leg_s": 0.001},
            "sources": ["benchmarks/RESULTS.md 2026-12-04 (afternoon): decode steps, fast+compile+graph, pro-rank",
                        "benchmarks/RESULTS.md 2026-12-03: prefill 4K (fast, run A), 32K and 128K (fast+compile, run B)",
                        "transfer: benchmarks/RESULTS.md 2026-12-01 cuda_ipc, 13-17 us per descriptor, ~1 TB/s single",
                        "http: the router's own work per request (RESULTS.md 2026-12-03 evening); legs assumed 1-2 ms"],
            "fit": fit, "notes": "prefill is fitted with the decode fit's base as its fixed step cost"}


def gb300() -> dict:
    tp8 = {c: ms / 1000 for kind, c, ms, _ in GB300_TPOT if kind == "tp8"}
    dcp8 = {c: ms / 1000 for kind, c, ms, _ in GB300_TPOT if kind == "dcp8"}
    # batch growth: the H200 pro-rank's per-request cost relative to its batch-1 step at 32K
    h_base, h_seq, h_ctx = _decode_fit(H200_DECODE)
    h_b1 = h_base + h_seq + h_ctx * 32768
    seq_share, ctx_share = h_seq / h_b1, h_ctx * 32768 / h_b1

    def decode(b1_32k: float) -> tuple[float, float, float]:
        seq = seq_share * b1_32k
        ctx = ctx_share * b1_32k / 32768
        return b1_32k - seq - ctx * 32768, seq, ctx

    tp_base, tp_seq, tp_ctx = decode(tp8[32768])
    dcp_base, dcp_seq, dcp_ctx = decode(dcp8[32768])
    tok, attn = _prefill_fit(GB300_TTFT, tp_base)
    new, cached, append_s = GB300_APPEND
    append_ctx = append_s / (new * cached)
    fit = [_point(f"TTFT {t} TP8", s, tp_base + tok * t + attn * t * t / 2, f, "SPEC.md token-sharded prefill, 8 GB300")
           for t, s, f in GB300_TTFT]
    for kind, c, ms, f in GB300_TPOT:
        base, seq, ctx = (tp_base, tp_seq, tp_ctx) if kind == "tp8" else (dcp_base, dcp_seq, dcp_ctx)
        fit.append(_point(f"TPOT {c} {kind} c=1", ms / 1000, base + seq + ctx * c, f, "SPEC.md DCP section"))
    fit.append(_point(f"append {new} on {cached} cached: attention", append_s, append_ctx * new * cached, True,
                      "SPEC.md cached-prefix append, indexer + sparse MLA per GPU"))
    step = lambda tp, dcp, base, seq, dctx, ptok=tok, pattn=attn, pctx=append_ctx: {  # noqa: E731
        "tp": tp, "dcp": dcp, "base_s": base, "prefill_token_s": ptok, "prefill_attn_s": pattn,
        "prefill_ctx_s": pctx, "decode_seq_s": seq, "decode_ctx_s": dctx}
    k = TP4_DECODE_FACTOR
    steps = [step(8, 1, tp_base, tp_seq, tp_ctx), step(1, 8, dcp_base, dcp_seq, dcp_ctx),
             step(4, 1, tp_base * k, tp_seq * k, tp_ctx * k, tok * TP4_PREFILL_FACTOR, attn * TP4_PREFILL_FACTOR,
                  append_ctx * TP4_PREFILL_FACTOR)]
    return {"name": "gb300-k31-pro", "model": "kimi-k3.1-pro", "device": "GB300 (8 per instance: TP8 or DCP8; TP4)",
            "gpu": "gb300", "latent": "fp8", "index_key": "fp8",
            "template": {"kind": "words", "tokens_per_message": 4}, "steps": steps,
            "transfer": {"setup_s": 0.0, "per_descriptor_s": 15e-6, "bytes_per_s": 8.0e11},
            "http": {"router_s": 0.0005, "prefill_leg_s": 0.002, "decode_leg_s": 0.001},
            "sources": ["SPEC.md 'Token-sharded prefill': TTFT 27K 0.71 s, 108K 2.89 s, 340K 9.42 s (TP8, one request)",
                        "SPEC.md cached-prefix append (150K cached + 2K new): indexer + sparse MLA 15 ms per GPU",
                        "SPEC.md 'Decode context parallelism': TPOT c=1, 32K TP8 9.35 / DCP8 11.48 ms, 128K 9.45 / 11.58",
                        "batch growth shape: benchmarks/RESULTS.md 2026-12-04 (afternoon) H200 pro-rank decode steps",
                        "transfer: NVLink within the rack, ~800 GB/s per READ; 15 us per descriptor (RESULTS.md cuda_ipc)",
                        "KV rows per instance: kv_transfer/capacity.py (SPEC.md's GB300 capacity figures)"],
            "fit": fit,
            "notes": ("fitted: TTFT 27K, 340K; TPOT TP8 32K, DCP8 32K; the append's attention time. predicted: TTFT 108K, TPOT TP8 128K, DCP8 128K. "
                      f"assumed: batch growth from the H200 shape; TP4 = TP8 x {TP4_PREFILL_FACTOR} (prefill per "
                      f"token) and x {TP4_DECODE_FACTOR} (decode step); the AgentX throughput points are not "
                      "reproduced (their workload and DSpark speculative decoding are not modelled)")}


def build(name: str) -> dict:
    if name == "h200":
        return h200()
    if name == "gb300":
        return gb300()
    raise ValueError(f"--figures must be h200 or gb300, got {name!r}")
