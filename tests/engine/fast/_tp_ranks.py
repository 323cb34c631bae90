"""What the ranks of the fast TP decode tests run (importable by spawned children; they inherit TRITON_INTERPRET
from the test process, set by this folder's conftest when there is no GPU)."""

from __future__ import annotations

import torch

from engine.parallel.groups import ParallelContext


def rank_shard(ctx: ParallelContext, cfg):  # type: ignore[no-untyped-def]
    """This rank's shard of the model (the whole model on one rank), built as a node builds it."""
    from engine.model.shards import ShardSpec
    from engine.model.weights import build_model

    return build_model(cfg, shard=ShardSpec(ctx.world_size, ctx.rank))


def prefill_rows(ctx: ParallelContext, model, layout, prompts: list[torch.Tensor], spare: int):  # type: ignore[no-untyped-def]
    """A row pool of `layout` with each prompt prefilled by the reference (SPMD over `ctx` on the rank's shard
    `model`: the token-sharded prefill a TP node runs, which gives the single-rank bits), `spare` more tokens of
    rows each. The shard's MoE layers become expert-parallel (in place), as in a node's `TPModel`."""
    from engine.cache import RowPool, RowSequenceCache
    from engine.parallel.prefill import PrefillBatch, parallel_prefill
    from engine.parallel.tp import apply_tp

    pool = RowPool(layout, model.cfg, 4 * len(prompts) + 4)
    if not ctx.is_single:
        shard = apply_tp(model, ctx)
    tables = []
    with torch.no_grad():
        for p in prompts:
            table = pool.allocate_request(p.numel() + spare)
            cache = RowSequenceCache(pool, table)
            if ctx.is_single:
                model.prefill(p, cache)
            else:
                parallel_prefill(ctx, shard, PrefillBatch((p,), (0,)), [cache], "token")
            tables.append(table)
    return pool, tables


def greedy_decode(ctx: ParallelContext, cfg, prompts: list[torch.Tensor], first: list[int], steps: int,
                  dtype: torch.dtype) -> dict:
    """Prefill (reference), then `steps` greedy steps of the fast TP decode (TPFastDecoder) on this rank."""
    from engine.cache import RowSequenceCache
    from engine.fast.model import decode_on_pool
    from engine.layout import plan_layout
    from engine.parallel.fast_tp import TPFastDecoder

    model = rank_shard(ctx, cfg)
    layout = plan_layout(cfg, tp_size=ctx.world_size)
    pool, tables = prefill_rows(ctx, model, layout, prompts, steps + 1)
    decoder = TPFastDecoder(model, layout, ctx, dtype)
    caches = [RowSequenceCache(pool, t) for t in tables]
    tokens, positions, logits = [list(first)], [p.numel() for p in prompts], []
    for _ in range(steps):
        out = decode_on_pool(decoder, layout, torch.tensor(tokens[-1]), positions, caches)
        logits.append(out)
        tokens.append(out.argmax(-1).tolist())
        positions = [n + 1 for n in positions]
    experts = [layer.ffn["w1"].shape[0] for layer in decoder.layers if not layer.dense]
    return {"tokens": tokens, "logits": logits, "experts": experts}


def engine_generate(ctx: ParallelContext, cfg_name: str, prompt: list[int], max_tokens: int) -> dict:
    """A TP engine as a node builds it (TPModel over the rank group) with kernels="fast": greedy generation."""
    from engine.engine import Engine, EngineConfig
    from engine.model.config import get_preset
    from engine.parallel.spmd import TPModel
    from engine.sampling import SamplingParams

    model = TPModel(rank_shard(ctx, get_preset(cfg_name)), ctx, 1)
    engine = Engine(EngineConfig(model=cfg_name, num_rows=16, tp_size=ctx.world_size, kernels="fast",
                                 prefix_cache=False), model=model)
    result = engine.generate("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return {"kernels": engine.kernels, "fast": model.fast_decoder is not None, "tokens": result.token_ids,
            "logprobs": result.logprobs, "fast_prefills": model.fast_prefiller.steps}


