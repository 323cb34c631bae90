"""The engine's `kernels` choice: defaults, the refusal of `fast` on CPU outside the interpreter, and greedy
generation with `kernels="fast"` (fast prefill and fast decode) against the reference engine on mini.

Agreement is reported, not required: the fast path prefills and decodes in bf16 (on this random-init model bf16
activations move logits by up to ~10% of their range), so greedy tokens may part where the reference's top logits
are close, and a request that parts once continues from another prefix. What is required: each request's first
token (the fast prefill's) is one the reference scores within 15% of the logit range of its best token."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.kernels import resolve
from engine.model.state import LocalSequenceCache
from engine.sampling import SamplingParams


def test_kernels_default_and_refusal(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    assert resolve(None, "single", "cpu", False).kernels == "reference"
    assert resolve("auto", "single", "cuda", False).kernels == "fast"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve("fast", "single", "cpu", False)
    with pytest.raises(ValueError, match="kernels='triton' is unknown"):
        resolve("triton", "single", "cpu", False)
    engine = Engine(EngineConfig(num_rows=8))
    assert engine.kernels == "reference" and engine.warm_up() is None  # nothing to compile or capture


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine's model and pool live on the CPU: an "
                    "interpreter test")
def test_fast_engine_greedy_tokens_agree_with_reference() -> None:
    prompts = [[256] + list(b"hello fast path"), [256] + list(b"kimi"), [256] + list(range(40, 90))]
    sampling = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outputs, engines = {}, {}
    for kernels in ("reference", "fast"):
        engine = engines[kernels] = Engine(EngineConfig(num_rows=32, kernels=kernels))
        assert engine.kernels == kernels
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, sampling)
        tokens: dict[str, list[int]] = {}
        while engine.has_work:
            for event in engine.step().tokens:
                tokens.setdefault(event.request_id, []).append(event.token_id)
        outputs[kernels] = tokens
    ref, fast = outputs["reference"], outputs["fast"]
    agree = sum(a == b for r in ref for a, b in zip(ref[r], fast[r]))
    total = sum(len(v) for v in ref.values())
    print(f"greedy agreement fast vs reference: {agree}/{total}")
    model = engines["reference"].model
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            logits = model.prefill(torch.tensor(prompt), LocalSequenceCache(model.cfg, len(prompt)))[0]
        span = float(logits.max() - logits.min())
        assert float(logits.max() - logits[fast[f"r{i}"][0]]) <= 0.15 * span, (i, fast[f"r{i}"][0], ref[f"r{i}"][0])
