"""Prefill time on one GPU, fast path vs reference path, against the bf16 matmul peak (used by
`benchmarks/engine.py --device cuda --prefill-lengths ...`).

Per (config, prompt length T) cell, for each kernel set asked for:
- fast: `engine.fast.prefill.FastPrefiller` of one T-token request into a packed row pool in GPU memory
  (plan_layout of the config, KDA rows zeroed); one untimed warm-up prefill of the same length (Triton compiles,
  fla's autotuning), then the median of `repeats` timed prefills.
- fast+compile: the same with the decoder's torch segments through torch.compile (`FastDecoder(compile=True)`;
  the warm-up includes the compilation).
- reference: `KimiModel.prefill` (fp32, float64 indexer dots, token-by-token KDA kernel) into a
  `LocalSequenceCache` on the GPU (the row pool refuses the bf16 conv state of the scaled configs), one timed
  run after a 256-token warm-up; skipped above `ref_max_tokens` (printed).
FLOPs a prefill must do (`prefill_flops`): 2 x T x (every token-wise weight matrix except the LM head + k routed
experts per MoE layer) + the LM head of the last token; per DSA layer the indexer's causal scores
2 H_I d_I T (T + 1) / 2 and the sparse MLA's 2 H sum_t min(k, t + 1) (kv_lora + rope + kv_lora) (absorbed form:
scores over [c | k^R], values over c); per KDA layer 8 H d^2 per token (the recurrent form's count; the chunked
form does more). Bytes (`prefill_bytes`): every bf16 weight once (all experts), the cache entries written
(T x attention bytes per token) and each KDA layer's state read and written. The fraction of the bf16 peak divides
FLOPs / time by the 8192^3 bf16 GEMM rate measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from engine.fast.decoder import FastDecoder
from engine.fast.prefill import FastPrefiller
from engine.layout import RowLayout, plan_layout
from engine.model.config import ModelConfig
from engine.model.numerics import device_scope
from engine.model.state import LocalSequenceCache

BF16_BYTES = 2


@dataclass(frozen=True)
class PrefillCell:
    model: str
    tokens: int
    kernels: str
    seconds: float
    bytes_moved: float
    flops: float

    def matmul_fraction(self, tflops: float) -> float:
        return self.flops / self.seconds / (tflops * 1e12)

    def hbm_fraction(self, copy_gbps: float) -> float:
        return self.bytes_moved / self.seconds / (copy_gbps * 1e9)


def _token_params(cfg: ModelConfig, model) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(parameters every token multiplies, outside the routed experts, the embedding and the LM head;
    parameters of one routed expert)."""
    per_token = 0
    for name, p in model.named_parameters():
        if p.dim() >= 2 and name not in ("embed", "lm_head.weight") and not name.endswith((".w1", ".w2", ".w3")):
            per_token += p.numel()
    return per_token, 3 * cfg.moe_latent_dim * cfg.moe_intermediate


def prefill_flops(cfg: ModelConfig, model, tokens: int) -> float:  # type: ignore[no-untyped-def]
    per_token, expert = _token_params(cfg, model)
    moe_layers = cfg.num_layers - cfg.first_dense_layers
    gemm = 2 * tokens * (per_token + moe_layers * cfg.num_experts_per_tok * expert) + 2 * cfg.vocab_size * cfg.d_model
    k = cfg.index_topk
    attended = tokens * (tokens + 1) // 2 if tokens <= k else k * (k + 1) // 2 + (tokens - k) * k
    index = 2 * cfg.index_num_heads * cfg.index_head_dim * tokens * (tokens + 1) // 2
    mla = 2 * cfg.num_heads * attended * (cfg.latent_dim + cfg.kv_lora_rank)
    kda = 8 * tokens * cfg.kda_num_heads * cfg.kda_head_dim**2
    return float(gemm + cfg.num_mla_layers * (index + mla) + cfg.num_kda_layers * kda)


def prefill_bytes(cfg: ModelConfig, layout: RowLayout, model, tokens: int) -> float:  # type: ignore[no-untyped-def]
    weights = sum(p.numel() for name, p in model.named_parameters() if p.dim() >= 2 and name != "embed")
    kda = cfg.num_kda_layers * 2 * layout.kda_heads_per_gpu * (layout.kda_recurrent_bytes + layout.kda_conv_bytes)
    return float(BF16_BYTES * (weights + tokens * cfg.d_model) + tokens * layout.attn_bytes_per_token + kda)


