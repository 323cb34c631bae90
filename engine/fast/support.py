"""Which model semantics the fast kernels (engine/fast/) implement: `fast_unsupported(cfg, parallelism)` names
what they lack.

The fast kernels read FP8 latents and FP8 index keys from the pages: a config caching either in fp32 (a
checkpoint's default latent, the exact index scores) is refused. On one rank the fused decoder and prefill follow
the checkpoints' semantics too (rotary MLA and indexer, dense MLA, a full-rank query, the softplus KDA gate, MoE
without a latent, grouped top-k, unnormalised weights: engine/fast/decoder.py's segments); the TP and DCP fast
paths (engine/parallel/fast_*.py) implement the presets' semantics only. A refused config runs the reference
kernels under `auto` (engine/kernels.py); an explicit `fast` is refused with the list.
"""

from __future__ import annotations

from engine.model.config import ModelConfig


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def fast_unsupported(cfg: ModelConfig, parallelism: str = "single") -> str | None:
    """None when the fast kernels compute this config's model under `parallelism` ("single", "tp", "dcp");
    else what they do not implement."""
    formats = (
        (cfg.latent_dtype != "fp8", f"latent_dtype {cfg.latent_dtype}"),
        (cfg.index_key_dtype != "fp8", f"index_key_dtype {cfg.index_key_dtype}"),
        (cfg.num_kda_layers > 0 and cfg.kda_head_dim % 32, f"kda_head_dim {cfg.kda_head_dim} (a multiple of 32)"),
        (not all(_pow2(n) for n in (cfg.kv_lora_rank, cfg.qk_rope_dim, cfg.index_head_dim)),
         f"kv_lora_rank {cfg.kv_lora_rank}, qk_rope_dim {cfg.qk_rope_dim}, index_head_dim {cfg.index_head_dim} "
         "(powers of two)"),
    )
    checks = formats if parallelism == "single" else formats + (
        (cfg.mla_rope != "none", f"mla_rope {cfg.mla_rope}"),
        (cfg.index_rope != "none", f"index_rope {cfg.index_rope}"),
        (not cfg.dsa_indexer, "dense MLA (no DSA indexer)"),
        (cfg.q_lora_rank == 0, "a full-rank query (q_lora_rank 0)"),
        (cfg.kda_gate != "sigmoid", f"kda_gate {cfg.kda_gate}"),
        (cfg.moe_latent_dim == 0, "MoE without a latent (moe_latent_dim 0)"),
        (cfg.num_expert_groups > 1, "grouped top-k routing"),
        (not cfg.moe_renormalize, "unnormalised routing weights"),
    )
    lacks = [what for failed, what in checks if failed]
    if not lacks:
        return None
    where = "" if parallelism == "single" else f" under {parallelism}"
    return f"the fast kernels{where} do not implement {', '.join(lacks)} (model {cfg.name})"
