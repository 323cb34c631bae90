"""The official `openai` client through the router: chat and completions, streaming and not, each equal to
the oracle (`pdcluster generate --json` on one rank) for the same prompt, over the P -> D path.

With random weights most generated ids are not bytes and decode to no text, so text alone is a weak check:
non-streamed completions compare the token ids the nodes return, the others compare text and token counts.
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import choice_token_ids

pytestmark = pytest.mark.e2e

PROMPT = "Disaggregated serving splits prefill and decode across separate pools of machines."
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Explain why long agent sessions move to a DCP pool."}]
MAX_TOKENS = 12


def _prefill_legs(cluster) -> float:
    return cluster.metrics("router").get("pdcluster_leg_duration_seconds_count", leg="prefill") or 0.0


def test_models_lists_the_served_model(cluster):
    models = cluster.client().models.list()
    assert cluster.model in [m.id for m in models.data]


def test_completion_equals_oracle(cluster):
    expected = cluster.oracle(PROMPT, MAX_TOKENS)
    before = _prefill_legs(cluster)
    result = cluster.client().completions.create(model=cluster.model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                 temperature=0)
    assert choice_token_ids(result.choices[0]) == list(expected.token_ids)
    assert result.choices[0].text == expected.text
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert result.usage.prompt_tokens == len(expected.raw["prompt_token_ids"])
    assert _prefill_legs(cluster) == before + 1, "the request did not take the prefill leg"


def test_completion_stream_equals_oracle(cluster):
    expected = cluster.oracle(PROMPT, MAX_TOKENS)
    stream = cluster.client().completions.create(model=cluster.model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


def test_chat_equals_oracle(cluster):
    expected = cluster.oracle_chat(MESSAGES, MAX_TOKENS)
    result = cluster.client().chat.completions.create(model=cluster.model, messages=MESSAGES,
                                                      max_tokens=MAX_TOKENS, temperature=0)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.usage.completion_tokens == len(expected.token_ids)


def test_chat_stream_equals_oracle(cluster):
    expected = cluster.oracle_chat(MESSAGES, MAX_TOKENS)
    before = _prefill_legs(cluster)
    stream = cluster.client().chat.completions.create(model=cluster.model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                      temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected.text
    assert _prefill_legs(cluster) == before + 1
