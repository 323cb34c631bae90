"""Which of a request's tokens end an SSE chunk, as a node streams them (profile `stream`: sim/profile.py
`StreamModel`). The client times chunks, not tokens: its TTFT is the first chunk's arrival, its TPOT spans the
first to the last chunk over the completion's tokens less one, its inter-token latencies are the gaps between
chunks (loadgen/metrics.py `request_timing`). A token ends a chunk when it releases text (probability
`first_token_p` for a stream's first token, `text_token_p` for each later one, drawn from a generator seeded by
the request's key, so a run is repeatable); the last token always does (the node flushes at the finish).
"""

from __future__ import annotations

import random


def chunk_times(token_times: list[float], text_token_p: float, key: str,
                first_token_p: float | None = None) -> list[float]:
    """The arrival times of the chunks of a stream whose tokens were sent at `token_times` (one per token); the
    first token releases text with `first_token_p` (None: `text_token_p`)."""
    first_p = text_token_p if first_token_p is None else first_token_p
    if (text_token_p >= 1.0 and first_p >= 1.0) or len(token_times) <= 1:
        return token_times
    draw = random.Random(key).random
    last = len(token_times) - 1
    return [t for i, t in enumerate(token_times) if i == last or draw() < (text_token_p if i else first_p)]
