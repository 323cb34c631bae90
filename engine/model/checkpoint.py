"""Checkpoint directories: config.json -> ModelConfig for the dialects we read, and the weights' fingerprint.

A checkpoint directory holds `config.json` and safetensors weights (`model.safetensors`, or shards listed by
`model.safetensors.index.json`); engine/model/loader.py maps the tensors onto the engine. Dialects (docs/CHECKPOINTS.md):
- `kimi_linear` (Kimi-Linear: KDA + dense NoPE MLA + MoE), as transformers' KimiLinearConfig saves it or as
  Moonshot's original config spells it (`linear_attn_config`, `first_k_dense_replace`, ...);
- `deepseek_v32` (DeepSeek-V3.2: MLA with interleaved RoPE + the DSA indexer with half-split RoPE + MoE);
- `pdcluster_k3` (ours): every ModelConfig field by name (the K3.1 presets as files), engine tensor names.
Every key of config.json is used, checked against the one value we support, or listed as metadata (`_METADATA`);
anything else is refused by name, so no setting is silently dropped.

Identity: `weights_fingerprint(cfg, seed)` names the weights a node serves: a checkpoint's is a hash of its
config.json and its safetensors headers and sizes (cheap: no tensor bytes are read); a preset's is its name and seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

from engine.model.config import ModelConfig

OUR_MODEL_TYPE = "pdcluster_k3"
MODEL_TYPES = ("kimi_linear", "deepseek_v32", OUR_MODEL_TYPE)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_METADATA = {
    "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "initializer_range", "use_cache",
    "output_router_logits", "pad_token_id", "attention_dropout", "pretraining_tp", "model_type", "qk_head_dim",
    "head_dim", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "tokenizer_class", "quantization_config",
    "num_nextn_predict_layers", "moe_layer_freq", "ep_size", "topk_method", "scoring_func", "kv_channels",
    "moe_router_activation_func", "use_grouped_topk", "mla_use_nope", "max_position_embeddings", "model_max_length",
    "num_key_value_heads", "attention_bias", "mlp_bias", "hidden_act", "rope_parameters", "rope_scaling",
    "rope_theta", "layer_types", "mlp_layer_types", "first_k_dense_replace", "linear_attn_config",
    "tie_word_embeddings", "bos_token_id", "eos_token_id", "vocab_size", "hidden_size", "intermediate_size",
    "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rms_norm_eps", "routed_scaling_factor",
    "index_topk", "index_head_dim", "index_n_heads", "linear_head_dim", "linear_num_heads",
    "linear_conv_kernel_dim", "n_group", "topk_group", "num_expert_group", "norm_topk_prob", "moe_renormalize",
    "n_shared_experts", "num_shared_experts", "n_routed_experts", "num_experts", "num_local_experts",
    "num_experts_per_tok", "num_experts_per_token", "generation_config", "is_encoder_decoder",
}
"""Keys a config.json may carry: the ones read below, plus metadata with no effect on the forward pass."""


class CheckpointError(ValueError):
    """A checkpoint we refuse: the message names the file and the field or tensor."""


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json (a checkpoint directory holds config.json and "
                              "safetensors weights)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return raw


def checkpoint_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (`name`: the directory as given, `checkpoint`: its path)."""
    given = str(directory).rstrip("/") or "/"
    path = Path(given)
    raw = _read_config(path)
    model_type = raw.get("model_type")
    if model_type == OUR_MODEL_TYPE:
        fields = {k: v for k, v in raw.items() if k != "model_type"}
        try:
            cfg = ModelConfig.from_json(json.dumps(fields))
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path / 'config.json'}: {exc}") from None
        return dataclasses.replace(cfg, name=given, checkpoint=str(path))
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{path / 'config.json'}: model_type {model_type!r} is not supported; supported: "
                              f"{', '.join(MODEL_TYPES)}")
    unknown = sorted(set(raw) - _METADATA)
    if unknown:
        raise CheckpointError(f"{path / 'config.json'}: unsupported config fields {unknown} ({model_type})")
    reader = _Fields(raw, path / "config.json")
    fields = _kimi_linear(reader) if model_type == "kimi_linear" else _deepseek_v32(reader)
    fields.update(_common(reader))
    try:
        return ModelConfig(name=given, checkpoint=str(path), **fields).validate()
    except ValueError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None


