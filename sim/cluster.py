"""A simulated cluster: the real router state and policies in front of simulated instances (sim/instance.py).

Built from the same cluster YAML as `pdcluster up` (cluster/config.py): one `SimInstance` per pool instance
(`cluster.plan.instance_names`), the router's registry and pools from `cluster.plan.router_config`, its
`Settings` from the YAML's `router.settings`. Each request runs the router's path with the simulated clock:
`router.service.place_request` (sessions, placement over the pairing matrix, cache view, conditional
disaggregation, admission), the P leg (export on the prefill instance), the D leg (import, READ timed by the
profile's transfer cost, `start_decode`; or colocated), and at its end the router's own bookkeeping
(`admission.leave`, the session record, `router.session_routing.after_turn`). The router's view of the nodes is
refreshed as the real one is: load facts every `health_interval_s`, cache reports every `cache_poll_interval_s`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from cluster.config import ClusterConfig, node_settings_class
from cluster.plan import instance_names, router_config
from engine.layout import plan_layout
from engine.model.config import resolve_model
from kv_transfer.capacity import GPU_PROFILES, plan_capacity
from loadgen.records import RequestRecord, http_kind
from loadgen.schedule import Message, RequestSpec
from router.admission import PoolFull
from router.config import RouterConfig
from router.facts import CacheFacts, LoadFacts, ModelFacts
from router.identity import ANONYMOUS, session_key
from router.placement import RequestShape, SessionRecord
from router.service import place_request
from router.session_routing import after_turn, prompt_estimate
from router.settings import Settings as RouterSettings
from router.state import RouterState
from serving.errors import APIError
from sim.events import EventLoop
from sim.instance import Flight, HostCores, InstanceSpec, SimInstance
from sim.profile import Profile
from sim.stream import chunk_times
from sim.tokens import Interner, TokenRuns, extends


LAST_PROMPTS = 4096
"""Sessions whose latest prompts a cluster keeps for the next turn to extend (most recently sent first kept)."""
PROMPTS_PER_SESSION = 8
"""Prompts kept per session (the forks of an agent run branches beside its main line)."""


@dataclass
class _Node:
    """What `cluster.plan.router_config` reads of a planned node."""

    name: str
    role: str
    url: str
    pool: str
    engine: str
    tp: int
    dcp: int


def _num_rows(config: ClusterConfig, pool, profile: Profile, layout, explicit: dict, default: int) -> int:
    """Rows per rank: the pool's `num_rows` when set, else the capacity planner's for the profile's GPU."""
    if "num_rows" in explicit or profile.gpu is None:
        return default
    if profile.gpu not in GPU_PROFILES:
        raise ValueError(f"profile gpu {profile.gpu!r} is not a kv_transfer/capacity.py GPU "
                         f"({', '.join(sorted(GPU_PROFILES))})")
    world = max(pool.tp, pool.dcp)
    parallel = f"dcp{world}" if pool.dcp > 1 else f"tp{world}"
    plan = plan_capacity(resolve_model(config.model_of(pool)), profile.gpu, world, parallel,
                         layout.latent_format, layout.index_key_format, block_size=layout.block_size)
    return plan.rows_per_gpu


