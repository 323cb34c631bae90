"""The numerical oracle in the test process: `pdcluster generate --json`'s answer without a new interpreter.

    from tests.oracle import generate
    generate([256, 72, 105], max_tokens=8)            # dict: text, token_ids, prompt_token_ids, logprobs, ...
    generate_text("Hello", max_tokens=8)              # the prompt as `pdcluster generate --prompt` encodes it

One single-rank reference engine per (model, device, weights seed) is built on first use and kept for the test
run (a `pdcluster generate` subprocess paid the torch import and the weight init on every call). The engine runs
with its prefix cache off, so every request is computed from its first token as the CLI's fresh engine computes
it, and `Engine.generate` runs each request to completion alone: the same ops on the same inputs, so the answers
are bit for bit those of `pdcluster generate` (tests/engine/test_cli.py checks one against it).
"""

from __future__ import annotations

import itertools
import threading

ORACLE_TOKENS = 16384
"""Prompt + answer tokens the oracle engine's row pool holds (one request at a time)."""

_engines: dict[tuple[str, str, int | None, str], object] = {}
_answers: dict[tuple, dict] = {}
"""Answers already computed, by (prompt ids, model, device, weights seed, kernels, SamplingParams): a greedy or seeded
request's answer is a function of them, so each is computed once per run (e2e modules ask for the same ones many
times). An unseeded sampled request draws from a seed derived from its request id (engine/sampling.py), a new one
per call: never kept."""
_lock = threading.Lock()
_ids = itertools.count()


def _engine(model: str, device: str, weights_seed: int | None, kernels: str):
    from engine.api import DEFAULT_SEED, EngineConfig
    from engine.engine import Engine
    from engine.layout import plan_layout
    from engine.model.config import resolve_model

    key = (model, device, weights_seed, kernels)
    if key not in _engines:
        seed = DEFAULT_SEED if weights_seed is None else weights_seed
        rows = sum(plan_layout(resolve_model(model)).rows_per_request(ORACLE_TOKENS))
        _engines[key] = Engine(EngineConfig(model=model, seed=seed, device=device, kernels=kernels,
                                            prefix_cache=False, num_rows=rows))
    return _engines[key]


def generate(prompt_ids: list[int] | tuple[int, ...], max_tokens: int, *, model: str = "kimi-k3.1-mini",
             device: str = "cpu", weights_seed: int | None = None, kernels: str = "reference", **sampling) -> dict:
    """What `pdcluster generate --prompt-ids IDS --max-tokens N --json` prints, as a dict (no timings).

    `kernels`: the engine's kernel set, as `generate --kernels` takes it (`reference` or `fast`).
    `sampling`: further `engine.api.SamplingParams` fields (`ignore_eos`, `temperature`, `seed`, `stop`, ...)."""
    from engine.api import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, **sampling)
    key = (tuple(prompt_ids), model, device, weights_seed, kernels, repr(params))
    with _lock:  # one request at a time: the engine is not shared between threads
        answer = _answers.get(key)
        if answer is None:
            answer = _generate(_engine(model, device, weights_seed, kernels), list(prompt_ids), params)
            if params.temperature == 0 or params.seed is not None:
                _answers[key] = answer
    return {**answer, "model": model, "token_ids": list(answer["token_ids"]), "prompt_token_ids": list(prompt_ids),
            "logprobs": list(answer["logprobs"])}


def _generate(engine, prompt_ids: list[int], params) -> dict:  # noqa: ANN001 (engine.engine.Engine)
    result = engine.generate(f"oracle-{next(_ids)}", prompt_ids, params)
    text = engine.tokenizer.decode(result.token_ids)
    for stop in params.stop:  # the CLI cuts the text before a stop string, as a node does
        if stop and stop in text:
            text = text[: text.index(stop)]
    return {"text": text, "token_ids": tuple(result.token_ids), "logprobs": tuple(result.logprobs),
            "finish_reason": result.finish_reason}


def generate_text(prompt: str, max_tokens: int, **kwargs) -> dict:
    """`pdcluster generate --prompt TEXT`: the prompt through the model's tokenizer (the CLI's encoding: byte
    tokens with BOS for a preset, a checkpoint's own tokenizer for a checkpoint directory)."""
    from engine.model.tokenizer import load_tokenizer

    return generate(load_tokenizer(kwargs.get("model", "kimi-k3.1-mini")).encode(prompt), max_tokens, **kwargs)
