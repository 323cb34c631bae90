"""Zero mismatch through `pdcluster up`, with the official `openai` client: the log-prob the router serves for
each answer token equals, bit for bit (exact equality of the JSON floats), that token's prompt log-prob when
prompt + answer is sent back with `echo=true, max_tokens=0` (a teacher-forced scoring pass), on every decode
pool of the default topology (`tp`: TP=1, `dcp`: DCP=2), P->D and colocated, greedy and sampled
(temperature 0.8, seeded), 16 prompts each, sent concurrently.

How each path is reached (read from the router's `x-pdcluster-*` answer headers, never assumed):
- pool: the `dcp` pool takes requests whose projected context outgrows `tp` (an `X-Expected-Context-Tokens`
  hint larger than `tp`'s capacity); `tp` takes the rest;
- P->D: a plain request (the e2e router disaggregates every prompt of one token or more);
- colocated: the same request with `echo=true` (the router serves requests asking for prompt log-probs on the
  decode node alone: a remote prefill hands over KV, not prompt log-probs); its answer's log-probs follow the
  prompt's;
- scoring: `echo=true, max_tokens=0` on token ids, on the other decode pool than the one that generated.
Prompts are token ids, so prompt + answer is sent back exactly (answers of random weights are rarely text).
The same seed gives the same tokens on every path (asserted too).

A second test: streaming and non-streaming answers carry the same log-probs (chat and completions, same
seed), and greedy answers' `top_logprobs` hold the sampled token as the most likely one.

Both run on `checkpoint_cluster` too (the same topology serving a tiny transformers checkpoint with its own
BPE tokenizer and chat template: tests/topologies.py), with CHECKPOINT_PROMPTS prompts per job (the suite's time).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.model.tokenizer import ByteTokenizer, load_tokenizer
from tests.topologies import LONG_POOL, TP_POOL_CAPACITY
from tests.e2e.harness import choice_token_ids

pytestmark = pytest.mark.e2e

POOLS = ("tp", LONG_POOL)
NUM_PROMPTS = 16
MAX_TOKENS = 8
TOP = 3
WORKERS = 8
WORDS = "agent tool patch diff cache decode prefill router shard rank review build trace plan".split()
SAMPLINGS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.8}}


CHECKPOINT_PROMPTS = 4


def _prompt_ids(i: int, model: str = "") -> list[int]:
    """Prompt i as token ids of the served model's tokenizer (the byte tokenizer of a preset, or a checkpoint's)."""
    words = " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(3 + i % 4))
    tokenizer = load_tokenizer(model) if model else ByteTokenizer()
    return tokenizer.encode(f"{i}: {words}")


def _pool_headers(pool: str) -> dict[str, str]:
    """Route to `pool`: the long pool takes contexts projected past `tp`'s capacity."""
    return {"X-Expected-Context-Tokens": str(TP_POOL_CAPACITY * 2)} if pool == LONG_POOL else {}


def _other(pool: str) -> str:
    return POOLS[1 - POOLS.index(pool)]


def _completion(client, pool: str, **kwargs):
    """(parsed completion, its route headers) through the router."""
    raw = client.completions.with_raw_response.create(extra_headers=_pool_headers(pool), **kwargs)
    return raw.parse(), raw.headers


def _generate(client, model: str, pool: str, mode: str, sampling: str, i: int) -> dict:
    prompt = _prompt_ids(i, model)
    extra = {"seed": 1000 + i} if sampling == "sampled" else {}
    result, headers = _completion(client, pool, model=model, prompt=prompt, max_tokens=MAX_TOKENS, logprobs=TOP,
                                  echo=mode == "colocated", **SAMPLINGS[sampling], **extra)
    choice = result.choices[0]
    served = choice.logprobs.token_logprobs
    answer = choice_token_ids(choice)
    if mode == "colocated":  # the echoed prompt's entries come first
        assert answer[:len(prompt)] == prompt and served[0] is None
        answer, served = answer[len(prompt):], served[len(prompt):]
    return {"key": (pool, mode, sampling, i), "prompt": prompt, "answer": answer, "served": served,
            "pool": headers["x-pdcluster-pool"], "prefill": headers["x-pdcluster-prefill"]}


def _score(client, model: str, pool: str, prompt: list[int], answer: list[int]) -> tuple[list, dict]:
    result, headers = _completion(client, pool, model=model, prompt=prompt + answer, max_tokens=0, echo=True,
                                  logprobs=0)
    choice = result.choices[0]
    assert choice_token_ids(choice) == prompt + answer and result.usage.completion_tokens == 0
    return choice.logprobs.token_logprobs[len(prompt):], headers


@pytest.mark.parametrize("pool", POOLS)
def test_served_logprobs_equal_teacher_forcing(cluster, pool):
    _check_teacher_forcing(cluster, pool, NUM_PROMPTS)


