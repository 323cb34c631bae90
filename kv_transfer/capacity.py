"""KV capacity planner: rows, tokens and full contexts that fit one instance's KV budget.

Budget model (per GPU, bytes available to the row pool after weights, activations and workspaces). The
seed figures in SPEC.md fix it for GB300 x 8 running Kimi K3.1 Pro; we infer it from them rather than from
first principles (weights, activation peaks and DCP workspaces are not modelled here):
- TP: `3.04M tokens x 16,992 B/token` -> 51.66 GB per GPU (`GPU_PROFILES["gb300"].kv_budget_tp`);
- DCP=W: `21.8M tokens x 16,992 / 8` -> 46.30 GB per GPU. DCP holds 7.17x (not 8x) TP's tokens because each
  GPU also keeps DCP's gathered-context workspace and top-k merge buffers (about 5.35 GB here).
With those two budgets and the planner's exact per-token bytes, the other seed figures come out within 1%:
NVFP4 latent TP8 4.45M (seed 4.49M), DCP8 31.9M (seed 32.1M) - the seed's NVFP4/FP8 ratio is 1.477, the
byte ratio 16,992 / 11,616 is 1.463. Rows are whole: `rows = budget // row_bytes`, tokens = rows x block size
(under DCP a block of B tokens spans the W GPUs, B/W per GPU). A full context is `max_context` tokens
(2^20 for K3.1 Pro) plus one KDA row per group: `full_contexts = rows / (ceil(max_context / B) + groups)`.
TP8 FP8: 1484 rows / 515 = 2.88 (seed "2.9"). The seed's "about 36" for DCP8 NVFP4+MXFP4 is tokens / 1e6
ignoring KDA rows (36.7); counting whole requests with their KDA state gives 33.5 (reported here).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.layout import RowLayout, plan_layout
from engine.model.config import ModelConfig

GB = 1_000_000_000


@dataclass(frozen=True)
class GPUProfile:
    name: str
    hbm_bytes: int
    kv_budget_tp: int
    """Row-pool bytes per GPU under TP (inferred from SPEC.md's TP8 FP8 3.04M tokens)."""
    kv_budget_dcp: int
    """Row-pool bytes per GPU under DCP (inferred from SPEC.md's DCP8 FP8 21.8M tokens)."""


GPU_PROFILES = {
    "gb300": GPUProfile("gb300", 288 * GB, kv_budget_tp=3_040_000 * 16_992, kv_budget_dcp=21_800_000 * 16_992 // 8),
}


@dataclass(frozen=True)
class CapacityPlan:
    model: str
    gpu: str
    gpus: int
    parallel: str
    latent: str
    index_key: str
    bytes_per_token_per_gpu: int | float
    """a (TP, replicated) or a / W (DCP); an int when whole."""
    attn_bytes_per_token: int
    block_size: int
    tokens_per_row: int
    row_bytes: int
    kda_state_bytes: int
    kda_fill: float
    kv_budget_bytes_per_gpu: int
    rows_per_gpu: int
    tokens_per_instance: int
    max_context: int
    rows_per_full_context: int
    full_contexts: float
    layout_fingerprint: str

    def to_dict(self) -> dict:
        return asdict(self)


def _whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def parse_parallel(text: str) -> tuple[int, int]:
    """'tp8' -> (8, 1); 'dcp8' -> (8, 8) (DCP inside a TP group of the same size)."""
    t = text.lower()
    for prefix, is_dcp in (("dcp", True), ("tp", False)):
        if t.startswith(prefix) and t[len(prefix):].isdigit():
            n = int(t[len(prefix):])
            if n < 1:
                break
            return n, n if is_dcp else 1
    raise ValueError(f"--parallel must look like tp8 or dcp8, got {text!r}")


def plan_capacity(cfg: ModelConfig, gpu: str, gpus: int, parallel: str, latent: str, index_key: str,
                  kv_budget_bytes: int | None = None, block_size: int | None = None) -> CapacityPlan:
    """Capacity of one instance (see the module docstring for the budget model)."""
    if gpu not in GPU_PROFILES:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(sorted(GPU_PROFILES))}")
    tp, dcp = parse_parallel(parallel)
    if gpus != tp:
        raise ValueError(f"--gpus {gpus} does not match --parallel {parallel} ({tp} GPUs per instance)")
    lay: RowLayout = plan_layout(cfg, tp_size=tp, dcp_size=dcp, latent_format=latent, index_key_format=index_key,
                                 block_size=block_size)
    prof = GPU_PROFILES[gpu]
    budget = kv_budget_bytes if kv_budget_bytes is not None else (prof.kv_budget_dcp if dcp > 1 else prof.kv_budget_tp)
    if budget <= 0:
        raise ValueError(f"KV budget must be positive, got {budget}")
    rows = budget // lay.row_bytes
    per_ctx = -(-cfg.max_context // lay.block_size) + lay.kda_groups
    return CapacityPlan(
        model=cfg.name, gpu=gpu, gpus=gpus, parallel=parallel.lower(), latent=latent, index_key=index_key,
        bytes_per_token_per_gpu=_whole(lay.bytes_per_token_per_gpu), attn_bytes_per_token=lay.attn_bytes_per_token,
        block_size=lay.block_size,
        tokens_per_row=lay.tokens_per_row, row_bytes=lay.row_bytes, kda_state_bytes=lay.kda_state_bytes,
        kda_fill=round(lay.kda_fill, 4), kv_budget_bytes_per_gpu=budget, rows_per_gpu=rows,
        tokens_per_instance=rows * lay.block_size, max_context=cfg.max_context, rows_per_full_context=per_ctx,
        full_contexts=round(rows / per_ctx, 2), layout_fingerprint=lay.fingerprint,
    )
