"""Checkpoints written by transformers load into the engine and compute what transformers computes.

The oracle is transformers' own KimiLinearForCausalLM / DeepseekV32ForCausalLM (fp32, eager) on the same directory
(tests/checkpoints.py). For each checkpoint kind: logits of a 200-token prompt within 1e-4 of the logit range at
every position, and 32 greedy tokens equal, on one rank (through the Engine and its row pool) and over TP=2 and
DCP=2 gloo ranks (one rank pool for both). DSA checkpoints run with exact index scores (fp32 index keys); the
engine's FP8 index keys are measured separately (`test_fp8_index_keys_agreement`). Loader refusals name the field
or tensor.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from engine.api import EngineConfig, SamplingParams
from engine.engine import Engine
from engine.model.checkpoint import CheckpointError, checkpoint_fingerprint, weights_fingerprint
from engine.model.config import resolve_model
from engine.model.state import LocalSequenceCache
from engine.model.weights import build_model, save_checkpoint
from tests.checkpoints import checkpoint_dir, hf_model

pytest.importorskip("transformers", reason="transformers (the test oracle) is a test dependency")

PROMPT_TOKENS = 200
GREEDY_TOKENS = 32
TOLERANCE = 1e-4
"""Largest |engine - transformers| logit difference allowed, as a fraction of the logit range."""
KINDS = ["kimi-mix", "kimi-dense-shared", "dsv32-topk", "dsv32-yarn", "dsv32-sharded", "dsv32-fp8"]
PARALLEL_KINDS = ["kimi-mix", "dsv32-topk"]


def oracle_dir(kind: str):  # noqa: ANN201
    """Where transformers reads the same weights (the FP8 checkpoint's are its dequantized values)."""
    return checkpoint_dir("dsv32-fp8-dequant" if kind == "dsv32-fp8" else kind)


def prompt(cfg) -> torch.Tensor:  # noqa: ANN001
    return torch.randint(3, cfg.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(5))


_ORACLE: dict[str, tuple[torch.Tensor, list[int]]] = {}


def oracle(kind: str, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits [T, V] of the prompt and its greedy continuation (full forward per token)."""
    if kind not in _ORACLE:
        model = hf_model(oracle_dir(kind))
        with torch.no_grad():
            logits = model(ids[None]).logits[0]
            seq, tokens = ids.tolist(), []
            for _ in range(GREEDY_TOKENS):
                nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
                tokens.append(nxt)
                seq.append(nxt)
        _ORACLE[kind] = (logits, tokens)
    return _ORACLE[kind]


def exact_config(kind: str):  # noqa: ANN201
    return resolve_model(str(checkpoint_dir(kind)), exact_index_scores=True)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    span = float(want.max() - want.min())
    err = (got - want).abs().max(-1).values / span
    assert float(err.max()) <= TOLERANCE, (f"logits differ by {float(err.max()):.2e} of the range at position "
                                           f"{int(err.argmax())}")


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind: str) -> None:
    cfg = exact_config(kind)
    ids = prompt(cfg)
    want, _ = oracle(kind, ids)
    with torch.no_grad():
        got = build_model(cfg).prefill(ids, LocalSequenceCache(cfg, PROMPT_TOKENS), 0, all_logits=True)
    assert_close(got, want)


@pytest.mark.parametrize("kind", ["kimi-mix", "kimi-dense-shared", "dsv32-topk", "dsv32-fp8"])
def test_engine_greedy_matches_transformers(kind: str) -> None:
    """The whole engine (row pool, prefill then decode steps) on the checkpoint directory."""
    engine = Engine(EngineConfig(model=str(checkpoint_dir(kind)), exact_index_scores=True, kernels="reference",
                                 num_rows=64))
    ids = prompt(engine.model_config)
    _, want = oracle(kind, ids)
    out = engine.generate("r", ids.tolist(), SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True))
    assert out.token_ids == want


def _first_layer_selections(cfg, ids: torch.Tensor, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """(all logits, the first DSA layer's selections [T, k]) of a prefill."""
    import engine.model.mla as mla

    seen = []
    original = mla.select_topk
    monkeypatch.setattr(mla, "select_topk", lambda *a: seen.append(original(*a)) or seen[-1])
    with torch.no_grad():
        logits = build_model(cfg).prefill(ids, LocalSequenceCache(cfg, PROMPT_TOKENS), 0, all_logits=True)
    monkeypatch.setattr(mla, "select_topk", original)
    return logits, seen[0]


def test_fp8_index_keys_agreement(record_property, monkeypatch) -> None:  # noqa: ANN001
    """FP8 index keys (the default) change some DSA selections. Asserted: the first DSA layer (same inputs either
    way) keeps >= 90% of the exact selection on average. Reported: how far logits and greedy tokens still agree
    with transformers (tiny random models amplify one changed key: their logits are flat)."""
    directory = str(checkpoint_dir("dsv32-topk"))
    cfg = resolve_model(directory)
    assert cfg.index_key_dtype == "fp8"
    ids = prompt(cfg)
    want_logits, want = oracle("dsv32-topk", ids)
    got_logits, fp8_sel = _first_layer_selections(cfg, ids, monkeypatch)
    _, exact_sel = _first_layer_selections(resolve_model(directory, True), ids, monkeypatch)
    k = cfg.index_topk
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(fp8_sel[k:], exact_sel[k:]))
    overlap /= k * (PROMPT_TOKENS - k)
    argmax_agree = float((got_logits.argmax(-1) == want_logits.argmax(-1)).float().mean())
    engine = Engine(EngineConfig(model=directory, kernels="reference", num_rows=64))
    got = engine.generate("r", ids.tolist(), SamplingParams(max_tokens=GREEDY_TOKENS, ignore_eos=True)).token_ids
    prefix = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    for name, value in (("fp8_selection_overlap", overlap), ("fp8_argmax_agreement", argmax_agree),
                        ("fp8_greedy_common_prefix", prefix)):
        record_property(name, value)
    print(f"FP8 index keys: first-layer selection overlap {overlap:.3f}; teacher-forced argmax agreement "
          f"{argmax_agree:.3f} over {PROMPT_TOKENS} positions; greedy equal for {prefix} of {GREEDY_TOKENS} tokens")
    assert overlap >= 0.9


@pytest.fixture(scope="module")
def rank_pool():
    from engine.parallel.groups import RankPool

    with RankPool(2, backend="gloo", timeout_s=900) as pool:
        yield pool


@pytest.mark.process
def test_tp2_and_dcp2_match_transformers(rank_pool) -> None:  # noqa: ANN001
    """Token-sharded TP=2 prefill (all logits), TP=2 and DCP=2 greedy decode, expert parallel, per kind."""
    from tests.engine.parallel import _ranks

    for kind in PARALLEL_KINDS:
        cfg = exact_config(kind)
        ids = prompt(cfg)
        want_logits, want = oracle(kind, ids)
        prefill = rank_pool.run(_ranks.prefill_case, cfg, [ids], [0], "token", PROMPT_TOKENS, True)
        for rank, res in enumerate(prefill):
            assert_close(res["logits"], want_logits)
        for mode in ("tp", "dcp"):
            decoded = rank_pool.run(_ranks.decode_case, cfg, [ids], GREEDY_TOKENS - 1, mode, 1, "compact")
            for res in decoded:
                assert res["tokens"][0] == want, f"{kind} {mode}: greedy tokens differ"


def test_fingerprint_names_the_weights(tmp_path) -> None:  # noqa: ANN001
    """Cheap (headers only), path-independent, and different for different weights; presets keep name|seed."""
    src = checkpoint_dir("kimi-mix")
    copy = shutil.copytree(src, tmp_path / "copy")
    assert checkpoint_fingerprint(src) == checkpoint_fingerprint(copy)
    assert checkpoint_fingerprint(src) != checkpoint_fingerprint(checkpoint_dir("kimi-dense-shared"))
    assert weights_fingerprint(resolve_model("kimi-k3.1-mini"), 7) == "kimi-k3.1-mini|seed=7"
    cfg = resolve_model(str(copy) + "/")
    assert (cfg.name, cfg.checkpoint) == (str(copy), str(copy))


def test_our_dialect_round_trips(tmp_path) -> None:  # noqa: ANN001
    """A preset saved as a pdcluster_k3 checkpoint loads back bit for bit."""
    cfg = resolve_model("kimi-k3.1-mini")
    model = build_model(cfg)
    directory = save_checkpoint(model, tmp_path / "mini")
    loaded = build_model(resolve_model(str(directory)))
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name


def _edit_config(tmp_path, kind: str, **changes):  # noqa: ANN001, ANN201
    directory = shutil.copytree(checkpoint_dir(kind), tmp_path / kind)
    raw = json.loads((directory / "config.json").read_text())
    raw.update(changes)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"attention_bias": True}, "attention_bias True is not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0}}, "rope_type .longrope."),
    ({"some_new_knob": 3}, "unsupported config fields ['some_new_knob']"),
    ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq' is not supported"),
    ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "dense layers after a MoE layer"),
], ids=["model-type", "activation", "attention-bias", "rope-scaling", "unknown-field", "quantization",
        "dense-after-moe"])
