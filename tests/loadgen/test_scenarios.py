"""Workload planning: reproducible schedules (same seed, same hash), AgentX session structure, trace text."""

from __future__ import annotations

import json

import pytest

from loadgen.lengths import parse_dist
from loadgen.scenarios.agentx import AgentXConfig, AgentXWorkload
from loadgen.scenarios.random_requests import RandomConfig, RandomWorkload
from loadgen.scenarios.trace import TraceWorkload, read_trace
from loadgen.schedule import Fork, RequestSpec, schedule_hash
from loadgen.text import count_words


def _agentx(seed=0, **kw) -> AgentXWorkload:
    small = dict(system_len=parse_dist("64"), task_len=parse_dist("uniform:20,40"),
                 tool_len=parse_dist("uniform:10,30"), output_len=parse_dist("uniform:5,15"))
    small.update(kw)
    return AgentXWorkload(AgentXConfig(seed=seed, **small))


@pytest.mark.parametrize("make", [
    lambda s: _agentx(s, subagent_prob=0.5),
    lambda s: RandomWorkload(RandomConfig(seed=s)),
], ids=["agentx", "random"])
def test_same_seed_same_hash(make):
    a, b, c = make(7), make(7), make(8)
    assert schedule_hash(a, 20) == schedule_hash(b, 20)
    assert schedule_hash(a, 20) != schedule_hash(c, 20)
    assert [r.messages for r in a.session(3).requests()] == [r.messages for r in b.session(3).requests()]


def test_hash_depends_on_config_and_content():
    base = schedule_hash(_agentx(1), 10)
    assert schedule_hash(_agentx(1, think_cap_s=2.0), 10) != base
    assert schedule_hash(_agentx(1, output_len=parse_dist("9")), 10) != base


def test_session_units_are_independent_of_order():
    w = _agentx(2)
    later_first = [w.session(k) for k in (5, 1)]
    assert later_first[0] == _agentx(2).session(5) and later_first[1] == _agentx(2).session(1)


def _turns(session) -> list[RequestSpec]:
    return [s for s in session.steps if isinstance(s, RequestSpec)]


def test_agentx_growing_prefix_and_session_id():
    w = _agentx(3, turns=parse_dist("8"), subagent_prob=0.0)
    sess = w.session(0)
    turns = _turns(sess)
    assert len(turns) == 8
    for prev, cur in zip(turns, turns[1:]):
        assert cur.messages[: len(prev.messages)] == prev.messages  # parent context is a strict prefix
        assert cur.num_input_tokens > prev.num_input_tokens
    assert {t.session_id for t in turns} == {sess.session_id}
    assert turns[0].think_s == 0 and all(t.think_s > 0 for t in turns[1:])
    # the system prompt is shared across sessions; the task differs
    other = _turns(w.session(1))[0]
    assert other.messages[0] == turns[0].messages[0] and other.messages[1] != turns[0].messages[1]
    assert other.session_id != sess.session_id


def test_agentx_subagents_branch_from_parent_context():
    w = _agentx(4, turns=parse_dist("6"), subagent_prob=1.0, num_subagents=parse_dist("3"),
                subagent_turns=parse_dist("2"))
    steps = w.session(0).steps
    forks = [s for s in steps if isinstance(s, Fork)]
    assert len(forks) == 5  # every turn but the last forks
    idx = steps.index(forks[0])
    parent = steps[idx - 1]
    assert len(forks[0].branches) == 3
    for branch in forks[0].branches:
        assert len(branch) == 2
        first = branch[0]
        # branch context = parent's context + parent's reply, then its own task
        assert first.messages[: len(parent.messages)] == parent.messages
        assert first.session_id == parent.session_id
        assert branch[1].messages[: len(first.messages)] == first.messages
    tasks = {b[0].messages[-1] for b in forks[0].branches}
    assert len(tasks) == 3


def test_agentx_think_cap_and_max_context():
    w = _agentx(5, think_s=parse_dist("exp:100"), think_cap_s=0.25, turns=parse_dist("50"),
                max_context=600)
    reqs = w.session(0).requests()
    assert max(r.think_s for r in reqs) <= 0.25
    assert all(r.num_input_tokens + r.max_tokens <= 600 for r in reqs)
    assert len(_turns(w.session(0))) < 50


