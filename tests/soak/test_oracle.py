"""The soak's batched oracle (tests/soak/oracle.py), which benchmarks/chaos.py shares: a batched answer equals
`pdcluster generate`'s (tests/oracle.py, one request alone) token for token, with the sampling the load used
(`ignore_eos`: chaos's agentx requests run to `max_tokens`)."""

from __future__ import annotations

import pytest

from tests.oracle import generate
from tests.soak.oracle import Oracle, prompt_ids_of

MODEL = "kimi-k3.1-mini"


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["stops-at-eos", "ignore-eos"])
def test_batched_answers_equal_the_cli_oracle_alone(ignore_eos: bool) -> None:
    requests = [(prompt_ids_of([{"role": "user", "content": f"tool call {i} " * (2 + i)}]), 6 + i) for i in range(3)]
    oracle = Oracle(MODEL, ignore_eos=ignore_eos)
    oracle.run_all(requests)
    for prompt_ids, max_tokens in requests:
        alone = generate(prompt_ids, max_tokens, model=MODEL, ignore_eos=ignore_eos)
        assert oracle.generate(prompt_ids, max_tokens).token_ids == alone["token_ids"]
    assert oracle.num_runs == len(requests)  # every answer came from the batch, none computed again alone
