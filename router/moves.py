"""Moving a request whose decode instance failed (router/migration.py says what and why): place it again and, for
a stream, open its continuation for the relay.

`Mover.move(reason)` counts the failure, aborts the lost legs, and places the request again (the usual placement
over our engine's decode instances that serve the same weights, the failed ones blocked, no session stickiness:
the prompt grows by the tokens already sent, which may move it to a larger pool); the request then carries
`resume_token_ids` and its next leg id; a stream its draining instance moved out with its KV (reason "drain",
decode_node/moves.py) goes to the new instance with those params and no P leg, its lease bound to that instance
first (router/readers.py `bind_move`: a lease that cannot be bound is given back at its source and the stream
recomputed on the new instance), and falls back to the recompute when that instance refuses or fails it. It raises APIError (the client's one error) when the request may not move
again or no instance can take it. `StreamResume` is the relay's `Resumer`: move, run the P leg when the new
placement has one, open the stream; a new instance that fails before its first chunk is moved from as well.
"""

from __future__ import annotations

import time
from dataclasses import replace

from router.kvparams import KVHandoff
from router.placement import NoPlacement, Placement, place
from router.proxy import DecodeFailed, Orchestrator, RequestContext, UpstreamReply
from router.relay import StreamAccounting
from router.state import RouterState
from serving.errors import APIError


def resume_placement(state: RouterState, ctx: RequestContext, num_sent: int, now: float) -> Placement:
    """Where the request continues: NoPlacement when no compatible decode instance is usable."""
    assert ctx.migration is not None
    reg = state.registry
    lost = reg.get(ctx.placement.decode)
    weights = reg.view(lost).geometry.weights if lost is not None else None
    instances = [v for v in reg.snapshot() if v.role != "decode"
                 or (v.geometry.engine == "reference" and (weights is None or v.geometry.weights == weights))]
    shape = replace(ctx.shape, prompt_tokens=ctx.shape.prompt_tokens + num_sent)
    blocked = state.blocked_instances(now) | frozenset(ctx.migration.failed)
    session = ctx.shape.session_id
    return place(shape, None, state.pool_views(instances), instances, state.usable_pairs(now), state.warm_pairs,
                 state.settings.disagg_min_uncached_tokens, blocked=blocked,
                 held=state.cache_view.held(session), resumable=state.cache_view.resumable(session))


class Mover:
    def __init__(self, state: RouterState, orch: Orchestrator, ctx: RequestContext) -> None:
        assert ctx.migration is not None
        self.state, self.orch, self.ctx = state, orch, ctx
        self.migration = ctx.migration

    def move(self, reason: str, sent_token_ids: list[int] = (), moved: dict | None = None) -> None:
        """Leave the failed decode instance for another one (raises APIError when it cannot). `moved`: the signed
        params of a stream its draining instance moved out with its KV: the next instance READs them (no P leg)."""
        ctx, mig, now = self.ctx, self.migration, time.monotonic()
        lost = ctx.placement.decode
        mig.note_failure(lost, reason, now)
        self.state.metrics.migrations.labels(reason).inc()
        if moved is None:  # a moved stream ended itself: an abort there would end the lease on its rows
            self.orch.abort_legs(ctx)
        if not mig.can_move(now):
            raise APIError(502, mig.exhausted_message(now))
        try:
            placement = resume_placement(self.state, ctx, len(sent_token_ids), now)
        except NoPlacement as exc:
            raise APIError(503, f"the decode instance failed ({reason}) and no other can resume the request: "
                                f"{exc}") from None
        if ctx.is_admitted:
            self.state.admission.move(ctx.placement.pool, placement.pool)
        mig.num_moves += 1
        reason_text = f"moved from {lost} ({reason}{', with its KV' if moved else ''}) to {placement.decode}"
        ctx.placement = replace(placement, reason=f"{placement.reason}; {reason_text}")
        ctx.handoff = None
        if moved is not None:
            ctx.placement = replace(ctx.placement, prefills=(), disaggregate=False)
            ctx.handoff = KVHandoff(prefill=lost, params=moved)
        ctx.prefill_cached_tokens = None
        ctx.outcome, ctx.error = "ok", None
        if sent_token_ids:
            ctx.valid.body["resume_token_ids"] = list(sent_token_ids)


class StreamResume:
    """The relay's `Resumer` for one stream (router/relay.py)."""

    def __init__(self, mover: Mover, acct: StreamAccounting) -> None:
        self.mover, self.acct = mover, acct
        self.message = ""

    def client_bytes(self, chunk: bytes) -> bytes:
        return self.mover.migration.client_bytes(chunk)

    async def reopen(self, reason: str):
        mover, ctx = self.mover, self.mover.ctx
        state = mover.state
        lost = state.registry.get(ctx.placement.decode)
        if lost is not None:
            lost.num_inflight -= 1  # the relayed stream's count (open_stream took it)
        if ctx.stream_attempts is not None:  # the lost stream failed its instance (and link) breakers
            mover.orch.record_decode_status(ctx, ctx.stream_attempts, None)
        paused_since = self.acct.token_times[-1] if self.acct.token_times else None
        moved = self.acct.move_params if reason == "drain" else None
        while True:
            try:
                source, lost_leg = ctx.placement.decode, ctx.leg_request_id
                mover.move(reason, self.acct.token_ids, moved)
                if moved is not None:
                    moved = await self._bind(source, lost_leg, moved)
                if ctx.placement.disaggregate:
                    ctx.handoff = await mover.orch.prefill(ctx)
                opened = await mover.orch.open_stream(ctx)
            except DecodeFailed as exc:
                reason, moved = exc.reason, None  # from here on: recompute
                continue
            except UpstreamReply as exc:
                if moved is None:
                    self.message = str(exc)
                    self._restore_inflight()
                    return None
                reason, moved = "drain", None  # the next instance refused the move (4xx): recompute instead
                continue
            except APIError as exc:
                self.message = exc.message
                self._restore_inflight()
                return None
            if paused_since is not None:
                state.metrics.resume_latency.labels().observe(time.monotonic() - paused_since)
            return opened

    async def _bind(self, source: str, lost_leg: str, moved: dict) -> dict | None:
        """Bind the moved stream's lease to the instance it now goes to (router/readers.py `bind_move`): the params,
        or None when it could not be bound (the lease is given back at its source and the stream is recomputed
        there, on the instance already chosen)."""
        state, ctx = self.mover.state, self.mover.ctx
        problem = await state.readers.bind_move(source, moved.get("lease_id"), ctx.placement.decode)
        if problem is None:
            return moved
        ctx.notes.append(problem)
        ctx.handoff = None
        self.mover.orch.abort(state.registry.get(source), lost_leg)
        return None

    def _restore_inflight(self) -> None:
        """The relay's end decrements the current decode's count once: take it again when no stream opened."""
        decode = self.mover.state.registry.get(self.mover.ctx.placement.decode)
        if decode is not None:
            decode.num_inflight += 1
