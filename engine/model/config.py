"""ModelConfig: every shape of the K3.1-style hybrid model, with named presets and JSON load/save.

The layer schedule is 1-based like the K3 checkpoints: `kda_layers` and `mla_layers` partition 1..num_layers.
Every MLA layer carries a DSA indexer. `kimi-k3.1-pro` holds the full shapes for layout and capacity math only;
it is never instantiated. `kimi-k3.1-mini` keeps every structural feature at CPU size.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


ROPE_STYLES = ("none", "interleaved", "half")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one model. Field docs say what each one sizes."""

    name: str = "custom"
    """Preset or model name; reported as the served model id (a checkpoint: the directory as given, see
    `resolve_model`)."""
    checkpoint: str | None = None
    """Checkpoint directory the weights (and the tokenizer) are read from; None: seeded random weights
    (engine/model/weights.py). Set by `resolve_model` for a directory; engine/model/checkpoint.py reads it."""
    vocab_size: int = 1024
    """Token ids 0..vocab_size-1 (the byte tokenizer uses 256 bytes + specials; the rest are unused)."""
    d_model: int = 256
    """Hidden size."""
    num_layers: int = 8
    """Total decoder layers."""
    kda_layers: tuple[int, ...] = (1, 2, 3, 5, 6, 7)
    """1-based indices of KDA (linear attention) layers."""
    mla_layers: tuple[int, ...] = (4, 8)
    """1-based indices of MLA + DSA indexer layers."""
    max_context: int = 32768
    """Longest prompt + output a request may have, in tokens."""
    rms_eps: float = 1e-6
    """RMSNorm epsilon."""

    # MLA
    num_heads: int = 4
    """MLA query heads (H)."""
    q_lora_rank: int = 128
    """Query low-rank latent (also the indexer's query input); 0: one full-rank query projection (Kimi-Linear)."""
    kv_lora_rank: int = 64
    """Compressed KV latent c (d_c); cached per token."""
    qk_nope_dim: int = 32
    """Per-head query/key dims that meet the latent through W_UK."""
    qk_rope_dim: int = 16
    """Per-head dims of the shared key part k^R, cached beside c. Left unrotated (NoPE, as in K3.1 Pro)."""
    v_head_dim: int = 32
    """Per-head value dims."""
    mla_output_gate: bool = True
    """Sigmoid output gate per head dim (K3's mla_use_output_gate)."""
    mla_rope: str = "none"
    """Rotary embedding of q^R / k^R: "none" (NoPE, K3.1 and Kimi-Linear), "interleaved" (pairs (x0, x1), ...:
    DeepSeek's MLA) or "half" (pairs (x_i, x_{i + r/2}))."""
    rope_theta: float = 10000.0
    """Rotary base of every rotary embedding of the model (MLA and indexer)."""
    rope_factor: float = 1.0
    """YaRN context extension factor of the rotary embeddings (1: plain RoPE; engine/model/numerics.Rotary)."""
    rope_original_context: int = 4096
    """YaRN: the context the model was pretrained at."""
    rope_beta_fast: float = 32.0
    """YaRN: rotations over the original context below which a dim is interpolated..."""
    rope_beta_slow: float = 1.0
    """...and above which (of this many) it is extrapolated; linear in between."""
    rope_mscale: float = 1.0
    """YaRN: cos and sin are scaled by mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim)."""
    rope_mscale_all_dim: float = 0.0
    """YaRN: the MLA softmax scale is multiplied by mscale(factor, this)^2 (0: not)."""

    # DSA indexer
    dsa_indexer: bool = True
    """MLA layers select keys with the DSA indexer; False: every earlier key (dense MLA, Kimi-Linear)."""
    index_num_heads: int = 4
    """Indexer light heads (H_I)."""
    index_head_dim: int = 64
    """Indexer head dims (d_I); one cached FP8 key of this size per token."""
    index_topk: int = 256
    """Tokens each query attends to (k)."""
    index_rope: str = "none"
    """Rotary embedding of the indexer's first qk_rope_dim query/key dims: "none", "half" (DeepSeek-V3.2's
    indexer) or "interleaved"."""
    index_norm_eps: float = 1e-5
    """Epsilon of the indexer's key LayerNorm."""

    # KDA
    kda_num_heads: int = 4
    """KDA heads; sharded by TP."""
    kda_head_dim: int = 64
    """d_k = d_v of each KDA head."""
    kda_conv_size: int = 4
    """Short causal depthwise conv width (state keeps conv_size - 1 inputs per channel)."""
    kda_gate: str = "sigmoid"
    """Log-decay gate: "sigmoid" (K3: g = lb * sigmoid(exp(A_log) * (f + dt_bias)), in (lb, 0)) or "softplus"
    (Kimi-Linear: g = -exp(A_log) * softplus(f + dt_bias))."""
    kda_gate_lower_bound: float = -5.0
    """K3 gate lower bound: g = lb * sigmoid(...), in (lb, 0) (kda_gate "sigmoid" only)."""
    kda_chunk_size: int = 64
    """Chunk length of the chunked form (`kda.kda_chunked`, anchored at position 0). The reference engine's prefill
    runs KDA token by token (`kda.kda_sequential`) so that prefill and decode agree bit for bit."""
    kda_state_groups: int = 2
    """KDA layers are grouped for the packed cache: one row per group per request."""

    # MoE
    num_experts: int = 16
    """Routed experts."""
    num_experts_per_tok: int = 4
    """Experts chosen per token (top-k)."""
    num_shared_experts: int = 1
    """Always-on shared experts."""
    moe_latent_dim: int = 128
    """Latent MoE: tokens are projected d_model -> latent before the routed experts; 0: experts run on d_model
    (Kimi-Linear, DeepSeek)."""
    moe_intermediate: int = 64
    """Routed expert intermediate size."""
    shared_intermediate: int = 128
    """Shared expert intermediate size (total)."""
    first_dense_layers: int = 1
    """Leading layers with a dense SiLU-GLU MLP instead of MoE."""
    dense_intermediate: int = 512
    """Intermediate size of the dense MLP."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the renormalised routed weights."""
    moe_renormalize: bool = True
    """Divide the chosen experts' scores by their sum before scaling (norm_topk_prob)."""
    num_expert_groups: int = 1
    """Grouped top-k: experts form this many equal groups; a group's score is the sum of its best two biased
    scores, and only the `topk_groups` best groups may be chosen (1: plain top-k)."""
    topk_groups: int = 1
    """Groups kept by grouped top-k."""
    tie_embeddings: bool = False
    """The LM head reuses the embedding matrix."""

    # numerics of the cache
    latent_dtype: str = "fp8"
    """Cached latent format: fp8 (1 B/value, per-tensor scale), fp32 (exact) or nvfp4 (planner only)."""
    index_key_dtype: str = "fp8"
    """Cached index-key format: fp8 (1 B/value + 4 B scale per 128 dims, Hadamard-rotated queries and keys),
    fp32 (exact scoring: the indexer's own math, no rotation, no rounding), or mxfp4 (planner only)."""
    ssm_state_bytes: int = 4
    """Bytes per KDA recurrent-state value (fp32)."""
    conv_state_bytes: int = 4
    """Bytes per KDA conv-state value (model dtype; fp32 in the reference, bf16 in K3)."""
    latent_fp8_scale: float = 0.03125
    """Static per-tensor FP8 scale of the cached latent (a power of two, so scaling is exact)."""
    init_std_scale: float = 1.0
    """Random init: weights ~ N(0, (init_std_scale / sqrt(fan_in))^2)."""

    eos_token_id: int = 257
    """End-of-sequence token."""
    bos_token_id: int = 256
    """Beginning-of-sequence token."""

    @property
    def latent_dim(self) -> int:
        """Cached latent width per token: kv_lora_rank + qk_rope_dim."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def latent_value_bytes(self) -> int:
        """Bytes of one cached latent value (fp8: 1, fp32: 4)."""
        return 4 if self.latent_dtype == "fp32" else 1

    @property
    def index_key_value_bytes(self) -> int:
        """Bytes of one token's cached index-key values (without its 4-byte scale)."""
        return self.index_head_dim * (4 if self.index_key_dtype == "fp32" else 1)

    def validate(self) -> "ModelConfig":
        layers = sorted(self.kda_layers + self.mla_layers)
        if layers != list(range(1, self.num_layers + 1)):
            raise ValueError(f"kda_layers + mla_layers must partition 1..{self.num_layers}, got {layers}")
        if self.num_kda_layers % self.kda_state_groups:
            raise ValueError(f"{self.num_kda_layers} KDA layers do not split into {self.kda_state_groups} groups")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok exceeds num_experts")
        for field, value, known in (("mla_rope", self.mla_rope, ROPE_STYLES), ("index_rope", self.index_rope, ROPE_STYLES),
                                    ("kda_gate", self.kda_gate, ("sigmoid", "softplus"))):
            if value not in known:
                raise ValueError(f"{field} {value!r} is not one of {', '.join(known)}")
        if self.q_lora_rank == 0 and self.dsa_indexer:
            raise ValueError("the DSA indexer reads the query latent: q_lora_rank 0 needs dsa_indexer false")
        if self.num_experts % self.num_expert_groups or not 1 <= self.topk_groups <= self.num_expert_groups:
            raise ValueError(f"{self.num_experts} experts in {self.num_expert_groups} groups keeping "
                             f"{self.topk_groups}: groups must divide the experts and 1 <= topk_groups <= groups")
        if self.num_expert_groups > 1 and self.num_experts // self.num_expert_groups < 2:
            raise ValueError("grouped top-k scores a group by its best two experts: groups need >= 2 experts")
        return self

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        raw = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {unknown}")
        for key in ("kda_layers", "mla_layers"):
            if key in raw:
                raw[key] = tuple(raw[key])
        return cls(**raw).validate()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        return cls.from_json(Path(path).read_text())


