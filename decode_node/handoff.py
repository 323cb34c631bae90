"""The decode node's first check of a hand-off, before any connection or memory access.

`HandoffGate.admit(params, prompt_token_ids)` answers APIError 403 (OpenAI JSON) unless:
- the params carry a valid signature under the cluster secret (kv_transfer/signing.py; constant-time compare), so
  every field naming memory, a peer or a lease is what a prefill node of this cluster wrote;
- `lease_id` and `remote_engine_id` have the shapes this cluster issues (nothing else reaches a URL path or a
  NIXL notification);
- `prompt_digest` matches the request's own prompt (a hand-off serves only the prompt whose rows it names);
- `decode_engine_id`, where the hand-off names one, is this node's (a hand-off issued for another decode
  instance is refused here, and its prefill node would refuse this node's claim too);
- the lease was not presented here before: a replayed hand-off would read rows its prefill node may already have
  given to another request. The check and the mark are one synchronous step (no await between them), so two
  concurrent presentations on this node cannot both pass; across nodes and restarts the prefill node's claim
  (kv_transfer/lease.py, decode_node/importer.py) is the authority, this memory only the first, local refusal.
A node started with `insecure_handoffs` (no secret) skips the signature but keeps the other checks.
The replay memory holds each admitted lease until its expiry, at most `max_remembered` (the oldest go first).
"""

from __future__ import annotations

import collections
import time

from kv_transfer.params import KVTransferParams
from kv_transfer.signing import ClusterSecret, HandoffRefused, check_ids, prompt_digest, verify
from serving.errors import APIError


class HandoffGate:
    """Signature, id, prompt and replay checks of remote-prefill params (see the module docstring)."""

    def __init__(self, secret: ClusterSecret | None, engine_id: str, max_remembered: int = 100_000) -> None:
        self.secret = secret
        self.engine_id = engine_id
        """This decode node's engine id: the reader it claims leases as."""
        self.max_remembered = max_remembered
        self._consumed: collections.OrderedDict[str, float] = collections.OrderedDict()

    def admit(self, params: KVTransferParams, prompt_token_ids: list[int], now: float | None = None) -> None:
        """Every check of the module docstring, then the lease is marked as presented here (atomically: this
        method never awaits)."""
        try:
            if self.secret is not None:
                verify(params, self.secret)
            else:
                check_ids(params)
        except HandoffRefused as exc:
            raise APIError(403, str(exc), "kv_transfer_params") from None
        if self.secret is not None or params.prompt_digest is not None:
            if params.prompt_digest != prompt_digest(prompt_token_ids):
                raise APIError(403, "kv_transfer_params belong to another prompt", "kv_transfer_params")
        if params.decode_engine_id is not None and params.decode_engine_id != self.engine_id:
            raise APIError(403, "kv_transfer_params were issued for another decode instance", "kv_transfer_params")
        if params.lease_id in self._consumed:
            raise APIError(403, "kv_transfer_params were already used (a hand-off is read once)",
                           "kv_transfer_params")
        self._remember(params, time.time() if now is None else now)

    def _remember(self, params: KVTransferParams, now: float) -> None:
        """Remember the lease as presented here (until it expires)."""
        while self._consumed:
            oldest, expiry = next(iter(self._consumed.items()))
            if expiry > now and len(self._consumed) < self.max_remembered:
                break
            del self._consumed[oldest]
        if params.lease_id is not None:
            self._consumed[params.lease_id] = float(params.lease_expiry or now + 3600.0)

    @property
    def num_remembered(self) -> int:
        return len(self._consumed)