class _Fields:
    """Typed reads of config.json keys (with their aliases); errors name the key."""

    def __init__(self, raw: dict[str, Any], path: Path) -> None:
        self.raw, self.path = raw, path

    def get(self, *names: str, default: Any = None, required: bool = False) -> Any:
        for name in names:
            if name in self.raw and self.raw[name] is not None:
                return self.raw[name]
        if required:
            raise CheckpointError(f"{self.path}: missing field {names[0]!r}")
        return default

    def int(self, *names: str, default: int | None = None) -> int:
        value = self.get(*names, default=default, required=default is None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise CheckpointError(f"{self.path}: {names[0]} must be an integer, got {value!r}")
        return value

    def expect(self, name: str, allowed: tuple, default: Any) -> Any:
        value = self.raw.get(name, default)
        if value not in allowed:
            raise CheckpointError(f"{self.path}: {name} {value!r} is not supported (supported: {list(allowed)})")
        return value

    def fail(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {message}")


def _common(f: _Fields) -> dict[str, Any]:
    """MoE, norms, embeddings and token ids: the same in both public dialects."""
    f.expect("hidden_act", ("silu",), "silu")
    f.expect("attention_bias", (False,), False)
    f.expect("mlp_bias", (False,), False)
    f.expect("scoring_func", ("sigmoid",), "sigmoid")
    f.expect("moe_router_activation_func", ("sigmoid",), "sigmoid")
    f.expect("topk_method", ("noaux_tc",), "noaux_tc")
    heads = f.int("num_attention_heads")
    if f.get("num_key_value_heads", default=heads) != heads:
        raise f.fail(f"num_key_value_heads {f.get('num_key_value_heads')} != num_attention_heads {heads} "
                     "(MLA expands every head from the latent)")
    num_layers = f.int("num_hidden_layers")
    moe_inter = f.int("moe_intermediate_size")
    shared = f.int("n_shared_experts", "num_shared_experts", default=1)
    groups = f.int("n_group", "num_expert_group", default=1)
    if f.get("use_grouped_topk", default=True) is False:
        groups = 1
    eos = f.get("eos_token_id", default=0)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    experts = f.int("n_routed_experts", "num_experts", "num_local_experts")
    return dict(
        vocab_size=f.int("vocab_size"), d_model=f.int("hidden_size"), num_layers=num_layers,
        rms_eps=float(f.get("rms_norm_eps", default=1e-6)), num_heads=heads,
        kv_lora_rank=f.int("kv_lora_rank"), qk_nope_dim=f.int("qk_nope_head_dim"),
        qk_rope_dim=f.int("qk_rope_head_dim"), v_head_dim=f.int("v_head_dim"), mla_output_gate=False,
        num_experts=experts, num_experts_per_tok=f.int("num_experts_per_tok", "num_experts_per_token"),
        num_shared_experts=shared, moe_latent_dim=0, moe_intermediate=moe_inter,
        shared_intermediate=moe_inter * shared, first_dense_layers=_dense_prefix(f, num_layers),
        dense_intermediate=f.int("intermediate_size"),
        routed_scaling_factor=float(f.get("routed_scaling_factor", default=1.0)),
        moe_renormalize=bool(f.get("norm_topk_prob", "moe_renormalize", default=True)),
        num_expert_groups=groups, topk_groups=f.int("topk_group", default=1) if groups > 1 else 1,
        tie_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        latent_dtype="fp32", index_key_dtype="fp8",
        eos_token_id=int(eos), bos_token_id=int(f.get("bos_token_id", default=0)),
    )


def _dense_prefix(f: _Fields, num_layers: int) -> int:
    """Leading dense-MLP layers: `mlp_layer_types` when given (dense layers must come first), else
    `first_k_dense_replace`."""
    types = f.get("mlp_layer_types")
    if types is None:
        return min(f.int("first_k_dense_replace", default=1), num_layers)
    if len(types) != num_layers or set(types) - {"dense", "sparse"}:
        raise f.fail(f"mlp_layer_types must list 'dense' or 'sparse' for each of {num_layers} layers, got {types}")
    dense = types.count("dense")
    if types[:dense] != ["dense"] * dense:
        raise f.fail(f"mlp_layer_types {types}: dense layers after a MoE layer are not supported")
    return dense


_YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "truncate"}


def _rope(f: _Fields) -> dict[str, Any]:
    """The rotary fields: plain RoPE, or YaRN (DeepSeek's rope_scaling / transformers' rope_parameters)."""
    params = dict(f.get("rope_parameters") or {})
    params.update(f.get("rope_scaling") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", f.get("rope_theta", default=10000.0)))
    if kind == "default":
        return dict(rope_theta=theta)
    if kind != "yarn":
        raise f.fail(f"rope_parameters.rope_type {kind!r} is not supported (supported: 'default', 'yarn')")
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown or params.get("truncate", True) is not True:
        raise f.fail(f"rope_parameters {unknown or ['truncate']} are not supported for yarn")
    original = int(params.get("original_max_position_embeddings", 4096))
    factor = params.get("factor") or f.int("max_position_embeddings") / original
    return dict(rope_theta=theta, rope_factor=float(factor), rope_original_context=original,
                rope_beta_fast=float(params.get("beta_fast") or 32), rope_beta_slow=float(params.get("beta_slow") or 1),
                rope_mscale=float(params.get("mscale") or 1.0), rope_mscale_all_dim=float(params.get("mscale_all_dim")
                                                                                         or 0.0))


def _kimi_linear(f: _Fields) -> dict[str, Any]:
    num_layers = f.int("num_hidden_layers")
    linear = f.get("linear_attn_config", default={})
    types = f.get("layer_types")
    if types is not None:
        if len(types) != num_layers or set(types) - {"full_attention", "linear_attention"}:
            raise f.fail(f"layer_types must list 'full_attention' or 'linear_attention' per layer, got {types}")
        mla = tuple(i + 1 for i, t in enumerate(types) if t == "full_attention")
    elif "full_attn_layers" in linear:
        mla = tuple(sorted(int(i) for i in linear["full_attn_layers"]))
    else:
        mla = tuple(i + 1 for i in range(num_layers) if i and i % 4 == 0)
    kda = tuple(i for i in range(1, num_layers + 1) if i not in mla)
    if f.get("mla_use_nope", default=True) is not True:
        raise f.fail("mla_use_nope false (rotary MLA) is not supported for kimi_linear")
    for key in ("rope_parameters", "rope_scaling"):
        if f.get(key) not in (None, {}) and f.get(key, default={}).get("rope_type", "default") != "default":
            raise f.fail(f"{key} is not supported for kimi_linear (its MLA is NoPE)")
    q_lora = f.get("q_lora_rank")
    return dict(
        kda_layers=kda, mla_layers=mla, q_lora_rank=0 if q_lora is None else int(q_lora),
        max_context=int(f.get("model_max_length", "max_position_embeddings", default=1 << 20)),
        dsa_indexer=False, index_num_heads=1, index_head_dim=16,
        kda_num_heads=int(linear.get("num_heads", f.get("linear_num_heads", default=32))),
        kda_head_dim=int(linear.get("head_dim", f.get("linear_head_dim", default=128))),
        kda_conv_size=int(linear.get("short_conv_kernel_size", f.get("linear_conv_kernel_dim", default=4))),
        kda_gate="softplus", kda_state_groups=_state_groups(len(kda)),
    )


def _state_groups(num_kda: int) -> int:
    """KDA groups of the packed cache: the largest of 3, 2, 1 that divides the KDA layers."""
    return next(g for g in (3, 2, 1) if num_kda % g == 0)


def _deepseek_v32(f: _Fields) -> dict[str, Any]:
    num_layers = f.int("num_hidden_layers")
    types = f.get("layer_types")
    if types is not None and set(types) != {"indexed_attention"}:
        raise f.fail(f"layer_types {types}: deepseek_v32 layers are all 'indexed_attention'")
    return dict(
        kda_layers=(), mla_layers=tuple(range(1, num_layers + 1)), q_lora_rank=f.int("q_lora_rank"),
        max_context=int(f.get("max_position_embeddings", default=163840)), mla_rope="interleaved",
        **_rope(f), dsa_indexer=True, index_num_heads=f.int("index_n_heads"),
        index_head_dim=f.int("index_head_dim"), index_topk=f.int("index_topk"), index_rope="half",
        index_norm_eps=1e-6, kda_state_groups=1,
    )


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names (sorted), or model.safetensors."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: expected a JSON object with a 'weight_map'") from None
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shards {missing} are missing from {directory}")
        return [directory / name for name in files]
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(f"{directory}: no {SINGLE_FILE} and no {INDEX_FILE}")


def read_header(path: Path) -> tuple[dict[str, Any], int, bytes]:
    """A safetensors file's header: (tensor entries, byte offset of the data, the raw header bytes)."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > 100 << 20:
            raise CheckpointError(f"{path}: safetensors header of {size} bytes is implausible")
        raw = fh.read(size)
    try:
        header = json.loads(raw)
    except json.JSONDecodeError:
        raise CheckpointError(f"{path}: safetensors header is not JSON") from None
    header.pop("__metadata__", None)
    return header, 8 + size, raw


def checkpoint_fingerprint(directory: str | Path) -> str:
    """16 hex chars over config.json and each weight file's name, size and safetensors header: two directories
    with equal fingerprints hold the same config and the same tensor names, shapes, dtypes and offsets."""
    directory = Path(directory)
    h = hashlib.blake2b(digest_size=8)
    h.update((directory / "config.json").read_bytes())
    for path in weight_files(directory):
        _, _, raw = read_header(path)
        h.update(f"|{path.name}|{path.stat().st_size}|".encode())
        h.update(raw)
    return h.hexdigest()


def weights_fingerprint(cfg: ModelConfig, seed: int) -> str:
    """What names a node's weights: a checkpoint's fingerprint (path-independent), else preset name and seed."""
    if cfg.checkpoint is not None:
        return f"checkpoint:{checkpoint_fingerprint(cfg.checkpoint)}"
    return f"{cfg.name}|seed={seed}"
