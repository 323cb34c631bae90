"""The decode node's first check of a hand-off, before any connection or memory access.

`HandoffGate.check(params, prompt_token_ids)` answers APIError 403 (OpenAI JSON) unless:
- the params carry a valid signature under the cluster secret (kv_transfer/signing.py; constant-time compare), so
  every field naming memory, a peer or a lease is what a prefill node of this cluster wrote;
- `lease_id` and `remote_engine_id` have the shapes this cluster issues (nothing else reaches a URL path or a
  NIXL notification);
- `prompt_digest` matches the request's own prompt (a hand-off serves only the prompt whose rows it names);
- the lease was not used here before (`consume`, called when the import is sent to the ranks): a replayed
  hand-off would read rows its prefill node may already have given to another request.
A node started with `insecure_handoffs` (no secret) skips the signature but keeps the other checks.
The replay memory holds each consumed lease until its expiry, at most `max_remembered` (the oldest go first).
"""

from __future__ import annotations

import collections
import time

from kv_transfer.params import KVTransferParams
from kv_transfer.signing import ClusterSecret, HandoffRefused, check_ids, prompt_digest, verify
from serving.errors import APIError


class HandoffGate:
    """Signature, id, prompt and replay checks of remote-prefill params (see the module docstring)."""

    def __init__(self, secret: ClusterSecret | None, max_remembered: int = 100_000) -> None:
        self.secret = secret
        self.max_remembered = max_remembered
        self._consumed: collections.OrderedDict[str, float] = collections.OrderedDict()

    def check(self, params: KVTransferParams, prompt_token_ids: list[int]) -> None:
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
        if params.lease_id in self._consumed:
            raise APIError(403, "kv_transfer_params were already used (a hand-off is read once)",
                           "kv_transfer_params")

    def consume(self, params: KVTransferParams, now: float | None = None) -> None:
        """Remember the lease as read from here (until it expires)."""
        now = time.time() if now is None else now
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