def test_config_refusals_name_the_field(tmp_path, changes, message) -> None:  # noqa: ANN001
    directory = _edit_config(tmp_path, "dsv32-topk", **changes)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("(", r"\(")):
        build_model(resolve_model(str(directory)))


def _rewrite_tensors(tmp_path, kind: str, edit) -> object:  # noqa: ANN001
    from safetensors.torch import load_file, save_file

    directory = shutil.copytree(checkpoint_dir(kind), tmp_path / kind)
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"), "missing tensors "
     r"\['model.layers.1.self_attn.kv_b_proj.weight'\]"),
    (lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}), "does not use: "
     r"\['model.layers.0.self_attn.extra.weight'\]"),
    (lambda t: t.update({"model.norm.weight": torch.ones(63)}), r"model.norm.weight has shape \[63\]"),
    (lambda t: t.update({"model.layers.3.mlp.gate.weight": torch.zeros(2)}), "does not use"),
], ids=["missing", "extra", "shape", "mtp-without-nextn"])
def test_tensor_refusals_name_the_tensor(tmp_path, edit, message) -> None:  # noqa: ANN001
    directory = _rewrite_tensors(tmp_path, "dsv32-topk", edit)
    with pytest.raises(CheckpointError, match=message):
        build_model(resolve_model(str(directory)))


