"""Independent requests: input and output lengths drawn from the given distributions, no session id."""

from __future__ import annotations

from dataclasses import dataclass, field

from loadgen.lengths import Dist, parse_dist
from loadgen.mt import StreamRandom
from loadgen.schedule import Message, RequestSpec, Session
from loadgen.text import words


@dataclass(frozen=True)
class RandomConfig:
    """Lengths in tokens."""

    seed: int = 0
    input_len: Dist = field(default_factory=lambda: parse_dist("uniform:128,512"))
    output_len: Dist = field(default_factory=lambda: parse_dist("uniform:32,128"))


class RandomWorkload:
    """Unit k is one request whose text and lengths depend only on (seed, k)."""

    name = "random"
    is_open_loop = False

    def __init__(self, config: RandomConfig) -> None:
        self.config = config

    def describe(self) -> dict[str, str]:
        return {k: str(v) for k, v in vars(self.config).items()}

    def session(self, index: int) -> Session:
        rng = StreamRandom(f"{self.config.seed}:random:{index}")
        num_in = self.config.input_len.sample_int(rng)
        num_out = self.config.output_len.sample_int(rng)
        rid = f"random-{self.config.seed}-{index}"
        spec = RequestSpec(rid, (Message("user", words(rng, num_in), num_in),), num_out)
        return Session(rid, (spec,))
