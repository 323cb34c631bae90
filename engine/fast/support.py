"""Which model semantics the fast kernels (engine/fast/) implement: `fast_unsupported(cfg)` names what they lack.

The fused decoder and prefill are written for the K3.1 presets' numerics: NoPE MLA with the DSA indexer on FP8
latents and FP8 index keys, a low-rank query, the sigmoid-bounded KDA gate and the latent MoE with plain top-k.
A config that departs from any of these (a kimi_linear or deepseek_v32 checkpoint) is refused with the list, and
the engine's `auto` kernels fall back to the reference set (engine/kernels.py).
"""

from __future__ import annotations

from engine.model.config import ModelConfig


def fast_unsupported(cfg: ModelConfig) -> str | None:
    """None when the fast kernels compute this config's model; else what they do not implement."""
    lacks = []
    checks = (
        (cfg.mla_rope != "none", f"mla_rope {cfg.mla_rope}"),
        (cfg.index_rope != "none", f"index_rope {cfg.index_rope}"),
        (not cfg.dsa_indexer, "dense MLA (no DSA indexer)"),
        (cfg.q_lora_rank == 0, "a full-rank query (q_lora_rank 0)"),
        (cfg.kda_gate != "sigmoid", f"kda_gate {cfg.kda_gate}"),
        (cfg.moe_latent_dim == 0, "MoE without a latent (moe_latent_dim 0)"),
        (cfg.num_expert_groups > 1, "grouped top-k routing"),
        (not cfg.moe_renormalize, "unnormalised routing weights"),
        (cfg.latent_dtype != "fp8", f"latent_dtype {cfg.latent_dtype}"),
        (cfg.index_key_dtype != "fp8", f"index_key_dtype {cfg.index_key_dtype}"),
    )
    lacks = [what for failed, what in checks if failed]
    if not lacks:
        return None
    return f"the fast kernels do not implement {', '.join(lacks)} (model {cfg.name})"