def _mini() -> ModelConfig:
    return ModelConfig(name="kimi-k3.1-mini").validate()


def _pro() -> ModelConfig:
    mla = tuple(range(4, 93, 4)) + (93,)  # 23 + 1 = 24 MLA+DSA layers
    kda = tuple(i for i in range(1, 94) if i not in mla)  # 69 KDA layers
    return ModelConfig(
        name="kimi-k3.1-pro",
        vocab_size=163840,
        d_model=7168,
        num_layers=93,
        kda_layers=kda,
        mla_layers=mla,
        max_context=1 << 20,
        num_heads=96,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        index_num_heads=32,
        index_head_dim=128,
        index_topk=2048,
        kda_num_heads=96,
        kda_head_dim=128,
        kda_conv_size=4,
        kda_state_groups=3,
        num_experts=896,
        num_experts_per_tok=16,
        num_shared_experts=1,
        moe_latent_dim=3584,
        moe_intermediate=3072,
        shared_intermediate=6144,
        first_dense_layers=1,
        dense_intermediate=33792,
        conv_state_bytes=2,
        eos_token_id=163586,
        bos_token_id=163584,
    ).validate()


PRESETS = {"kimi-k3.1-mini": _mini, "kimi-k3.1-pro": _pro}


def resolve_model(name: str, exact_index_scores: bool = False) -> ModelConfig:
    """What `--model` names, everywhere a model is named: a preset name, a ModelConfig JSON file (`*.json`), or a
    checkpoint directory (holding config.json; engine/model/checkpoint.py reads it). A checkpoint's config has
    `checkpoint` set to the directory and `name` (the served model id) to the directory as given, trailing
    slashes removed, as vLLM serves a path. `exact_index_scores` (EngineConfig's): fp32 index keys."""
    if Path(name).is_dir():
        from engine.model.checkpoint import checkpoint_config

        cfg = checkpoint_config(name)
    elif name.endswith(".json"):
        cfg = ModelConfig.load(name)
    else:
        cfg = get_preset(name)
    return dataclasses.replace(cfg, index_key_dtype="fp32") if exact_index_scores else cfg


def preset_or_file(name: str) -> ModelConfig:
    """Alias of `resolve_model` (the benchmarks' name for it)."""
    return resolve_model(name)


def get_preset(name: str) -> ModelConfig:
    """The named preset; a clear error listing the known names otherwise."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))} (or a "
                         "ModelConfig .json file, or a checkpoint directory)") from None
