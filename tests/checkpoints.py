"""Tiny random checkpoints written by transformers' own classes: the oracle the engine's loader is checked against.

    path = checkpoint_dir("kimi-mix")                 # built once per process, then cached
    path = checkpoint_dir("dsv32-topk", tokenizer=save_bpe_tokenizer)   # plus files written beside the weights

Kinds (`KINDS`; every one is `...ForCausalLM(cfg).save_pretrained(dir)` with initializer_range 0.1 so greedy
margins are not hair-thin):
- `kimi-mix`: Kimi-Linear with KDA and MLA layers interleaved, no query low-rank (as Kimi-Linear-48B), grouped
  top-k routing, one dense-first layer.
- `kimi-dense-shared`: Kimi-Linear with two dense-first layers, two shared experts, tied embeddings.
- `dsv32-topk`: DeepSeek-V3.2 with index_topk 16 (selection matters from position 16 on), one dense-first layer.
- `dsv32-yarn`: DeepSeek-V3.2 with YaRN rotary scaling (`YARN`), index_topk 32.
- `dsv32-sharded`: the same model family saved in shards with model.safetensors.index.json.
- `dsv32-fp8`: `dsv32-topk`'s weights converted to FP8 block-scaled (`weight` e4m3 + `weight_scale_inv`, blocks
  of 16 x 32, DeepSeek's quantization_config); its oracle is `dsv32-fp8-dequant`, the same values in fp32.
`tokenizer(dir)` (optional) writes tokenizer files beside the weights; each (kind, tokenizer) pair is built once
per process. transformers is imported only here and in tests: product code never imports it.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

VOCAB_SIZE = 512
"""Large enough for the tokenizers of tests/checkpoint_tokenizer.py (ids < 400, or 556 for tiktoken)."""
FP8_BLOCK = (16, 32)

_CACHE: dict[tuple[str, str | None], Path] = {}
_ROOT: list[Path] = []


def _root() -> Path:
    if not _ROOT:
        root = Path(tempfile.mkdtemp(prefix="pdcluster-ckpt-"))
        atexit.register(shutil.rmtree, root, True)
        _ROOT.append(root)
    return _ROOT[0]


def _mla_shapes() -> dict:
    return dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, intermediate_size=128,
                moe_intermediate_size=32, initializer_range=0.1)


def kimi_config(kind: str, vocab_size: int = VOCAB_SIZE):  # noqa: ANN201
    from transformers import KimiLinearConfig

    common = dict(vocab_size=vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2, linear_head_dim=32,
                  linear_num_heads=4, linear_conv_kernel_dim=4, num_local_experts=8, num_experts_per_tok=2,
                  rms_norm_eps=1e-5, **_mla_shapes())
    if kind == "kimi-mix":
        types = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
        return KimiLinearConfig(num_hidden_layers=5, layer_types=types, q_lora_rank=None, n_group=2, topk_group=1,
                                mlp_layer_types=["dense"] + ["sparse"] * 4, n_shared_experts=1,
                                routed_scaling_factor=2.446, **common)
    if kind == "kimi-dense-shared":
        types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
        return KimiLinearConfig(num_hidden_layers=4, layer_types=types, q_lora_rank=48, n_group=1, topk_group=1,
                                mlp_layer_types=["dense", "dense", "sparse", "sparse"], n_shared_experts=2,
                                tie_word_embeddings=True, routed_scaling_factor=1.5, **common)
    raise ValueError(f"unknown kimi checkpoint kind {kind!r}")


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}
"""DeepSeek-style YaRN with a short original context (so a 200-token prompt spans the blended frequencies) and
unequal mscales (so the rotary and the softmax corrections both show)."""


def deepseek_config(index_topk: int = 16, vocab_size: int = VOCAB_SIZE, num_layers: int = 3,
                    rope: dict | None = None):  # noqa: ANN201
    from transformers import DeepseekV32Config

    extra = {"rope_parameters": rope} if rope else {}
    return DeepseekV32Config(**extra,vocab_size=vocab_size, num_hidden_layers=num_layers, q_lora_rank=48,
                             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                             index_topk=index_topk, index_head_dim=32, index_n_heads=32, first_k_dense_replace=1,
                             routed_scaling_factor=2.5, bos_token_id=1, eos_token_id=2, **_mla_shapes())


def _save(config, directory: Path, seed: int, max_shard_size: str | None = None) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():  # seeded init without moving the caller's random state
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)


def _to_fp8(source: Path, fp8_dir: Path, dequant_dir: Path) -> None:
    """Every 2-D projection weight of `source` (not embeddings, norms, the router) -> e4m3 blocks + scale_inv;
    `dequant_dir` gets the dequantized values (the oracle loads those)."""
    from safetensors.torch import load_file, save_file

    b0, b1 = FP8_BLOCK
    tensors = load_file(str(source / "model.safetensors"))
    fp8, plain = {}, {}
    for name, t in tensors.items():
        quantize = (t.dim() == 2 and name.endswith("proj.weight") and "gate." not in name
                    and "embed" not in name)
        if not quantize:
            fp8[name] = plain[name] = t
            continue
        rows, cols = t.shape
        blocks = t.new_zeros(-(-rows // b0), -(-cols // b1))
        for i in range(blocks.shape[0]):
            for j in range(blocks.shape[1]):
                blocks[i, j] = t[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().amax().clamp_min(1e-8) / 448.0
        scale = blocks.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
        q = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = q, blocks
        plain[name] = q.float() * scale
    for directory, data in ((fp8_dir, fp8), (dequant_dir, plain)):
        directory.mkdir(parents=True)
        save_file(data, str(directory / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((source / "config.json").read_text())
        if directory == fp8_dir:
            config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": list(FP8_BLOCK)}
        (directory / "config.json").write_text(json.dumps(config, indent=2))


def _build(kind: str, directory: Path) -> None:
    if kind.startswith("kimi-"):
        _save(kimi_config(kind), directory, seed=1)
    elif kind == "dsv32-topk":
        _save(deepseek_config(), directory, seed=2)
    elif kind == "dsv32-yarn":
        _save(deepseek_config(index_topk=32, num_layers=2, rope=YARN), directory, seed=4)
    elif kind == "dsv32-sharded":
        _save(deepseek_config(index_topk=32, num_layers=2), directory, seed=3, max_shard_size="100KB")
    elif kind in ("dsv32-fp8", "dsv32-fp8-dequant"):
        source = checkpoint_dir("dsv32-topk")
        fp8_dir, plain_dir = directory.parent / "dsv32-fp8", directory.parent / "dsv32-fp8-dequant"
        if not fp8_dir.exists():
            _to_fp8(source, fp8_dir, plain_dir)
    else:
        raise ValueError(f"unknown checkpoint kind {kind!r}; known: {', '.join(KINDS)}")


KINDS = ("kimi-mix", "kimi-dense-shared", "dsv32-topk", "dsv32-yarn", "dsv32-sharded", "dsv32-fp8",
         "dsv32-fp8-dequant")


def checkpoint_dir(kind: str, tokenizer: Callable[[Path], object] | None = None) -> Path:
    """The directory of checkpoint `kind` (built on first use in this process; see module docstring)."""
    key = (kind, getattr(tokenizer, "__name__", None))
    if key not in _CACHE:
        directory = _root() / (kind if tokenizer is None else f"{kind}+{key[1]}")
        if tokenizer is None:
            _build(kind, directory)
        else:
            shutil.copytree(checkpoint_dir(kind), directory)
            tokenizer(directory)
        _CACHE[key] = directory
    return _CACHE[key]


def hf_model(directory: Path):  # noqa: ANN201
    """The transformers model of a checkpoint directory, fp32, eager attention, eval mode (the oracle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    return model.eval()
