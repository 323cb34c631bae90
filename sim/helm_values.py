"""A planned cluster as Helm values for deploy/helm/pdcluster, layered over the GB300 values it was planned for.

`helm_values(outcome, ...)` returns a values mapping to pass after `values-gb300-tp8-dcp8.yaml` (`helm install
-f values-gb300-tp8-dcp8.yaml -f plan.yaml`): its `pools` list replaces the base's whole (vLLM pools, as a GB300
rack runs them: `nodesPerInstance` = GPUs per instance / `gpu.perNode`), with the plan's replicas, TP and DCP
sizes, the TP pool's session context (`maxContextTokens`) and the chunked-prefill budget and batch as vLLM's
`--max-num-batched-tokens` / `--max-num-seqs`; the router's session growth setting. The packed-row block size and
the KV latent dtype the plan chose are the reference engine's row layout: vLLM pools keep the base's
`--kv-cache-dtype`, so the file states both in its header and under `plan:` (a key the chart ignores is refused by
its schema, so they are comments) rather than dropping them silently.
"""

from __future__ import annotations

import yaml

MODEL_PATH = "/models/Kimi-K3.1-Pro"


def helm_values(shape, tp_context: int, max_batch: int, gpus_per_node: int = 4) -> dict:  # noqa: ANN001 - Shape
    def pool(name: str, role: str, replicas: int, tp: int, dcp: int, context: int | None) -> dict:
        world = max(tp, dcp)
        entry = {"name": name, "role": role, "replicas": replicas, "tp": tp, "dcp": dcp, "engine": "vllm",
                 "model": MODEL_PATH, "nodesPerInstance": max(1, world // gpus_per_node),
                 "extraArgs": ["--max-num-batched-tokens", str(shape.chunk), "--max-num-seqs", str(max_batch)]}
        if context is not None:
            entry["maxContextTokens"] = context
        return entry

    pools = [pool(f"prefill-tp{shape.prefill_tp}", "prefill", shape.num_prefill, shape.prefill_tp, 1, None)]
    if shape.num_tp8:
        pools.append(pool("decode-tp8", "decode", shape.num_tp8, 8, 1, tp_context))
    if shape.num_dcp8:
        pools.append(pool("decode-dcp8", "decode", shape.num_dcp8, 8, 8, 1048576))
    return {"pools": pools, "router": {"settings": {"session_growth_tokens": 8192}}}


def render_values(outcome, tp_context: int, max_batch: int, objectives: str, profile: str) -> str:  # noqa: ANN001
    shape = outcome.shape
    header = [
        f"# pdcluster plan: {shape.describe()} ({shape.gpus} GPUs), profile {profile}, SLO {objectives}",
        f"# simulated goodput {outcome.goodput_tok_s_per_gpu:.1f} tok/s per GPU, SLO attainment "
        f"{100 * outcome.attainment:.1f}%, " + ", ".join(f"{k} {'-' if v is None else f'{v:.0f} ms'}"
                                                        for k, v in outcome.latencies.items()),
        f"# reference row layout simulated: KV latent {shape.latent}, block size x{shape.block_scale} of the smallest;",
        "# vLLM pools keep the base values' --kv-cache-dtype. Layer over values-gb300-tp8-dcp8.yaml:",
        "#   helm install pdcluster deploy/helm/pdcluster -f values-gb300-tp8-dcp8.yaml -f THIS_FILE",
    ]
    body = yaml.safe_dump(helm_values(shape, tp_context, max_batch), sort_keys=False)
    return "\n".join(header) + "\n" + body
