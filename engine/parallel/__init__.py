"""Every collective lives here: process groups, token-sharded prefill, DCP decode merges, head-sharded baseline.

API for node servers (SPMD: every rank of a group calls the same function with the same batch):
- groups.init_context(rank, world_size, init_method, backend) -> ParallelContext   (RankPool for tests and benchmarks)
- tp.apply_tp(model, ctx): expert-parallel MoE on a built model (bit-identical to the single-rank model)
- prefill.parallel_prefill(ctx, model, PrefillBatch, caches, mode) -> PrefillResult; prefill.choose_mode(batch,
  token_threshold) picks "token" (zigzag token-sharded) or "head" (head-sharded) per step; caches hold whole
  attention rows and the rank's KDA heads (kda_shard.rank_cache / kda_shard.shard_state)
- dcp_decode.parallel_decode(ctx, model, token_ids, positions, caches, mode="dcp"|"tp", layout, merge) ->
  DecodeResult; DCP caches are engine.cache.DCPRowCache in a node's row pool (ownership from the pool layout's
  dcp_interleave) or dcp_cache.DCPRankCache on plain tensors (tests, benchmarks); both under dcp_layout.DCPLayout
- dcp_merge.compact_merge / generic_merge, dcp_attention.partial_attention / lse_merge / dcp_combine
- fast_tp.TPFastDecoder(shard, layout, ctx): the fast (Triton, bf16) decode step over a TP group on the rank's
  shard (MLA and KDA heads, experts and output rows split), run through engine.fast.model.decode_on_pool;
  fast_dcp.DCPFastDecoder and fast_prefill.TPFastPrefiller likewise; spmd.TPModel.fast_kernels uses them
"""