class SimCluster:
    def __init__(self, config: ClusterConfig, profile: Profile, loop: EventLoop | None = None,
                 record_chunks: bool = True) -> None:
        if not record_chunks and not profile.stream.is_every_token:
            raise ValueError(f"profile {profile.name!r} sends a chunk for some tokens only (stream.text_token_p "
                             f"{profile.stream.text_token_p}, first_token_p {profile.stream.first_token_p}): its TTFT "
                             "needs every token's time, so it cannot run without chunk times (--no-chunk-times)")
        self.config = config
        self.profile = profile
        self.loop = loop or EventLoop()
        self.interner = Interner()
        self.host = HostCores(profile.host_cores)
        self.instances: dict[str, SimInstance] = {}
        nodes = []
        for pool in config.pools:
            self._add_pool(pool, nodes, record_chunks)
        raw = router_config(config, nodes)
        router_settings = dict(raw.pop("router"))
        if profile.template.kind == "words" and "prompt_estimate" not in router_settings:
            router_settings["prompt_estimate"] = "chars"
        self.state = RouterState(RouterSettings(**router_settings), RouterConfig.model_validate(raw), client=None)
        self._register_facts()
        self.num_inflight = 0
        self._is_polling = False
        self._seq = 0
        self.last_prompts: OrderedDict[str, list[tuple[weakref.ref[RequestSpec], TokenRuns, int]]] = OrderedDict()
        """Per session, its latest requests, prompts and the router's estimates of them, least recently used first
        (sim/tokens.py `Template.prompt`, `TokenRuns.continues`, `prompt_estimate` here): the branches of an agent's
        fork and its main line each extend their own. The requests are held weakly: a finished session's texts are
        not kept alive."""
        self._base_estimate = prompt_estimate(self.state, {"messages": []})

    def _add_pool(self, pool, nodes: list, record_chunks: bool) -> None:
        cfg = resolve_model(self.config.model_of(pool))
        settings = node_settings_class(pool.role).model_validate(pool.settings)
        eng = settings.engine
        world = max(pool.tp, pool.dcp)
        layout = plan_layout(cfg, tp_size=world, dcp_size=pool.dcp, latent_format=self.profile.latent,
                             index_key_format=self.profile.index_key, block_size=eng.block_size)
        cost = self.profile.step(pool.tp, pool.dcp)
        num_rows = _num_rows(self.config, pool, self.profile, layout, pool.settings, eng.num_rows)
        for name in instance_names(pool):
            spec = InstanceSpec(name=name, role=pool.role, pool=pool.name, tp=pool.tp, dcp=pool.dcp,
                                num_rows=num_rows, max_batch=eng.max_batch, max_step_tokens=eng.max_step_tokens,
                                prefix_cache=eng.prefix_cache, max_context=settings.max_context or cfg.max_context,
                                decode_first_tokens=eng.decode_first_tokens)
            self.instances[name] = SimInstance(spec, cfg, layout, cost, self.loop, record_chunks, self.host)
            nodes.append(_Node(name, pool.role, f"http://sim-{name}:8000", pool.name, "reference", pool.tp, pool.dcp))

    def _register_facts(self) -> None:
        registry = self.state.registry
        for name, inst in self.instances.items():
            st = registry.get(name)
            lay = inst.layout
            st.cache = CacheFacts(block_size=lay.block_size, cache_dtype=f"{lay.latent_format}+{lay.index_key_format}",
                                  num_gpu_blocks=inst.spec.num_rows, layout_fingerprint=lay.fingerprint,
                                  tp_size=max(inst.spec.tp, inst.spec.dcp), dcp_size=inst.spec.dcp,
                                  engine="reference")
            st.models = ModelFacts(model_ids=(self.config.model,), max_model_len=inst.spec.max_context,
                                   weights_fingerprint="sim-weights")
            st.is_healthy = True
        registry.recompute_matrix()
        for name in self.instances:
            self.state.cache_view.apply_report(name, self.instances[name].cache_report(), self.loop.now)

    # ---- the router's periodic view of the nodes ----
    def _poll_health(self) -> None:
        registry = self.state.registry
        for name, inst in self.instances.items():
            running, waiting, usage = inst.load()
            registry.get(name).load = LoadFacts(running, waiting, usage)
        self._reschedule(self.state.settings.health_interval_s, self._poll_health)

    def _poll_caches(self) -> None:
        now = self.loop.now
        for name, inst in self.instances.items():
            self.state.cache_view.apply_report(name, inst.cache_report(), now)
        self._reschedule(self.state.settings.cache_poll_interval_s, self._poll_caches)

    def _reschedule(self, delay: float, fn: Callable[[], None]) -> None:
        if self.num_inflight > 0:
            self.loop.after(delay, fn)
        else:
            self._is_polling = False

    def _start_polling(self) -> None:
        if not self._is_polling:
            self._is_polling = True
            self.loop.after(self.state.settings.health_interval_s, self._poll_health)
            self.loop.after(self.state.settings.cache_poll_interval_s, self._poll_caches)

    # ---- one request ----
    def send(self, spec: RequestSpec, concurrency: int, done: Callable[[RequestRecord], None],
             origin: float = 0.0, queued_s: float = 0.0) -> None:
        """The client sends `spec` now; `done(record)` is called when it ends (any outcome). Record times are
        seconds after `origin` (the level's start)."""
        self.num_inflight += 1
        self._start_polling()
        flow = _Flow(self, spec, concurrency, self.loop.now, done, origin, queued_s)
        self.loop.after(self.profile.http.router_s, flow.route)

    def prompt_estimate(self, messages: Sequence[Message], earlier: tuple[int, int] | None = None) -> int:
        """The router's `prompt_estimate` of a chat body of `messages`. It is a constant plus one figure per
        message (router/placement.py), so with `earlier` = (n, the estimate of messages[:n]) only the messages
        past n are estimated: a session's turn re-sends every earlier message of the turn it extends."""
        done, total = (0, self._base_estimate) if earlier is None else earlier
        body = {"messages": [{"role": m.role, "content": m.content} for m in messages[done:]]}
        return total + prompt_estimate(self.state, body) - self._base_estimate

    def busy_s(self) -> dict[str, float]:
        return {name: inst.busy_s for name, inst in self.instances.items()}