def test_agentx_cancel_prob():
    reqs = _agentx(6, cancel_prob=1.0).session(0).requests()
    assert all(r.cancel_after_tokens == max(1, r.max_tokens // 2) for r in reqs)


def test_message_word_counts_are_token_counts():
    reqs = _agentx(8).session(0).requests()
    for r in reqs:
        assert sum(count_words(m.content) for m in r.messages) == r.num_input_tokens


def test_random_lengths_in_range():
    w = RandomWorkload(RandomConfig(seed=1, input_len=parse_dist("uniform:10,20"), output_len=parse_dist("7")))
    for k in range(50):
        (spec,) = w.session(k).requests()
        assert 10 <= spec.num_input_tokens <= 20 and spec.max_tokens == 7 and spec.session_id is None


def _write_trace(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")


def test_trace_shared_hash_ids_share_prefix_text(tmp_path):
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, [
        {"timestamp": 1000, "input_length": 20, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 1500, "input_length": 18, "output_length": 2, "hash_ids": [1, 2, 9]},
        {"timestamp": 3000, "input_length": 30, "output_length": 3, "hash_ids": [7], "session_id": "s1"},
    ])
    entries, errors = read_trace(trace)
    assert errors == [] and [e.arrival_s for e in entries] == [0.0, 0.5, 2.0]
    w = TraceWorkload(entries, str(trace), block_tokens=8)
    a, b, c = (w.session(k).requests()[0] for k in range(3))
    wa, wb = a.prompt().split(), b.prompt().split()
    assert len(wa) == 20 and len(wb) == 18 and len(c.prompt().split()) == 30
    assert wa[:16] == wb[:16] and wa[16:18] != wb[16:18]  # blocks 1, 2 shared; 3 vs 9 differ
    assert c.prompt().split()[8:] != wa[:22]  # past its one block, request 3 gets its own text
    assert c.session_id == "s1" and a.session_id is None
    assert (a.arrival_s, b.arrival_s, c.arrival_s) == (0.0, 0.5, 2.0)
    assert w.session(3) is None
    fast = TraceWorkload(entries, str(trace), block_tokens=8, speed=4.0)
    assert fast.session(2).requests()[0].arrival_s == 0.5


def test_trace_scale_keeps_sharing(tmp_path):
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, [{"timestamp": 0, "input_length": 1024, "output_length": 100, "hash_ids": [1, 2]},
                         {"timestamp": 5, "input_length": 600, "output_length": 10, "hash_ids": [1, 3]}])
    entries, _ = read_trace(trace, scale=0.1)
    w = TraceWorkload(entries, str(trace), block_tokens=512, scale=0.1)
    assert w.block_tokens == 51 and entries[0].input_length == 102 and entries[0].output_length == 10
    p0, p1 = (w.session(k).requests()[0].prompt().split() for k in range(2))
    assert p0[:51] == p1[:51] and p0[51:60] != p1[51:60]


def test_trace_bad_lines_reported_and_skipped(tmp_path):
    trace = tmp_path / "bad.jsonl"
    _write_trace(trace, [
        {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]},
        "{not json",
        {"timestamp": 1, "input_length": 10},
        {"timestamp": -5, "input_length": 10, "output_length": 2, "hash_ids": []},
        {"timestamp": 2, "input_length": "ten", "output_length": 2, "hash_ids": []},
        {"timestamp": 3, "input_length": 10, "output_length": 2, "hash_ids": ["a"]},
        "[1, 2]",
        "",
        {"timestamp": 4, "input_length": 5, "output_length": 0, "hash_ids": []},
        {"timestamp": 9, "input_length": 5, "output_length": 1},
    ])
    entries, errors = read_trace(trace)
    assert [e.line_no for e in entries] == [1, 10]
    text = {e.line_no: e.message for e in errors}
    assert set(text) == {2, 3, 4, 5, 6, 7, 9}
    assert "not JSON" in text[2]
    assert "missing field(s) output_length" in text[3]
    assert "timestamp" in text[4] and "-5" in text[4]
    assert "input_length must be an integer" in text[5]
    assert "hash_ids" in text[6]
    assert "not a JSON object" in text[7]
    assert "output_length must be >= 1" in text[9]
    assert str(errors[0]).startswith("line 2:")
