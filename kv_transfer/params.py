"""KVTransferParams: the `kv_transfer_params` object of vLLM's PD wire protocol, plus the packed-row fields.

vLLM 0.32 / 0.33 (NixlConnector, `pull_scheduler.request_finished`) emit on the prefill response:
  do_remote_prefill, do_remote_decode, remote_block_ids (one list per KV-cache group), remote_engine_id,
  remote_request_id, remote_host, remote_port, tp_size, dcp_size, pp_size, remote_num_tokens,
  remote_blocks_expiry_time, remote_registration_generation (0.33), transfer_mode,
  remote_prefill_cached_tokens (scheduler); the router's first leg sends do_remote_decode=true with nulls.
Every one of those parses here and `to_wire()` gives back the same JSON object (unknown keys are kept, so a
newer vLLM field survives a round trip).

Packed-row fields (ours, absent from vLLM's JSON and therefore optional):
- `block_size`: P's tokens per attention row; `subblock_tokens`; `layout_fingerprint` (engine.layout).
- `remote_block_ids[0]` holds P's attention row ids in token order; `remote_kda_block_ids` one KDA row per
  KDA group (in group order).
- `first_token_id`: the token P sampled, so D starts decoding without recomputing it; `first_token_logprob` and
  `first_token_top_logprobs` ([[token id, log-prob], ...]): its log-prob and the alternatives the request asked for,
  which D reports as its first entry.
- `lease_id`, `lease_expiry` (unix seconds on P's clock): how long P keeps the rows for this reader.
- `prompt_digest`, `signature`: the prompt the rows belong to and P's HMAC over every field naming memory, peer
  or lease (kv_transfer/signing.py); D verifies it before anything else.
- `decode_engine_id`: the decode instance the hand-off was issued for (the router names it on the prefill leg's
  params, P signs it); a decode node refuses one issued for another, and P lets one reader claim a lease once.

`check_readable(params, ...)` is the D-side gate run before any memory is touched: every problem with the
params (unknown engine id, fingerprint mismatch, row ids out of range, expired lease, missing fields) raises
`KVParamsError` with a message that names the field.
"""

from __future__ import annotations

import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from engine.outputs import TokenEvent


class KVParamsError(ValueError):
    """kv_transfer_params that cannot be served; the message says which field and why."""


class KVTransferParams(BaseModel):
    """vLLM's kv_transfer_params wire object with the packed-row extensions (see the module docstring)."""

    model_config = ConfigDict(extra="allow")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: list[list[int]] | list[int] | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    tp_size: int = Field(default=1, ge=1)
    dcp_size: int = Field(default=1, ge=1)
    pp_size: int = Field(default=1, ge=1)
    remote_num_tokens: int | None = Field(default=None, ge=0)
    remote_blocks_expiry_time: float | None = None
    remote_registration_generation: int | None = None
    transfer_mode: str | None = None
    remote_prefill_cached_tokens: int | None = None
    # packed-row extensions
    block_size: int | None = Field(default=None, ge=1)
    subblock_tokens: int | None = Field(default=None, ge=1)
    layout_fingerprint: str | None = None
    remote_kda_block_ids: list[int] | None = None
    first_token_id: int | None = None
    first_token_logprob: float | None = None
    first_token_top_logprobs: list[tuple[int, float]] | None = None
    lease_id: str | None = None
    lease_expiry: float | None = None
    decode_engine_id: str | None = None
    """The decode instance that may redeem the hand-off (on the prefill leg: the one the router placed the request
    on); None: any decode node of the cluster, still once (the prefill node's claim, kv_transfer/lease.py)."""
    prompt_digest: str | None = None
    """SHA-256 of the prompt's token ids (kv_transfer.signing.prompt_digest): the hand-off serves only that prompt."""
    signature: str | None = None
    """HMAC of the signed fields under the cluster secret (kv_transfer.signing); the decode node refuses params
    without a valid one."""

    @classmethod
    def from_wire(cls, raw: dict[str, Any] | None) -> "KVTransferParams | None":
        """Parse a request/response body's kv_transfer_params (None stays None)."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise KVParamsError(f"kv_transfer_params must be an object, got {type(raw).__name__}")
        try:
            return cls.model_validate(raw)
        except ValueError as exc:
            raise KVParamsError(f"malformed kv_transfer_params: {exc}") from exc

    def to_wire(self) -> dict[str, Any]:
        """The JSON object to send: fields that were set (or parsed), unknown keys kept."""
        return self.model_dump(exclude_unset=True, mode="json")

    @classmethod
    def first_token_fields(cls, first: TokenEvent) -> dict[str, Any]:
        """The first-token fields for P's answer (a log-prob that is not known is left out)."""
        fields: dict[str, Any] = {"first_token_id": first.token_id}
        if not math.isnan(first.logprob):
            fields["first_token_logprob"] = first.logprob
        if first.top_logprobs:
            fields["first_token_top_logprobs"] = [list(pair) for pair in first.top_logprobs]
        return fields

    def first_token(self, request_id: str, num_prompt_tokens: int) -> TokenEvent:
        """The first-token event D streams for `request_id` (NaN log-prob when P sent none)."""
        logprob = math.nan if self.first_token_logprob is None else self.first_token_logprob
        top = tuple((int(i), float(lp)) for i, lp in self.first_token_top_logprobs or ())
        return TokenEvent(request_id=request_id, token_id=self.first_token_id, logprob=logprob, top_logprobs=top,
                          num_prompt_tokens=num_prompt_tokens)

    @property
    def attention_rows(self) -> list[int]:
        """P's attention row ids (group 0 of remote_block_ids)."""
        ids = self.remote_block_ids or []
        if ids and isinstance(ids[0], list):
            return list(ids[0])
        return list(ids)  # type: ignore[arg-type]

    @property
    def kda_rows(self) -> list[int]:
        return list(self.remote_kda_block_ids or [])


