"""Prefix-cache isolation by salt (engine/prefix_cache.py `cache_root`): blocks and tails are keyed by (salt,
content), so a request of another salt (another tenant, or another `cache_salt`) reuses nothing of a prefix it
did not send itself and its `num_cached_tokens` stays 0, while requests of the same salt still hit. The node turns
tenant + `cache_salt` into the salt (tests/node/test_cache_salt_http.py). The engines run tests/engine/tiny.py's
model (mini's layers, 64-token blocks)."""

from __future__ import annotations

from engine.engine import Engine, EngineConfig
from engine.prefix_cache import ROOT, cache_root
from engine.sampling import SamplingParams
from tests.engine.tiny import TINY_BLOCK

BLOCK = TINY_BLOCK


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [256] + [(i * 41 + salt) % 251 for i in range(n - 1)]


def _sampling() -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True, logprobs=1, temperature=0.7, seed=5)


def _run(engine: Engine, request_id: str, prompt: list[int], cache_salt: str = "", session: str = ""):
    engine.add_request(request_id, prompt, _sampling(), session=session, cache_salt=cache_salt)
    events = []
    while not events or events[-1].finish_reason is None:
        events += [e for e in engine.step().tokens if e.request_id == request_id]
    return events


def test_roots_differ_per_salt() -> None:
    assert cache_root("") == ROOT
    assert len({cache_root(""), cache_root("a"), cache_root("b")}) == 3


def test_another_salt_reuses_no_block_nor_tail_and_answers_alike(tiny_model: str) -> None:
    engine = Engine(EngineConfig(model=tiny_model, num_rows=48))
    prompt = _prompt(70)
    first = _run(engine, "a1", prompt, cache_salt="aa")
    extended = prompt + [e.token_id for e in first] + [5, 6, 7]
    other = _run(engine, "b1", extended, cache_salt="bb")  # B sends A's prefix and A's answer: nothing of A's
    assert {e.num_cached_tokens for e in other} == {0}
    unsalted = _run(engine, "u1", extended)
    assert {e.num_cached_tokens for e in unsalted} == {0}
    same = _run(engine, "a2", extended, cache_salt="aa")  # A itself resumes at its own turn's exact end
    assert {e.num_cached_tokens for e in same} == {len(prompt) + len(first) - 1}
    scratch = Engine(EngineConfig(model=tiny_model, num_rows=48, prefix_cache=False))
    assert [e.token_id for e in other] == [e.token_id for e in _run(scratch, "s1", extended)]
    assert [e.logprob for e in same] == [e.logprob for e in _run(scratch, "s2", extended)]


def test_an_import_reuses_only_blocks_of_its_own_salt(tiny_model: str) -> None:
    engine = Engine(EngineConfig(model=tiny_model, num_rows=24))
    prompt = _prompt(131, salt=3)
    _run(engine, "warm", prompt[:94], cache_salt="aa")
    engine.allocate_for_import("b", prompt, _sampling(), cache_salt="bb")
    assert engine.num_reused_tokens("b") == 0
    engine.abort("b")
    engine.allocate_for_import("a", prompt, _sampling(), cache_salt="aa")
    assert engine.num_reused_tokens("a") == BLOCK
    engine.abort("a")


def test_a_salted_session_of_one_partial_block_reports_its_tail(tiny_model: str) -> None:
    """A tail of block 0 hangs off its request's salted root: the session's report still counts it."""
    engine = Engine(EngineConfig(model=tiny_model, num_rows=24))
    prompt = _prompt(40, salt=5)
    events = _run(engine, "t1", prompt, cache_salt="aa", session="5e")
    assert dict(engine.cache_report().resumable)["5e"] == len(prompt) + len(events) - 1
