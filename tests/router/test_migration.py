"""Request migration, router side (fake nodes that honour `resume_token_ids` as our nodes do, tests/router/fakes.py;
the bit-exact continuation itself is tests/engine/test_resume.py, tests/node/test_resume_text.py and the e2e
fault tests): a decode instance that fails mid-stream (error event, cut stream) or before answering (5xx) hands
the request to another one with the tokens already sent; the client sees one stream with one id, every token
once, the usage of the last leg; the seed is fixed at the first placement; `migration_limit` bounds the moves and
ends the stream with one error event; vLLM pools are not resumed; a stream a draining node moved out with its KV
goes to the next instance with the mover's params and no abort of the lost leg, and falls back to the recompute
when that instance refuses the move."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.config import PoolSpec
from serving.errors import DRAINING_HEADER
from tests.router.fakes import FakeNode
from tests.router.harness import completion, router_harness

REFERENCE = {"engine": "reference"}


def _events(text: str) -> list:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


async def _stream(client, body: dict) -> tuple[list[dict], list[str]]:
    resp = await client.post("/v1/completions", json={**body, "stream": True})
    assert resp.status_code == 200, resp.text
    events = _events(resp.text)
    return [json.loads(e) for e in events if e != "[DONE]"], events


def _decodes(*nodes: FakeNode) -> dict[str, dict]:
    return {node.name: REFERENCE for node in nodes}


@pytest.mark.parametrize("failure", ["error_event", "cut"])
def test_a_stream_continues_on_another_decode_instance(failure: str) -> None:
    asyncio.run(_test_a_stream_continues_on_another_decode_instance(failure))


async def _test_a_stream_continues_on_another_decode_instance(failure: str) -> None:
    lost = FakeNode("d1", "decode", num_tokens=6, engine_label="reference",
                    **({"stream_error_after": 2} if failure == "error_event" else {"cut_after": 2}))
    other = FakeNode("d2", "decode", num_tokens=6, engine_label="reference")
    other_pool = [PoolSpec(name="default", kind="tp")]
    async with router_harness([lost, other], other_pool, specs=_decodes(lost, other)) as (client, app):
        # d1 is the least loaded by name; the stream starts there
        chunks, events = await _stream(client, completion(max_tokens=6, temperature=0.7,
                                                          stream_options={"include_usage": True}))
        metrics = (await client.get("/metrics")).text
    assert events[-1] == "[DONE]" and not any("error" in c for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == "t0 t1 t2 t3 t4 t5 "  # every token once
    assert all("token_ids" not in c["choices"][0] for c in chunks if c["choices"])  # the client did not ask
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}  # one id
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert other.bodies[0]["resume_token_ids"] == [100, 101]
    seed = lost.bodies[0]["seed"]
    assert isinstance(seed, int) and other.bodies[0]["seed"] == seed  # fixed at the first placement
    assert other.request_ids[0] == f"{lost.request_ids[0]}-m1"  # a new leg id; the lost leg is aborted
    assert lost.request_ids[0] in lost.aborted
    reason = "error_event" if failure == "error_event" else "stream_broke"
    assert f'pdcluster_migrations_total{{reason="{reason}"}} 1.0' in metrics
    assert "pdcluster_resume_latency_seconds_count 1.0" in metrics


def test_a_client_asking_for_token_ids_gets_them_and_its_seed_is_kept() -> None:
    asyncio.run(_test_a_client_asking_for_token_ids_gets_them_and_its_seed_is_kept())


async def _test_a_client_asking_for_token_ids_gets_them_and_its_seed_is_kept() -> None:
    lost = FakeNode("d1", "decode", num_tokens=5, engine_label="reference", stream_error_after=3)
    other = FakeNode("d2", "decode", num_tokens=5, engine_label="reference")
    async with router_harness([lost, other], specs=_decodes(lost, other)) as (client, _):
        chunks, _ = await _stream(client, completion(max_tokens=5, seed=42, return_token_ids=True))
    assert [c["choices"][0]["token_ids"] for c in chunks if c["choices"]] == [[100], [101], [102], [103], [104]]
    assert lost.bodies[0]["seed"] == other.bodies[0]["seed"] == 42


def test_the_migration_limit_ends_the_stream_with_one_error() -> None:
    asyncio.run(_test_the_migration_limit_ends_the_stream_with_one_error())


async def _test_the_migration_limit_ends_the_stream_with_one_error() -> None:
    nodes = [FakeNode(f"d{i}", "decode", num_tokens=6, engine_label="reference", stream_error_after=i + 1)
             for i in range(4)]
    async with router_harness(nodes, specs=_decodes(*nodes), migration_limit=2) as (client, _):
        chunks, events = await _stream(client, completion(max_tokens=6))
    errors = [c for c in chunks if "error" in c]
    assert len(errors) == 1 and "moved 2 time(s)" in errors[0]["error"]["message"] and events[-1] == "[DONE]"
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert text == "t0 t1 t2 "  # d0 sent t0, d1 t1 and t2 (resumed after t0); then the limit
    assert sum(1 for n in nodes if n.bodies) == 3


def test_a_5xx_before_the_first_byte_moves_a_non_streamed_request() -> None:
    asyncio.run(_test_a_5xx_before_the_first_byte_moves_a_non_streamed_request())


async def _test_a_5xx_before_the_first_byte_moves_a_non_streamed_request() -> None:
    lost = FakeNode("d1", "decode", engine_label="reference", fail_status=500)
    other = FakeNode("d2", "decode", engine_label="reference")
    async with router_harness([lost, other], specs=_decodes(lost, other)) as (client, _):
        resp = await client.post("/v1/completions", json=completion(temperature=1.0))
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "t0 t1 t2 t3 "
    assert "resume_token_ids" not in other.bodies[0] and other.bodies[0]["seed"] == lost.bodies[0]["seed"]


def test_vllm_pools_do_not_resume() -> None:
    asyncio.run(_test_vllm_pools_do_not_resume())


async def _test_vllm_pools_do_not_resume() -> None:
    lost = FakeNode("d1", "decode", num_tokens=6, stream_error_after=2)
    other = FakeNode("d2", "decode", num_tokens=6)
    async with router_harness([lost, other]) as (client, _):
        chunks, _ = await _stream(client, completion(max_tokens=6))
    assert [c for c in chunks if "error" in c] and not other.bodies
    assert "seed" not in lost.bodies[0] and "return_token_ids" not in lost.bodies[0]


def test_a_moved_stream_reports_the_cached_tokens_of_the_placement_that_finished_it() -> None:
    asyncio.run(_test_a_moved_stream_reports_the_cached_tokens_of_the_placement_that_finished_it())


async def _test_a_moved_stream_reports_the_cached_tokens_of_the_placement_that_finished_it() -> None:
    """The first P leg's figure (4) was for a placement that did not finish the answer; the second P leg's (1) is
    what the client got. A decode node's figure above the prompt (a cache that also held resumed tokens) is
    capped at prompt_tokens."""
    prefill = FakeNode("p1", "prefill", engine_label="reference", cached_tokens=[4, 1])
    lost = FakeNode("d1", "decode", num_tokens=6, engine_label="reference", stream_error_after=2)
    other = FakeNode("d2", "decode", num_tokens=6, engine_label="reference")
    specs = {**_decodes(lost, other), "p1": REFERENCE}
    async with router_harness([prefill, lost, other], specs=specs) as (client, _):
        chunks, _ = await _stream(client, completion(max_tokens=6, stream_options={"include_usage": True}))
    assert len(prefill.bodies) == 2 and other.bodies  # both placements ran a P leg
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}

    colocated_lost = FakeNode("d1", "decode", num_tokens=6, engine_label="reference", stream_error_after=2)
    colocated = FakeNode("d2", "decode", num_tokens=6, engine_label="reference", cached_tokens=[7])
    async with router_harness([colocated_lost, colocated], specs=_decodes(colocated_lost, colocated)) as (client, _):
        chunks, _ = await _stream(client, completion(max_tokens=6, stream_options={"include_usage": True}))
    assert chunks[-1]["usage"]["prompt_tokens"] == 5
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}


def test_a_moved_non_streamed_answer_names_the_instance_that_answered() -> None:
    asyncio.run(_test_a_moved_non_streamed_answer_names_the_instance_that_answered())


async def _test_a_moved_non_streamed_answer_names_the_instance_that_answered() -> None:
    prefill = FakeNode("p1", "prefill", engine_label="reference", cached_tokens=[4, 1])
    lost = FakeNode("d1", "decode", engine_label="reference", fail_status=500)
    other = FakeNode("d2", "decode", engine_label="reference", cached_tokens=[0])
    specs = {**_decodes(lost, other), "p1": REFERENCE}
    async with router_harness([prefill, lost, other], specs=specs) as (client, _):
        resp = await client.post("/v1/completions", json=completion())
    assert resp.status_code == 200 and resp.headers["x-pdcluster-decode"] == "d2"
    assert resp.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_a_moved_stream_gets_a_new_prefill_leg_bound_to_its_new_decode_instance() -> None:
    """The hand-off of the first placement names d1 as its reader; after d1's stream breaks, the request goes
    to d2 through a new P leg whose hand-off names d2 (d2 would refuse one bound to d1)."""
    asyncio.run(_test_a_moved_stream_gets_a_new_prefill_leg_bound_to_its_new_decode_instance())


async def _test_a_moved_stream_gets_a_new_prefill_leg_bound_to_its_new_decode_instance() -> None:
    from router.cache_view import CachePoller

    prefill = FakeNode("p0", "prefill", engine_label="reference", tp_size=1)
    lost = FakeNode("d1", "decode", num_tokens=6, engine_label="reference", tp_size=1, engine_id="engine-d1",
                    cut_after=2)
    other = FakeNode("d2", "decode", num_tokens=6, engine_label="reference", tp_size=1, engine_id="engine-d2")
    async with router_harness([prefill, lost, other], specs=_decodes(prefill, lost, other)) as (client, app):
        state = app.state.router
        await CachePoller(state.registry, state.cache_view, state.client, 1.0, 5.0).poll_all()
        chunks, events = await _stream(client, completion(max_tokens=6))
    assert events[-1] == "[DONE]" and "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
        "t0 t1 t2 t3 t4 t5 "
    readers = [body["kv_transfer_params"].get("decode_engine_id") for body in prefill.bodies]
    assert readers == ["engine-d1", "engine-d2"], readers
    assert lost.bodies[0]["kv_transfer_params"]["decode_engine_id"] == "engine-d1"
    assert other.bodies[0]["kv_transfer_params"]["decode_engine_id"] == "engine-d2"


MOVED = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-d1",
         "remote_request_id": "r", "remote_block_ids": [[3]], "remote_host": "localhost", "remote_port": 5600,
         "tp_size": 1, "transfer_mode": "move", "lease_id": "lease-1", "signature": "v1:00"}


def test_a_drained_stream_moves_with_its_kv_params() -> None:
    asyncio.run(_test_a_drained_stream_moves_with_its_kv_params())


async def _test_a_drained_stream_moves_with_its_kv_params() -> None:
    lost = FakeNode("d1", "decode", num_tokens=6, engine_label="reference", stream_error_after=2,
                    moved_params=MOVED)
    other = FakeNode("d2", "decode", num_tokens=6, engine_label="reference")
    async with router_harness([lost, other], specs=_decodes(lost, other)) as (client, _):
        chunks, events = await _stream(client, completion(max_tokens=6))
        metrics = (await client.get("/metrics")).text
    assert events[-1] == "[DONE]" and not any("error" in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "t0 t1 t2 t3 t4 t5 "
    assert other.bodies[0]["kv_transfer_params"] == MOVED  # the mover's signed params, unaltered
    assert other.bodies[0]["resume_token_ids"] == [100, 101]
    assert not lost.aborted  # an abort there would end the lease on the rows the next instance reads
    assert 'pdcluster_migrations_total{reason="drain"} 1.0' in metrics


def test_a_moved_streams_lease_is_bound_to_its_next_instance_before_it_gets_the_params() -> None:
    asyncio.run(_test_a_moved_streams_lease_is_bound_to_its_next_instance())


async def _test_a_moved_streams_lease_is_bound_to_its_next_instance() -> None:
    """The draining d1 leased the stream to nobody yet; the router binds the lease at d1 to d2's engine id (which
    d1 then checks at every claim) before d2 is sent the params."""
    lost = FakeNode("d1", "decode", num_tokens=6, engine_label="reference", stream_error_after=2,
                    moved_params=MOVED)
    other = FakeNode("d2", "decode", num_tokens=6, engine_label="reference")
    async with router_harness([lost, other], specs=_decodes(lost, other)) as (client, _):
        chunks, events = await _stream(client, completion(max_tokens=6))
    assert events[-1] == "[DONE]" and not any("error" in c for c in chunks)
    assert lost.binds == [("lease-1", "engine-d2")]
    assert other.bodies[0]["kv_transfer_params"] == MOVED


def test_a_moved_stream_whose_lease_cannot_be_bound_is_recomputed() -> None:
    asyncio.run(_test_a_moved_stream_whose_lease_cannot_be_bound_is_recomputed())


async def _test_a_moved_stream_whose_lease_cannot_be_bound_is_recomputed() -> None:
    """d1 refuses the bind (the lease was bound or claimed already): d2 never sees the params, recomputes the
    stream from the tokens sent, and the lease is given back at d1."""
    lost = FakeNode("d1", "decode", num_tokens=6, engine_label="reference", stream_error_after=2,
                    moved_params=MOVED, bind_status=409)
    other = FakeNode("d2", "decode", num_tokens=6, engine_label="reference")
    async with router_harness([lost, other], specs=_decodes(lost, other)) as (client, _):
        chunks, events = await _stream(client, completion(max_tokens=6))
        for _ in range(100):  # the abort is fire-and-forget
            if lost.aborted:
                break
            await asyncio.sleep(0.02)
    assert events[-1] == "[DONE]" and not any("error" in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "t0 t1 t2 t3 t4 t5 "
    assert "kv_transfer_params" not in other.bodies[0] and other.bodies[0]["resume_token_ids"] == [100, 101]
    assert lost.aborted == [lost.request_ids[0]], "the unbound lease is given back at its source"


def test_a_refused_move_is_recomputed_elsewhere() -> None:
    asyncio.run(_test_a_refused_move_is_recomputed_elsewhere())


async def _test_a_refused_move_is_recomputed_elsewhere() -> None:
    lost = FakeNode("d1", "decode", num_tokens=6, engine_label="reference", stream_error_after=2,
                    moved_params=MOVED)
    refuses = FakeNode("d2", "decode", num_tokens=6, engine_label="reference", refuse_moves=True)
    other = FakeNode("d3", "decode", num_tokens=6, engine_label="reference")
    async with router_harness([lost, refuses, other], specs=_decodes(lost, refuses, other)) as (client, _):
        chunks, events = await _stream(client, completion(max_tokens=6))
    assert events[-1] == "[DONE]" and not any("error" in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "t0 t1 t2 t3 t4 t5 "
    assert refuses.bodies[0]["kv_transfer_params"] == MOVED
    assert "kv_transfer_params" not in other.bodies[0] and other.bodies[0]["resume_token_ids"] == [100, 101]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_draining_instances_refusal_is_placed_on_another_instance(stream: bool) -> None:
    asyncio.run(_test_a_draining_instances_refusal_is_placed_on_another_instance(stream))


async def _test_a_draining_instances_refusal_is_placed_on_another_instance(stream: bool) -> None:
    """A decode node that refuses a request because it is shutting down (503, Retry-After, the draining header)
    computed nothing: the request goes to another instance instead of back to the client (chaos.py saw 4 such
    503s reach clients in the second between a SIGTERM and the router's next health probe). A busy node's 503
    is still the client's (tests/router/test_admission.py)."""
    draining = FakeNode("d1", "decode", engine_label="reference", fail_status=503,
                        fail_headers={"Retry-After": "1", DRAINING_HEADER: "1"})
    other = FakeNode("d2", "decode", engine_label="reference")
    async with router_harness([draining, other], specs=_decodes(draining, other)) as (client, _):
        if stream:
            chunks, events = await _stream(client, completion(temperature=0))
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        else:
            resp = await client.post("/v1/completions", json=completion(temperature=0))
            assert resp.status_code == 200, resp.text
            text = resp.json()["choices"][0]["text"]
        metrics = (await client.get("/metrics")).text
    assert draining.bodies and other.bodies  # d1 (first by name) refused it, d2 answered
    assert text == "t0 t1 t2 t3 "
    assert 'pdcluster_migrations_total{reason="error_status"} 1.0' in metrics
