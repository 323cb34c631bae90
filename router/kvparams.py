"""vLLM's PD wire protocol (`kv_transfer_params` in request/response bodies), typed.

- P leg: the client body with max_tokens=1 (and max_completion_tokens=1 when present), stream=false,
  no stream_options / min_tokens, and `kv_transfer_params` asking for a remote decode; for one of our decode
  instances (they report their engine id, router/readers.py), `decode_engine_id` names it: the prefill node signs
  it into the hand-off and every other decode node refuses it (403). A vLLM decode instance's leg names none.
- P answer: `kv_transfer_params` with do_remote_prefill, remote_engine_id, remote_request_id,
  remote_block_ids, remote_host, remote_port, tp_size, ... (`KVHandoff`); forwarded to D verbatim. A signed
  hand-off (a `signature` field, kv_transfer/signing.py: our prefill nodes) is never altered, else D refuses it;
  an unsigned one (vLLM) gets remote_host rewritten to P's URL host when the node reports localhost or nothing.
- D leg: the client body (never the client's own kv_transfer_params) plus the handoff params.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOCAL_HOSTS = (None, "", "localhost", "127.0.0.1", "0.0.0.0", "::1")
REQUIRED_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


# Not frozen: built per request, and a frozen dataclass's __init__ (object.__setattr__ per field) costs about
# twice a plain one on the hot path. Nothing mutates it once built (changes go through dataclasses.replace).
@dataclass
class KVHandoff:
    """P's answer, ready for D."""

    prefill: str
    params: dict[str, Any]

    @property
    def remote_engine_id(self) -> str | None:
        return self.params.get("remote_engine_id")

    @property
    def is_bound(self) -> bool:
        """The hand-off names the one decode engine that may redeem it."""
        return self.params.get("decode_engine_id") is not None


PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: dict[str, Any], reader: str | None = None) -> dict[str, Any]:
    """A new top-level dict (nested values shared with `body`, never mutated): serialised at once. `reader`: the
    engine id of the decode instance the hand-off is for (None: unknown, the hand-off is not bound)."""
    out = {k: v for k, v in body.items() if k not in PREFILL_DROPPED}
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    if reader is not None:
        out["kv_transfer_params"]["decode_engine_id"] = reader
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def handoff_from_answer(prefill: str, prefill_host: str, answer: Any) -> KVHandoff | None:
    """The handoff in P's JSON answer, or None when P returned none (nothing to transfer)."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    if any(key not in params for key in REQUIRED_KEYS if key != "remote_host"):
        return None
    params = dict(params)
    if "signature" not in params and params.get("remote_host") in LOCAL_HOSTS:
        params["remote_host"] = prefill_host
    return KVHandoff(prefill=prefill, params=params)


def decode_body(body: dict[str, Any], handoff: KVHandoff | None) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if handoff is not None:
        out["kv_transfer_params"] = dict(handoff.params)
    return out
