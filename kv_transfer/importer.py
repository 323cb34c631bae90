"""Decode-side import of one request's rows: validate, plan, read, notify - in that order.

Once the router handed a decode node P's kv_transfer_params and the node fetched P's side-channel metadata:
1. `check_readable` (engine id, fingerprint, block size, row ids, lease expiry) -> KVParamsError; run ONCE per
   import, by whoever admits it: the decode node at its HTTP edge (decode_node/importer.py, a 400), or
   `import_request` for a caller with no edge of its own;
2. P's layout is rebuilt from the metadata and must carry the same fingerprint as D's;
3. `remap.plan_reads` (IncompatiblePair if the pair cannot be remapped), skipping the leading blocks the decode
   engine's prefix cache already holds (`skip_tokens`);
4. the READs: one per source P rank with a DONE notification, posted by `post_import` (kv_transfer.reads.
   PendingReads, polled by the caller between its own steps) or read to completion by `import_request`.
Steps 1-3 touch no memory; a failure there leaves both pools and P's lease untouched.
"""

from __future__ import annotations

from engine.layout import RowLayout, plan_layout
from engine.model.config import ModelConfig
from kv_transfer.params import KVParamsError, KVTransferParams, check_readable
from kv_transfer.reads import PendingReads, read_request
from kv_transfer.remap import ReadPlan, plan_reads
from kv_transfer.transport import RankEndpoint, ReadResult


def prefill_layout(cfg: ModelConfig, meta, d_layout: RowLayout) -> RowLayout:
    """P's layout as the metadata describes it (formats as D's; the fingerprint proves they agree). `meta`
    is side_channel.InstanceMetadata or any object with the same attributes (dcp_size, row_bytes optional)."""
    p = plan_layout(cfg, tp_size=meta.tp_size, dcp_size=getattr(meta, "dcp_size", 1), latent_format=d_layout.latent_format,
                    index_key_format=d_layout.index_key_format, subblock_tokens=meta.subblock_tokens,
                    block_size=meta.block_size)
    row_bytes = getattr(meta, "row_bytes", None)
    if p.fingerprint != meta.layout_fingerprint or row_bytes not in (None, p.row_bytes):
        raise KVParamsError(f"prefill layout {meta.layout_fingerprint} ({row_bytes} B rows) is not this "
                            f"model's {p.fingerprint} ({p.row_bytes} B rows) in D's formats")
    return p


def plan_import(cfg: ModelConfig, d_layout: RowLayout, params: KVTransferParams, meta,
                d_attn_rows: list[int], d_kda_rows: list[int], skip_tokens: int = 0) -> ReadPlan:
    """Steps 2-3 of the module docstring (the params were checked, step 1): the read plan, or an error before
    any memory is touched. `skip_tokens`: leading tokens D's prefix cache holds (not read)."""
    if params.layout_fingerprint != d_layout.fingerprint:
        raise KVParamsError(f"layout_fingerprint {params.layout_fingerprint} does not match D's {d_layout.fingerprint}")
    p_layout = prefill_layout(cfg, meta, d_layout)
    return plan_reads(p_layout, d_layout, int(params.remote_num_tokens or 0), params.attention_rows,
                      params.kda_rows, d_attn_rows, d_kda_rows, skip_tokens)


def post_import(transport, cfg: ModelConfig, d_layout: RowLayout, d_rank: int, params: KVTransferParams, meta,
                d_attn_rows: list[int], d_kda_rows: list[int], timeout_s: float | None = None,
                endpoints: dict[int, RankEndpoint] | None = None, skip_tokens: int = 0,
                notify_key: bytes = b"") -> PendingReads:
    """Steps 2-4 for one D rank (the params were checked): the posted READs, to poll. `endpoints` defaults to
    `meta.endpoints()` (side_channel.InstanceMetadata); `skip_tokens`: leading tokens D already holds;
    `notify_key`: the lease's notification key (kv_transfer/signing.py `lease_key`)."""
    plan = plan_import(cfg, d_layout, params, meta, d_attn_rows, d_kda_rows, skip_tokens)
    eps = endpoints if endpoints is not None else meta.endpoints()
    return PendingReads(transport, d_rank, plan, eps, str(params.lease_id), timeout_s, notify_key)


def import_request(transport, cfg: ModelConfig, d_layout: RowLayout, d_rank: int, params: KVTransferParams,
                   meta, d_attn_rows: list[int], d_kda_rows: list[int], timeout_s: float | None = None,
                   endpoints: dict[int, RankEndpoint] | None = None, notify_key: bytes = b"") -> list[ReadResult]:
    """All four steps for one D rank, blocking: the read results (one per source P rank)."""
    check_readable(params, engine_id=meta.engine_id, fingerprint=meta.layout_fingerprint, num_rows=meta.num_rows,
                   kda_groups=meta.kda_groups, block_size=meta.block_size)
    plan = plan_import(cfg, d_layout, params, meta, d_attn_rows, d_kda_rows)
    eps = endpoints if endpoints is not None else meta.endpoints()
    return read_request(transport, d_rank, plan, eps, str(params.lease_id), timeout_s, notify_key)