def test_mtp_layers_are_skipped_with_one_log_line(tmp_path, caplog) -> None:  # noqa: ANN001
    def add_mtp(tensors: dict) -> None:
        for name in [n for n in tensors if n.startswith("model.layers.2.")]:
            tensors[name.replace("model.layers.2.", "model.layers.3.")] = tensors[name].clone()
        tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)

    directory = _rewrite_tensors(tmp_path, "dsv32-topk", add_mtp)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 1}))
    with caplog.at_level("INFO", logger="engine.model.loader"):
        loaded = build_model(resolve_model(str(directory)))
    assert [r.message for r in caplog.records if "multi-token" in r.message] != []
    plain = build_model(exact_config("dsv32-topk"))
    for (name, a), (_, b) in zip(plain.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name


def test_fast_kernels_refuse_by_name_and_auto_runs_reference() -> None:
    from engine.fast.support import fast_unsupported

    assert fast_unsupported(resolve_model("kimi-k3.1-mini")) is None
    reason = fast_unsupported(resolve_model(str(checkpoint_dir("dsv32-topk"))), "tp")
    assert "mla_rope interleaved" in reason and "index_rope half" in reason and "latent_dtype fp32" in reason
    engine = Engine(EngineConfig(model=str(checkpoint_dir("kimi-mix")), kernels="auto", num_rows=16))
    assert engine.kernels == "reference"


def test_presets_unchanged_by_the_new_fields() -> None:
    """Every semantic field defaults to the presets' behaviour (the preset tests check the bits)."""
    cfg = resolve_model("kimi-k3.1-mini")
    assert (cfg.mla_rope, cfg.index_rope, cfg.dsa_indexer, cfg.kda_gate, cfg.num_expert_groups,
            cfg.moe_renormalize, cfg.tie_embeddings, cfg.checkpoint) == ("none", "none", True, "sigmoid", 1, True,
                                                                         False, None)
    assert dataclasses.replace(cfg, index_key_dtype="fp32") == resolve_model("kimi-k3.1-mini", True)


def test_moonshot_spelling_reads_as_transformers_spelling(tmp_path) -> None:  # noqa: ANN001
    """Kimi-Linear's original config.json keys (linear_attn_config, first_k_dense_replace, ...) give the same
    ModelConfig as transformers' spelling of the same model."""
    src = checkpoint_dir("kimi-mix")
    raw = json.loads((src / "config.json").read_text())
    types = raw.pop("layer_types")
    linear = {"head_dim": raw.pop("linear_head_dim"), "num_heads": raw.pop("linear_num_heads"),
              "short_conv_kernel_size": raw.pop("linear_conv_kernel_dim"),
              "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
              "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"]}
    first_dense = raw.pop("mlp_layer_types").count("dense")
    original = {**raw, "linear_attn_config": linear, "first_k_dense_replace": first_dense, "mla_use_nope": True,
                "moe_router_activation_func": "sigmoid", "use_grouped_topk": True}
    directory = shutil.copytree(src, tmp_path / "moonshot")
    (directory / "config.json").write_text(json.dumps(original))
    want = resolve_model(str(src))
    assert dataclasses.replace(resolve_model(str(directory)), name=want.name, checkpoint=want.checkpoint) == want


@pytest.mark.parametrize("kind", ["kimi-mix", "dsv32-sharded"])
def test_copy_path_loads_the_mapped_values(kind: str) -> None:
    """The copying load (tensors read into their parameters, `zero_copy=False`) and a load into bf16 parameters
    (through the bounce buffer and a converting copy) give the values of the mapped load."""
    from engine.model.model import KimiModel
    from engine.model.weights import load_checkpoint

    cfg = resolve_model(str(checkpoint_dir(kind)))
    mapped = dict(build_model(cfg).named_parameters())
    copied = KimiModel(cfg)
    load_checkpoint(copied, cfg.checkpoint, zero_copy=False)
    halved = KimiModel(cfg).to(torch.bfloat16)
    load_checkpoint(halved, cfg.checkpoint)
    for name, param in copied.named_parameters():
        assert torch.equal(param, mapped[name]), name
    for name, param in halved.named_parameters():
        assert torch.equal(param, mapped[name].to(torch.bfloat16)), name
