"""tests/oracle.py keeps each greedy or seeded answer it computed: asked again, it answers without generating,
and an unseeded sampled request is generated every time (its seed derives from a fresh request id)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests import oracle


@dataclass
class _Result:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "length"


class _CountingEngine:
    """Stands in for the reference engine: answers from the request id, counts the requests."""

    class tokenizer:  # noqa: N801 (the engine's attribute)
        @staticmethod
        def decode(ids: list[int]) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

    def __init__(self) -> None:
        self.request_ids: list[str] = []

    def generate(self, request_id: str, prompt_ids: list[int], params) -> _Result:  # noqa: ANN001
        self.request_ids.append(request_id)
        n = len(self.request_ids)
        return _Result([n] * params.max_tokens, [-0.5] * params.max_tokens)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> _CountingEngine:
    fake = _CountingEngine()
    monkeypatch.setattr(oracle, "_engine", lambda *args: fake)
    monkeypatch.setattr(oracle, "_answers", {}, raising=False)
    return fake


def test_greedy_and_seeded_answers_are_computed_once(engine: _CountingEngine) -> None:
    first = oracle.generate([1, 2, 3], 4)
    first["token_ids"].append(99)  # a caller's edit stays its own
    again = oracle.generate([1, 2, 3], 4)
    assert again["token_ids"] == [1] * 4 and len(engine.request_ids) == 1
    seeded = oracle.generate([1, 2, 3], 4, temperature=0.9, seed=7)
    assert oracle.generate([1, 2, 3], 4, temperature=0.9, seed=7) == seeded and len(engine.request_ids) == 2
    oracle.generate([1, 2, 3], 4, temperature=0.9, seed=8)  # another seed, another prompt, another length
    oracle.generate([1, 2], 4)
    oracle.generate([1, 2, 3], 5)
    assert len(engine.request_ids) == 5


def test_unseeded_sampled_answers_are_generated_each_time(engine: _CountingEngine) -> None:
    answers = [oracle.generate([1, 2, 3], 4, temperature=0.9) for _ in range(2)]
    assert len(engine.request_ids) == 2 and answers[0]["token_ids"] != answers[1]["token_ids"]
