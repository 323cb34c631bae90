"""The soak's oracle: `pdcluster generate`'s answers for hundreds of requests, in this process, in minutes.

Why one thread: see `Oracle.__init__` (measured here: about 1 s of CPU per single-request decode step with two
threads at load average 19, 14 ms with one thread on a quiet machine; the two causes were not measured apart). Why
batched: a decode step
costs nearly the same for one request as for many (every linear layer and routed expert works on 64-row blocks,
engine/model/numerics.py `ROW_BLOCK`), and a soak's answers are thousands of single-request decode steps one at a
time, one step per request plus the longest answer batched.

`Oracle.run_all` puts every distinct (prompt, max_tokens) through one single-rank reference engine at once (prefix
cache off, so every prompt is computed from its first token as the CLI's fresh engine computes it; rows for every
answer, so nothing is preempted), in waves of `WAVE` requests. Rows are padded to 64-row blocks and each request
attends to its own tokens only, so a request's tokens do not depend on what it is batched with: the engine's
promise, which the soak checks again here: `check_alone` reruns a few of the requests alone through
tests/oracle.py `generate` (the code of `pdcluster generate`, one request at a time) and compares token for token.
`work_s`, a request's own prefill + decode time alone: its prefill as timed in the batched run (one request per
prefill, nothing else in that call) plus its decode steps at the per-step time those alone reruns took (each
rerun's time less the time of the same prompt with one output token, per further token).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from engine.model.tokenizer import ByteTokenizer, ChatMessage

WAVE = 64
"""Requests one batched run holds at once (the engine's decode batch)."""
NUM_ALONE = 3
"""Requests `check_alone` reruns one at a time."""


def prompt_ids_of(prompt: str | list[dict]) -> list[int]:
    """What a node feeds the engine: the byte tokenizer's ids of a text prompt (with BOS), or the reference
    chat template of a message list."""
    tok = ByteTokenizer()
    if isinstance(prompt, str):
        return tok.encode(prompt)
    return tok.apply_chat_template([ChatMessage(m["role"], m["content"]) for m in prompt])


@dataclass(frozen=True)
class Expected:
    token_ids: list[int]
    text: str
    work_s: float


Key = tuple[tuple[int, ...], int]


class Oracle:
    """Answers of (prompt ids, max_tokens), greedy; `ignore_eos` as the load asked it (the soak's requests stop at
    EOS, benchmarks/chaos.py's run to `max_tokens`)."""

    def __init__(self, model: str, ignore_eos: bool = False) -> None:
        import torch

        # One intra-op thread, as `pdcluster generate` runs (engine/cli.py) and the test suite does (tests/conftest.py):
        # this process ran two, and on a loaded 2-core machine each small op of a decode step waited at a barrier
        # for a descheduled thread, which made the unbatched oracle take tens of minutes.
        torch.set_num_threads(1)
        self.model = model
        self.ignore_eos = ignore_eos
        self.tokenizer = ByteTokenizer()
        self.cache: dict[Key, Expected] = {}
        self.num_runs = 0
        self.prefill_s: dict[Key, float] = {}
        """A batched request's own prefill time (the runner's prefill call for it alone)."""
        self.decode_step_s: float | None = None
        """One single-request decode step, as the alone reruns measured it."""

    def token_names(self, token_ids: list[int]) -> list[str]:
        """What a node's log-prob entries call these tokens (node/logprobs.py `token_name`)."""
        from node.logprobs import token_name

        return [token_name(self.tokenizer, t) for t in token_ids]

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Expected:
        """The answer `run_all` computed, else one computed alone now."""
        key = (tuple(prompt_ids), max_tokens)
        if key not in self.cache:
            self.cache[key] = self._alone(key)
        return self.cache[key]

    def _alone(self, key: Key) -> Expected:
        from tests.oracle import generate

        self.num_runs += 1
        started = time.perf_counter()
        out = generate(list(key[0]), key[1], model=self.model, ignore_eos=self.ignore_eos)
        return Expected(out["token_ids"], out["text"], time.perf_counter() - started)

    def run_all(self, requests: list[tuple[list[int], int]]) -> None:
        """Compute the answers of every (prompt ids, max_tokens) not yet known, batched (module docstring)."""
        keys = list(dict.fromkeys((tuple(p), m) for p, m in requests if (tuple(p), m) not in self.cache))
        for lo in range(0, len(keys), WAVE):
            self._run_wave(keys[lo:lo + WAVE])

    def _run_wave(self, keys: list[Key]) -> None:
        from engine.api import DEFAULT_SEED, SamplingParams
        from engine.engine import Engine, EngineConfig
        from engine.layout import plan_layout
        from engine.model.config import resolve_model

        layout = plan_layout(resolve_model(self.model))
        rows = sum(sum(layout.rows_per_request(len(p) + m)) for p, m in keys)
        engine = Engine(EngineConfig(model=self.model, seed=DEFAULT_SEED, device="cpu", kernels="reference",
                                     prefix_cache=False, num_rows=rows, max_batch=WAVE))
        runner_prefill = engine.runner.prefill

        def timed_prefill(req, *args, **kwargs):  # noqa: ANN001, ANN202 - ModelRunner.prefill's signature
            started = time.perf_counter()
            try:
                return runner_prefill(req, *args, **kwargs)
            finally:
                key = ids[req.request_id]
                self.prefill_s[key] = self.prefill_s.get(key, 0.0) + time.perf_counter() - started

        engine.runner.prefill = timed_prefill
        ids: dict[str, Key] = {}
        tokens: dict[str, list[int]] = {}
        for i, (prompt, max_tokens) in enumerate(keys):
            request_id = f"oracle-batch-{self.num_runs + i}"
            ids[request_id], tokens[request_id] = (prompt, max_tokens), []
            engine.add_request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=self.ignore_eos))
        self.num_runs += len(keys)
        while engine.has_work:
            for event in engine.step().tokens:
                if event.token_id is not None:
                    tokens[event.request_id].append(event.token_id)
        assert engine.scheduler.num_preemptions == 0, "the oracle's pool holds every answer"
        for request_id, key in ids.items():
            token_ids = tokens[request_id]
            self.cache[key] = Expected(token_ids, engine.tokenizer.decode(token_ids), 0.0)

    def check_alone(self, seed: int = 0) -> dict:
        """Rerun NUM_ALONE batched answers one at a time (tests/oracle.py `generate`): equal token for token, and
        the single-request decode step they take sets `work_s` of every batched answer."""
        batched = sorted(k for k in self.cache if k in self.prefill_s)
        sample = random.Random(seed).sample(batched, min(NUM_ALONE, len(batched)))
        equal, steps = True, []
        for key in sample:
            alone = self._alone(key)
            equal = equal and alone.token_ids == self.cache[key].token_ids and alone.text == self.cache[key].text
            if len(alone.token_ids) > 1:  # the same prompt with no decode step: what the decode steps added
                first = self._alone((key[0], 1))
                steps.append(max(alone.work_s - first.work_s, 0.0) / (len(alone.token_ids) - 1))
        self.decode_step_s = statistics.median(steps) if steps else 0.0
        for key in batched:
            expected = self.cache[key]
            work = self.prefill_s[key] + max(len(expected.token_ids) - 1, 0) * self.decode_step_s
            self.cache[key] = Expected(expected.token_ids, expected.text, work)
        return {"rerun_alone": len(sample), "batched_equals_alone": equal,
                "decode_step_alone_s": round(self.decode_step_s, 3)}
