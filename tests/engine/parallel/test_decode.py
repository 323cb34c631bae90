"""DCP and TP decode on real gloo ranks: logits equal the single-rank oracle (bitwise with exact attention) for 64+
steps."""

from __future__ import annotations

import pytest
import torch

from engine.model.config import get_preset
from engine.model.state import LocalSequenceCache
from engine.model.weights import build_model
from engine.parallel.groups import ParallelContext, RankPool
from tests.engine.parallel import _ranks

CFG = get_preset("kimi-k3.1-mini")
STEPS = 64


def prompts(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen) for n in (300, 120)]


@pytest.fixture(scope="module")
def oracle():
    """KimiModel.prefill then KimiModel.decode, greedy, one process."""
    model = build_model(CFG)
    ps = prompts()
    caches = [LocalSequenceCache(CFG, p.numel() + STEPS + 1) for p in ps]
    tokens = [[int(model.prefill(p, c, 0)[0].argmax())] for p, c in zip(ps, caches)]
    positions = [p.numel() for p in ps]
    for _ in range(STEPS):
        logits = model.decode(torch.tensor([t[-1] for t in tokens]), positions, caches)
        for b, tok in enumerate(logits.argmax(-1).tolist()):
            tokens[b].append(tok)
        positions = [p + 1 for p in positions]
    return tokens, logits


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2, backend="gloo", timeout_s=600) as pool:
        yield pool


@pytest.mark.process
@pytest.mark.parametrize("mode,interleave,attention", [("dcp", 1, "exact"), ("dcp", 64, "exact"), ("dcp", 1, "lse"),
                                                        ("dcp", 64, "lse"), ("tp", 1, "exact")])
def test_two_rank_decode_matches_oracle(pool2, oracle, mode: str, interleave: int, attention: str) -> None:
    """Exact attention (TP; DCP by default) gives the single-rank logits bit for bit after 64 steps; DCP's LSE
    merge of partial outputs agrees within fp32 rounding."""
    want_tokens, want_logits = oracle
    results = pool2.run(_ranks.decode_case, CFG, prompts(), STEPS, mode, interleave, "compact",
                        attention)
    for res in results:
        assert res["tokens"] == want_tokens, f"{mode} greedy tokens differ from the single-rank oracle"
        if attention == "exact":
            assert torch.equal(res["last_logits"], want_logits), f"{mode} logits differ from the single-rank decode"
        else:
            torch.testing.assert_close(res["last_logits"], want_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(results[0]["last_logits"], results[1]["last_logits"]), "ranks must agree bitwise"
    if mode == "dcp":
        assert results[0]["merge_bytes"] > 0


def test_world_size_one_decode_is_plain(oracle) -> None:
    want_tokens, want_logits = oracle
    res = _ranks.decode_case(ParallelContext.single(), CFG, prompts(), 8, "dcp", 1, "compact")
    assert [t[:9] for t in want_tokens] == res["tokens"]
