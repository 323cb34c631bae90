"""Checkpoint tensor names -> engine parameters, per dialect: the plan engine/model/loader.py executes.

Layouts mapped (engine parameter <- checkpoint tensor; `L` = `model.layers.{i}.`):
- both public dialects: embed <- model.embed_tokens.weight; lm_head <- lm_head.weight (or the embedding when
  tie_word_embeddings); final_norm <- model.norm; mixer_norm / ffn_norm <- L input_layernorm /
  post_attention_layernorm.
- MLA (L self_attn.): wq_a, q_norm, wq_b <- q_a_proj, q_a_layernorm, q_b_proj (q_lora_rank 0: wq_b <- q_proj);
  wkv_a, kv_norm, wkv_b, wo <- kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; the DSA indexer's wq, wk,
  k_norm, w_proj <- indexer.wq_b, indexer.wk, indexer.k_norm, indexer.weights_proj.
- KDA (Kimi-Linear, L self_attn.): w_qkv rows [q | k | v] <- q_proj, k_proj, v_proj; conv_weight rows <-
  q_conv1d, k_conv1d, v_conv1d ([C, 1, W] -> [C, W]); w_fa, w_fb, w_b, o_norm, wo <- f_a_proj, f_b_proj, b_proj,
  o_norm, o_proj; A_log [1, 1, H, 1] -> [H]; dt_bias. The low-rank output gate g_b_proj @ g_a_proj is folded into
  one w_g [H*d, d_model] (computed in float64, rounded once).
- FFN (L mlp. or L block_sparse_moe.): dense gate_proj / up_proj / down_proj -> w_gate / w_up / w_down; MoE
  gate.weight -> router, gate.e_score_correction_bias -> correction_bias, experts.{e}. (gate_proj | w1) -> w1[e],
  (up_proj | w3) -> w3[e], (down_proj | w2) -> w2[e], shared_experts.* -> shared.*.
- pdcluster_k3: the engine's own names, one to one (what `save_checkpoint` writes).
"""

from __future__ import annotations

import torch

from engine.model.config import ModelConfig
from engine.model.loader import Piece, TensorEntry
from engine.model.model import KimiModel
from engine.model.moe import MoE


def engine_pieces(model: KimiModel) -> list[Piece]:
    """Our dialect: every parameter from the tensor of the same name."""
    return [Piece(name, (name,)) for name, _ in model.named_parameters()]


def _fold(g_b: torch.Tensor, g_a: torch.Tensor) -> torch.Tensor:
    return (g_b.double() @ g_a.double()).float()