class _Flow:
    """One request's path through the router and its legs."""

    def __init__(self, cluster: SimCluster, spec: RequestSpec, concurrency: int, start: float,
                 done: Callable[[RequestRecord], None], origin: float, queued_s: float) -> None:
        self.c, self.spec, self.concurrency, self.start, self.done = cluster, spec, concurrency, start, done
        self.origin, self.queued_s = origin, queued_s
        recent = cluster.last_prompts.pop(spec.session_id, []) if spec.session_id else []
        recent = [entry for entry in recent if entry[0]() is not None]  # a finished session's specs are gone
        found = next((k for k in range(len(recent) - 1, -1, -1) if extends(spec.messages, recent[k][0]().messages)),
                     None)
        earlier = None if found is None else recent[found]
        earlier_messages = None if earlier is None else earlier[0]().messages
        self.prompt: TokenRuns = cluster.profile.template.prompt(
            spec.messages, cluster.interner, None if earlier is None else (earlier_messages, earlier[1]))
        self.estimate = cluster.prompt_estimate(spec.messages, None if earlier is None else
                                                (len(earlier_messages), earlier[2]))
        if spec.session_id:  # a turn re-sends an earlier prompt of its session: its block encodings serve this one's
            if earlier is not None:
                self.prompt.continues(earlier[1])
                recent.append(recent.pop(found))  # a fork's turns and the main line after it extend the fork's prompt
            recent.append((weakref.ref(spec), self.prompt, self.estimate))
            del recent[:-PROMPTS_PER_SESSION]
            cluster.last_prompts[spec.session_id] = recent
            if len(cluster.last_prompts) > LAST_PROMPTS:  # the session least recently sent a turn
                cluster.last_prompts.popitem(last=False)
        self.times: list[float] = []
        self.num_tokens = 0
        self.prefill_cached: int | None = None
        self.handoff = None
        self.placement = None
        self.shape = None
        self.rid = f"{spec.request_id}#{cluster._seq}"
        cluster._seq += 1

    def _record(self, outcome: str, **kw) -> RequestRecord:
        """The client's record, validated as `RequestRecord(**fields)` validates it (`model_validate` of the same
        fields skips the constructor's keyword packing: about half the cost, once per simulated request)."""
        kw.update(request_id=self.spec.request_id, session_id=self.spec.session_id, concurrency=self.concurrency,
                  outcome=outcome, start_s=self.start - self.origin, end_s=self.c.loop.now - self.origin,
                  queued_s=self.queued_s, num_input_tokens=self.spec.num_input_tokens, max_tokens=self.spec.max_tokens)
        return RequestRecord.model_validate(kw)

    def _fail(self, status: int, message: str) -> None:
        self.c.num_inflight -= 1
        self.done(self._record("error", error_kind=http_kind(status), error=message, http_status=status))

    def route(self) -> None:
        c, spec = self.c, self.spec
        state, now = c.state, c.loop.now
        key = session_key(ANONYMOUS, {"x-session-id": spec.session_id}, {}) if spec.session_id else None
        self.shape = RequestShape(key, self.estimate, spec.max_tokens,
                                  state.settings.session_growth_tokens)
        try:
            self.placement = place_request(state, self.shape, now)
        except PoolFull as exc:
            return self._fail(429, str(exc))
        except APIError as exc:
            return self._fail(exc.status, exc.message)
        p = self.placement
        decode = c.instances[p.decode]
        if len(self.prompt) + spec.max_tokens > decode.spec.max_context:
            state.admission.leave(p.pool)
            return self._fail(400, f"the request needs {len(self.prompt) + spec.max_tokens} tokens of context, "
                                   f"the model's maximum is {decode.spec.max_context}")
        state.registry.get(p.decode).num_inflight += 1
        if p.disaggregate:
            prefill = p.prefills[0]
            self.handoff = SimpleNamespace(prefill=prefill)
            state.registry.get(prefill).num_inflight += 1
            flight = Flight(c.interner.fresh(), self._no_tokens, on_exported=self._exported)
            c.instances[prefill].submit(self.rid, self.prompt, 1, flight, export=True, session=key or "")
        else:
            c.loop.after(c.profile.http.decode_leg_s, self._colocated)

    def _no_tokens(self, times: list[float], count: int) -> None:
        return None

    def _flight(self) -> Flight:
        return Flight(self.c.interner.fresh(), self._tokens, on_imported=self._imported, on_finished=self._finished)

    def _colocated(self) -> None:
        inst = self.c.instances[self.placement.decode]
        inst.submit(self.rid, self.prompt, self.spec.max_tokens, self._flight(), session=self.shape.session_id or "")

    def _exported(self, now: float, cached: int, generation: int) -> None:
        self.prefill_cached = cached
        self.generation = generation
        self.c.loop.after(self.c.profile.http.prefill_leg_s + self.c.profile.http.decode_leg_s, self._decode_leg)

    def _decode_leg(self) -> None:
        c, p = self.c, self.placement
        c.state.registry.get(self.handoff.prefill).num_inflight -= 1
        c.state.set_warm((self.handoff.prefill, p.decode), True)
        c.instances[p.decode].submit_import(self.rid, self.prompt, self.spec.max_tokens, self._flight(),
                                            session=self.shape.session_id or "")

    def _imported(self, now: float, num_rows: int, reused_tokens: int) -> None:
        c = self.c
        row_bytes = c.instances[self.placement.decode].layout.row_bytes
        read_s = c.profile.transfer.read_s(num_rows, num_rows * row_bytes)
        c.loop.after(read_s, self._read_done)

    def _read_done(self) -> None:
        c = self.c
        c.instances[self.placement.decode].start_decode(self.rid)
        c.instances[self.handoff.prefill].release(self.rid, self.generation)

    def _tokens(self, times: list[float], count: int) -> None:
        self.times.extend(times)
        self.num_tokens += count

    def _finished(self, now: float, req) -> None:  # noqa: ANN001 - engine.scheduler.Request
        c, p, state = self.c, self.placement, self.c.state
        prompt, completion = len(req.prompt_token_ids), len(req.output_token_ids)
        cached = self.prefill_cached if self.handoff is not None else req.num_cached_tokens
        state.admission.leave(p.pool)
        state.registry.get(p.decode).num_inflight -= 1
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.shape.session_id:
            state.sessions.put(SessionRecord(self.shape.session_id, p.pool, p.decode, prompt + completion, now))
        ctx = SimpleNamespace(placement=p, shape=self.shape, handoff=self.handoff, prefill_cached_tokens=cached)
        after_turn(state, ctx, usage, now)
        c.num_inflight -= 1
        stream = c.profile.stream
        times = chunk_times(self.times, stream.text_token_p, self.rid, stream.first_token_p)
        ttft, e2e = times[0] - self.start, times[-1] - self.start
        tpot = (e2e - ttft) / (completion - 1) if completion > 1 else None
        itl = [b - a for a, b in zip(times, times[1:])] if c.instances[p.decode].record_chunks else []
        self.done(self._record("ok", chunk_s=[t - self.origin for t in times], prompt_tokens=prompt, completion_tokens=completion,
                               cached_tokens=cached, output_tokens=completion, tokens_from_usage=True,
                               ttft_s=ttft, e2e_s=e2e, tpot_s=tpot, itl_s=itl))
