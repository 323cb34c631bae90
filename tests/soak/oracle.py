"""The soak's oracle: the suite's in-process oracle (tests/oracle.py: `pdcluster generate`'s answer from one
`Engine` kept loaded in this process, one request at a time), so hundreds of answers are checked without starting
a process per prompt. `work_s` is that request's own prefill + decode time on this machine, alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.model.tokenizer import ByteTokenizer, ChatMessage


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


class Oracle:
    def __init__(self, model: str) -> None:
        self.model = model
        self.tokenizer = ByteTokenizer()
        self.cache: dict[tuple[tuple[int, ...], int], Expected] = {}
        self.num_runs = 0

    def token_names(self, token_ids: list[int]) -> list[str]:
        """What a node's log-prob entries call these tokens (node/logprobs.py `token_name`)."""
        from node.logprobs import token_name

        return [token_name(self.tokenizer, t) for t in token_ids]

    def generate(self, prompt_ids: list[int], max_tokens: int) -> Expected:
        key = (tuple(prompt_ids), max_tokens)
        if key not in self.cache:
            self.cache[key] = self._run(prompt_ids, max_tokens)
        return self.cache[key]

    def _run(self, prompt_ids: list[int], max_tokens: int) -> Expected:
        from tests.oracle import generate

        self.num_runs += 1
        started = time.perf_counter()
        out = generate(prompt_ids, max_tokens, model=self.model)
        return Expected(out["token_ids"], out["text"], time.perf_counter() - started)