def public_pieces(model: KimiModel, entries: dict[str, TensorEntry]) -> list[Piece]:
    """kimi_linear / deepseek_v32 names (module docstring)."""
    cfg = model.cfg
    tied = cfg.tie_embeddings and "lm_head.weight" not in entries  # a tied checkpoint may still store the head
    pieces = [Piece("embed", ("model.embed_tokens.weight",)), Piece("final_norm.weight", ("model.norm.weight",)),
              Piece("lm_head.weight", ("model.embed_tokens.weight" if tied else "lm_head.weight",))]
    for i, layer in enumerate(model.layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        pieces += [Piece(dst + "mixer_norm.weight", (src + "input_layernorm.weight",)),
                   Piece(dst + "ffn_norm.weight", (src + "post_attention_layernorm.weight",))]
        attn = src + "self_attn."
        pieces += (_mla(cfg, attn, dst + "mixer.") if layer.is_mla else _kda(cfg, attn, dst + "mixer."))
        ffn = src + "mlp." if any(n.startswith(src + "mlp.") for n in entries) else src + "block_sparse_moe."
        pieces += _ffn(cfg, isinstance(layer.ffn, MoE), ffn, dst + "ffn.", entries)
    return pieces


def _mla(cfg: ModelConfig, src: str, dst: str) -> list[Piece]:
    pieces = [Piece(dst + "wkv_a.weight", (src + "kv_a_proj_with_mqa.weight",)),
              Piece(dst + "kv_norm.weight", (src + "kv_a_layernorm.weight",)),
              Piece(dst + "wkv_b", (src + "kv_b_proj.weight",)), Piece(dst + "wo.weight", (src + "o_proj.weight",))]
    if cfg.q_lora_rank:
        pieces += [Piece(dst + "wq_a.weight", (src + "q_a_proj.weight",)),
                   Piece(dst + "q_norm.weight", (src + "q_a_layernorm.weight",)),
                   Piece(dst + "wq_b.weight", (src + "q_b_proj.weight",))]
    else:
        pieces.append(Piece(dst + "wq_b.weight", (src + "q_proj.weight",)))
    if cfg.dsa_indexer:
        idx, out = src + "indexer.", dst + "indexer."
        pieces += [Piece(out + "wq.weight", (idx + "wq_b.weight",)), Piece(out + "wk.weight", (idx + "wk.weight",)),
                   Piece(out + "k_norm.weight", (idx + "k_norm.weight",)),
                   Piece(out + "k_norm.bias", (idx + "k_norm.bias",)),
                   Piece(out + "w_proj.weight", (idx + "weights_proj.weight",))]
    return pieces


def _kda(cfg: ModelConfig, src: str, dst: str) -> list[Piece]:
    width = cfg.kda_num_heads * cfg.kda_head_dim
    pieces = []
    for j, part in enumerate("qkv"):
        rows = (slice(j * width, (j + 1) * width),)
        pieces += [Piece(dst + "w_qkv.weight", (f"{src}{part}_proj.weight",), rows),
                   Piece(dst + "conv_weight", (f"{src}{part}_conv1d.weight",), rows)]
    return pieces + [
        Piece(dst + "w_fa.weight", (src + "f_a_proj.weight",)), Piece(dst + "w_fb.weight", (src + "f_b_proj.weight",)),
        Piece(dst + "A_log", (src + "A_log",)), Piece(dst + "dt_bias", (src + "dt_bias",)),
        Piece(dst + "w_b.weight", (src + "b_proj.weight",)), Piece(dst + "o_norm", (src + "o_norm.weight",)),
        Piece(dst + "wo.weight", (src + "o_proj.weight",)),
        Piece(dst + "w_g.weight", (src + "g_b_proj.weight", src + "g_a_proj.weight"), combine=_fold),
    ]


def _ffn(cfg: ModelConfig, is_moe: bool, src: str, dst: str, entries: dict[str, TensorEntry]) -> list[Piece]:
    if not is_moe:
        return [Piece(dst + "w_gate.weight", (src + "gate_proj.weight",)),
                Piece(dst + "w_up.weight", (src + "up_proj.weight",)),
                Piece(dst + "w_down.weight", (src + "down_proj.weight",))]
    pieces = [Piece(dst + "router.weight", (src + "gate.weight",)),
              Piece(dst + "correction_bias", (src + "gate.e_score_correction_bias",))]
    kimi_names = f"{src}experts.0.w1.weight" in entries
    names = ("w1", "w3", "w2") if kimi_names else ("gate_proj", "up_proj", "down_proj")
    for e in range(cfg.num_experts):
        for param, name in zip(("w1", "w3", "w2"), names):
            pieces.append(Piece(f"{dst}{param}", (f"{src}experts.{e}.{name}.weight",), (e,)))
    if cfg.num_shared_experts:
        for param, name in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            pieces.append(Piece(f"{dst}shared.{param}.weight", (f"{src}shared_experts.{name}.weight",)))
    return pieces


def mtp_tensors(entries: dict[str, TensorEntry], num_layers: int, num_nextn: int) -> set[str]:
    """Names of the multi-token-prediction layers (model.layers.{num_layers + j}.*, j < num_nextn)."""
    skipped = set()
    for name in entries:
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
            if num_layers <= int(parts[2]) < num_layers + num_nextn:
                skipped.add(name)
    return skipped
