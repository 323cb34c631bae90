"""`TINY`: kimi-k3.1-mini's structure with 64-token blocks, for engine tests about block boundaries, preemption
points and cached prefixes (the `tiny_model` fixture, tests/engine/conftest.py, saves it for EngineConfig).

mini's KDA state (4 heads of 64 x 64 per layer) makes its rows 1024 tokens long, so such a test needs prompts of
~1000 tokens through the reference model. TINY keeps every layer kind and count (6 KDA in 2 state groups, 2 DSA,
the MoE) and shrinks only the KDA state (2 heads of 16 x 16), so the smallest legal block is one 64-token
sub-block; it selects index_topk 32 keys, so prompts past 32 tokens exercise the indexer's selection as mini's
past 256 do. The same boundaries are then crossed with 16x fewer tokens.
"""

from __future__ import annotations

import dataclasses

from engine.model.config import get_preset

TINY = dataclasses.replace(get_preset("kimi-k3.1-mini"), name="kimi-k3.1-tiny", kda_num_heads=2, kda_head_dim=16,
                           index_topk=32).validate()
TINY_BLOCK = 64
"""TINY's block size (tokens per row) at TP1; `tiny_model` checks it."""
