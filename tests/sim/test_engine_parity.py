"""A simulated instance makes the engine's decisions: the same requests through the real reference `Engine` and
through `SimInstance` (run-length prompts of the same shape) reuse the same prefix-cache tokens, take the same
number of steps and leave the same free rows, with the prefix cache, prompt tails and chunked prefill at work."""

from __future__ import annotations

import pytest

from engine.engine import Engine, EngineConfig
from engine.layout import plan_layout
from engine.model.config import get_preset
from engine.sampling import SamplingParams
from sim.events import EventLoop
from sim.instance import Flight, InstanceSpec, SimInstance
from sim.profile import StepCost
from sim.tokens import TokenRuns

# (request id, pieces of the prompt as (text id, tokens), max_tokens): the same shared prefix, a turn that extends
# an earlier prompt, a branch, a repeat
REQUESTS = (
    ("a", ((1, 1100), (2, 300)), 5),
    ("b", ((1, 1100), (3, 200)), 4),
    ("c", ((1, 1100), (2, 300), (4, 150)), 6),
    ("d", ((1, 1100), (3, 200)), 3),
)
ROWS, BATCH, CHUNK = 48, 4, 256


def _ids(pieces) -> list[int]:
    out = [256]  # BOS
    for text, count in pieces:
        out += [(text * 53 + i * 37) % 251 for i in range(count)]
    return out


def _runs(pieces) -> TokenRuns:
    return TokenRuns([(100, 0, 1)] + [(text, 0, count) for text, count in pieces])


def _engine_run() -> list[tuple[int, int, int]]:
    engine = Engine(EngineConfig(model="kimi-k3.1-mini", num_rows=ROWS, max_batch=BATCH, max_step_tokens=CHUNK,
                                 prefix_cache=True))
    out = []
    for rid, pieces, max_tokens in REQUESTS:
        engine.add_request(rid, _ids(pieces), SamplingParams(max_tokens=max_tokens, ignore_eos=True), session="s")
        steps, cached = 0, None
        while True:
            steps += 1
            events = [e for e in engine.step().tokens if e.request_id == rid]
            cached = events[-1].num_cached_tokens if events else cached
            if events and events[-1].finish_reason:
                break
        out.append((cached, steps, engine.pool.num_free))
    return out


def _sim_run() -> list[tuple[int, int, int]]:
    cfg = get_preset("kimi-k3.1-mini")
    spec = InstanceSpec("d", "decode", "tp", 1, 1, ROWS, BATCH, CHUNK, True, cfg.max_context)
    loop = EventLoop()
    inst = SimInstance(spec, cfg, plan_layout(cfg), StepCost(tp=1, base_s=0.01), loop)
    out = []
    for k, (rid, pieces, max_tokens) in enumerate(REQUESTS):
        done = {}
        before = inst.num_steps
        flight = Flight(1000 + k, lambda times, n: None, on_finished=lambda t, req: done.setdefault("req", req))
        inst.submit(rid, _runs(pieces), max_tokens, flight, session="s")
        loop.run()
        out.append((done["req"].num_cached_tokens, inst.num_steps - before, inst.pool.num_free))
    return out


@pytest.mark.slow
def test_sim_instance_matches_the_engine() -> None:
    real, sim = _engine_run(), _sim_run()
    assert sim == real
    assert [cached for cached, _, _ in real][1:] != [0, 0, 0], "the case must exercise cache hits"