def dcp_greedy_decode(ctx: ParallelContext, cfg, prompts: list[torch.Tensor], first: list[int], steps: int,
                      dtype: torch.dtype, interleave: int) -> dict:
    """Prefill (the reference DCP node's: DCPModel.prefill keeps this rank's share), then `steps` greedy steps of
    the fast DCP decode (DCPFastDecoder) on this rank; tokens owned in runs of `interleave`."""
    from engine.cache import DCPRowCache, RowPool
    from engine.layout import plan_layout
    from engine.parallel.fast_dcp import DCPFastDecoder, decode_on_dcp_pool
    from engine.parallel.spmd import DCPModel

    model = rank_shard(ctx, cfg)
    layout = plan_layout(cfg, tp_size=ctx.world_size, dcp_size=ctx.world_size, dcp_interleave=interleave)
    pool = RowPool(layout, cfg, 4 * len(prompts) + 4)
    wrapper = DCPModel(model, ctx, 1)
    caches = []
    with torch.no_grad():
        for p in prompts:
            cache = DCPRowCache(pool, pool.allocate_request(p.numel() + steps + 1), ctx.rank)
            wrapper.prefill(p, cache)
            caches.append(cache)
    decoder = DCPFastDecoder(model, layout, ctx, dtype)
    tokens, positions, logits = [list(first)], [p.numel() for p in prompts], []
    for _ in range(steps):
        out = decode_on_dcp_pool(decoder, torch.tensor(tokens[-1]), positions, caches)
        logits.append(out)
        tokens.append(out.argmax(-1).tolist())
        positions = [n + 1 for n in positions]
    owned = [c.read_owned(0, p.numel()).latent.shape[0] for c, p in zip(caches, prompts)]
    return {"tokens": tokens, "logits": logits, "merge_bytes": decoder.merge_bytes, "owned": owned}


def dcp_engine_generate(ctx: ParallelContext, cfg_name: str, prompt: list[int], max_tokens: int) -> dict:
    """A DCP engine as a decode node builds it (DCPModel over the rank group, its DCPRowCaches) with
    kernels="fast": greedy generation."""
    from engine.engine import Engine, EngineConfig
    from engine.model.config import get_preset
    from engine.parallel.spmd import DCPModel
    from engine.sampling import SamplingParams

    model = DCPModel(rank_shard(ctx, get_preset(cfg_name)), ctx, 1)
    engine = Engine(EngineConfig(model=cfg_name, num_rows=16, tp_size=ctx.world_size, dcp_size=ctx.world_size,
                                 kernels="fast", prefix_cache=False), model=model, make_cache=model.make_cache)
    result = engine.generate("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return {"kernels": engine.kernels, "fast": model.fast_decoder is not None, "tokens": result.token_ids,
            "logprobs": result.logprobs, "merge_bytes": model.merge_bytes}


def fast_prefill(ctx: ParallelContext, cfg, prompt: torch.Tensor, mode: str, dtype: torch.dtype,
                 split: int = 0) -> dict:
    """The fast SPMD prefill (TPFastPrefiller) of one prompt on this rank, every token's logits; `split` > 0:
    the first `split` tokens in one step (token mode), the rest as a resumed step in `mode`."""
    from engine.cache import RowPool
    from engine.fast.prefill_kda import kda_state_views
    from engine.layout import plan_layout
    from engine.parallel.fast_prefill import TPFastPrefiller
    from engine.parallel.fast_tp import TPFastDecoder

    model = rank_shard(ctx, cfg)
    layout = plan_layout(cfg, tp_size=ctx.world_size)
    pool = RowPool(layout, cfg, 8)
    table = pool.allocate_request(prompt.numel())
    prefiller = TPFastPrefiller(TPFastDecoder(model, layout, ctx, dtype))
    logits, exchanged, moe = [], 0, 0
    for lo, hi, step_mode in ((0, split, "token"), (split, prompt.numel(), mode)):
        if hi > lo:
            res = prefiller.prefill(pool.buffer, prompt[lo:hi], table.attn_row_ids, table.kda_row_ids, lo, step_mode,
                                    all_logits=True)
            logits.append(res.logits)
            exchanged += res.stats.exchange_bytes
            moe += res.stats.moe_exchange_bytes
    recurrent, conv = kda_state_views(pool.buffer, layout, table.kda_row_ids[0], 0, prefiller.conv_dtype)
    return {"logits": torch.cat(logits), "recurrent": recurrent.clone(), "conv": conv.clone(),
            "attention_rows": pool.buffer[table.attn_row_ids].clone(), "exchange_bytes": exchanged, "moe_exchange_bytes": moe}