@pytest.mark.parametrize("pool", POOLS)
def test_checkpoint_served_logprobs_equal_teacher_forcing(checkpoint_cluster, pool):
    _check_teacher_forcing(checkpoint_cluster, pool, CHECKPOINT_PROMPTS)


def _check_teacher_forcing(cluster, pool: str, num_prompts: int) -> None:
    """Every job's served log-probs equal the teacher-forced `echo` scoring on the other pool (module docstring)."""
    client = cluster.client()
    jobs = [(mode, sampling, i) for mode in ("pd", "colocated") for sampling in SAMPLINGS for i in range(num_prompts)]
    with ThreadPoolExecutor(WORKERS) as workers:
        answers = list(workers.map(lambda job: _generate(client, cluster.model, pool, *job), jobs))
        scores = list(workers.map(lambda a: _score(client, cluster.model, _other(pool), a["prompt"], a["answer"]),
                                  answers))
    mismatches = []
    for answer, (scored, headers) in zip(answers, scores):
        key = answer["key"]
        assert answer["pool"] == pool, f"{key} served by pool {answer['pool']}"
        assert (answer["prefill"] != "none") == (key[1] == "pd"), f"{key}: prefill leg {answer['prefill']!r}"
        assert headers["x-pdcluster-prefill"] == "none" and headers["x-pdcluster-pool"] == _other(pool)
        assert len(answer["answer"]) == len(answer["served"]) >= 1, key
        assert all(isinstance(lp, float) for lp in answer["served"]), f"{key}: a served log-prob is missing"
        mismatches += [(key, n, got, want) for n, (got, want) in enumerate(zip(answer["served"], scored))
                       if got != want]
    assert not mismatches, f"{len(mismatches)} served log-probs differ from teacher forcing: {mismatches[:5]}"
    by_job = {a["key"][1:]: a["answer"] for a in answers}
    for sampling in SAMPLINGS:
        for i in range(num_prompts):
            assert by_job[("pd", sampling, i)] == by_job[("colocated", sampling, i)], \
                f"{pool} {sampling} prompt {i}: P->D and colocated answers differ"


def _chat_logprobs(choices) -> list[tuple]:
    return [(e.token, e.logprob, tuple(e.bytes), tuple((t.token, t.logprob) for t in e.top_logprobs))
            for c in choices if c.logprobs and c.logprobs.content for e in c.logprobs.content]


def _completion_logprobs(choices) -> list[tuple]:
    out = []
    for c in choices:
        lp = c.logprobs
        if lp is None:
            continue
        out += list(zip(lp.tokens, lp.token_logprobs, [tuple(sorted(t.items())) for t in lp.top_logprobs]))
    return out


@pytest.mark.parametrize("pool", POOLS)
def test_streamed_logprobs_equal_non_streamed_and_greedy_tops_hold_the_sampled_token(cluster, pool):
    _check_streamed_logprobs(cluster, pool, 4)


@pytest.mark.parametrize("pool", POOLS)
def test_checkpoint_streamed_logprobs_equal_non_streamed(checkpoint_cluster, pool):
    _check_streamed_logprobs(checkpoint_cluster, pool, CHECKPOINT_PROMPTS // 2)


def _check_streamed_logprobs(cluster, pool: str, num_prompts: int) -> None:
    client = cluster.client()
    headers = _pool_headers(pool)
    for i in range(num_prompts):
        text = f"{i}: " + " ".join(WORDS[i:i + 4])
        for sampling, params in SAMPLINGS.items():
            extra = {**params, **({"seed": 7 + i} if sampling == "sampled" else {})}
            chat = {"model": cluster.model, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
                    "logprobs": True, "top_logprobs": TOP, "extra_headers": headers, **extra}
            whole = _chat_logprobs(client.chat.completions.create(**chat).choices)
            streamed = _chat_logprobs(c.choices[0] for c in client.chat.completions.create(stream=True, **chat)
                                      if c.choices)
            assert whole == streamed and len(whole) >= 1, f"chat {sampling} prompt {i} on {pool}"
            done = {"model": cluster.model, "prompt": text, "max_tokens": MAX_TOKENS, "logprobs": TOP,
                    "extra_headers": headers, **extra}
            whole_c = _completion_logprobs(client.completions.create(**done).choices)
            streamed_c = _completion_logprobs(c.choices[0] for c in client.completions.create(stream=True, **done)
                                              if c.choices)
            assert whole_c == streamed_c and len(whole_c) >= 1, f"completions {sampling} prompt {i} on {pool}"
            if sampling != "greedy":
                continue
            for token, logprob, _, tops in whole:
                assert tops[0] == (token, logprob), f"greedy chat token {token!r} is not the top entry: {tops}"
            for token, logprob, tops in whole_c:
                assert len(tops) == TOP and dict(tops)[token] == logprob == max(v for _, v in tops), (token, tops)