def prefill_request_params() -> KVTransferParams:
    """What a router sends P on the first leg (vLLM toy proxy shape)."""
    return KVTransferParams(
        do_remote_decode=True, do_remote_prefill=False, remote_engine_id=None, remote_block_ids=None,
        remote_host=None, remote_port=None,
    )


def check_readable(
    params: KVTransferParams,
    *,
    engine_id: str,
    fingerprint: str,
    num_rows: int,
    kda_groups: int,
    block_size: int,
    now: float | None = None,
) -> None:
    """Raise KVParamsError unless D may read these rows from the P instance described by the arguments
    (the metadata P serves on its side channel). Pure: touches no memory."""
    problems: list[str] = []
    for name in ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_num_tokens",
                 "layout_fingerprint", "block_size", "lease_id"):
        if getattr(params, name) is None:
            problems.append(f"{name} is missing")
    if problems:
        raise KVParamsError("; ".join(problems))
    if params.remote_engine_id != engine_id:
        raise KVParamsError(f"unknown remote_engine_id {params.remote_engine_id!r} (the side channel serves {engine_id!r})")
    if params.layout_fingerprint != fingerprint:
        raise KVParamsError(f"layout_fingerprint {params.layout_fingerprint!r} does not match P's {fingerprint!r}")
    if params.block_size != block_size:
        raise KVParamsError(f"block_size {params.block_size} does not match P's {block_size}")
    attn, kda = params.attention_rows, params.kda_rows
    need = -(-int(params.remote_num_tokens or 0) // block_size)
    if len(attn) != need:
        raise KVParamsError(f"remote_block_ids has {len(attn)} attention rows; {params.remote_num_tokens} tokens need {need}")
    if len(kda) != kda_groups:
        raise KVParamsError(f"remote_kda_block_ids has {len(kda)} rows; the model has {kda_groups} KDA groups")
    bad = [r for r in attn + kda if not 0 <= r < num_rows]
    if bad:
        raise KVParamsError(f"row ids {bad[:8]} out of range 0..{num_rows - 1}")
    if len(set(attn + kda)) != len(attn) + len(kda):
        raise KVParamsError("row ids repeat")
    now = time.time() if now is None else now
    if params.lease_expiry is not None and params.lease_expiry <= now:
        raise KVParamsError(f"lease {params.lease_id} expired {now - params.lease_expiry:.1f} s ago")