def time_fast(cfg: ModelConfig, prefiller: FastPrefiller, tokens: int, repeats: int, device: torch.device) -> float:
    layout = prefiller.layout
    num_attn, num_kda = layout.rows_per_request(tokens)
    buffer = torch.zeros(num_attn + num_kda, layout.row_bytes, dtype=torch.uint8, device=device)
    attn, kda = list(range(num_attn)), list(range(num_attn, num_attn + num_kda))
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=device, generator=None)
    times = []
    for run in range(repeats + 1):
        buffer[num_attn:] = 0  # a fresh request's KDA state
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        prefiller.prefill(buffer, ids, attn, kda)
        torch.cuda.synchronize(device)
        if run:
            times.append(time.perf_counter() - start)
    del buffer
    return statistics.median(times)


def time_reference(cfg: ModelConfig, model, tokens: int, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    with device_scope(device), torch.no_grad():
        model.prefill(torch.randint(0, cfg.vocab_size, (256,)), LocalSequenceCache(cfg, 256))
        cache = LocalSequenceCache(cfg, tokens)
        ids = torch.randint(0, cfg.vocab_size, (tokens,))
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        model.prefill(ids, cache)
        torch.cuda.synchronize(device)
        return time.perf_counter() - start


def run_prefill_cells(cfg: ModelConfig, model, lengths: list[int], kernels: list[str], repeats: int,  # type: ignore[no-untyped-def]
                      ref_max_tokens: int, device: torch.device, log,
                      compile_segments: bool = True) -> list[PrefillCell]:
    layout = plan_layout(cfg)
    prefillers = {}
    if "fast" in kernels:
        prefillers["fast"] = FastPrefiller(model, layout)
        if compile_segments:
            prefillers["fast+compile"] = FastPrefiller(model, layout, decoder=FastDecoder(model, layout, compile=True))
    kinds = [k for k in kernels if k != "fast"] + list(prefillers)
    cells = []
    for tokens in lengths:
        nbytes, flops = prefill_bytes(cfg, layout, model, tokens), prefill_flops(cfg, model, tokens)
        for kind in kinds:
            if kind == "reference" and tokens > ref_max_tokens:
                log(f"{cfg.name} prefill {tokens}: reference skipped (over --ref-max-prefill {ref_max_tokens}: "
                    "its float64 indexer and gathered fp32 latents take minutes at this length)")
                continue
            try:
                seconds = (time_fast(cfg, prefillers[kind], tokens, repeats, device) if kind in prefillers
                           else time_reference(cfg, model, tokens, device))
            except (RuntimeError, torch.OutOfMemoryError) as exc:  # one failed cell must not lose the others
                log(f"{cfg.name} prefill {tokens} {kind} failed: {exc!r}")
                seconds = float("nan")
            cells.append(PrefillCell(cfg.name, tokens, kind, seconds, nbytes, flops))
            log(f"{cfg.name} prefill {tokens} {kind}: {seconds:.3f} s")
            torch.cuda.empty_cache()
    return cells


def print_prefill_table(cells: list[PrefillCell], copy_gbps: float, tflops: float) -> list[dict]:
    """Print the markdown table and return the rows for the JSON."""
    ref = {(c.model, c.tokens): c.seconds for c in cells if c.kernels == "reference"}
    print("| model | prompt tokens | kernels | seconds | tokens/s | GB moved | TFLOP | bf16 peak | HBM roofline | "
          "speed-up vs reference |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for c in cells:
        base = ref.get((c.model, c.tokens))
        speedup = base / c.seconds if base is not None and c.kernels != "reference" else None
        rows.append({"model": c.model, "tokens": c.tokens, "kernels": c.kernels, "seconds": round(c.seconds, 4),
                     "bytes": c.bytes_moved, "flops": c.flops,
                     "bf16_peak_fraction": round(c.matmul_fraction(tflops), 4),
                     "hbm_roofline_fraction": round(c.hbm_fraction(copy_gbps), 4),
                     "speedup_vs_reference": None if speedup is None else round(speedup, 1)})
        print(f"| {c.model} | {c.tokens} | {c.kernels} | {c.seconds:.3f} | {c.tokens / c.seconds:,.0f} | "
              f"{c.bytes_moved / 1e9:.2f} | {c.flops / 1e12:.1f} | {c.matmul_fraction(tflops):.1%} | "
              f"{c.hbm_fraction(copy_gbps):.1%} | {'' if speedup is None else f'{speedup:.1f}x'} |")
    return rows
