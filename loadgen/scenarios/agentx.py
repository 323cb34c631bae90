"""AgentX-like coding-agent sessions.

Each session: a system prompt shared by every session, a user task, then turns. A turn sends the whole
conversation so far (the growing shared prefix), appends the assistant reply and a tool result, and
pauses for tool time (think time, capped) before the next turn. With probability `subagent_prob` a turn
forks parallel sub-agents, each starting from the parent's context plus its own task and running a few
turns of its own; the parent waits for all of them. Sessions (and sub-agents) end after their turn count
or before a request whose prompt plus output would pass `max_context` tokens. Sub-agents carry the parent's `X-Session-ID`: they branch from
its context, so a router that keeps a session's placement keeps their shared prefix warm.

Assistant replies in the planned context are synthetic (fixed by the seed), not the server's text, so
the request stream is reproducible regardless of what the server generates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from loadgen.lengths import Dist, parse_dist
from loadgen.mt import StreamRandom
from loadgen.schedule import Fork, Message, RequestSpec, Session, Step
from loadgen.text import seeded_words, words


@dataclass(frozen=True)
class AgentXConfig:
    """Knobs of the agent workload; every length is in tokens, every delay in seconds."""

    seed: int = 0
    system_len: Dist = field(default_factory=lambda: parse_dist("512"))
    task_len: Dist = field(default_factory=lambda: parse_dist("lognormal:256,0.5"))
    tool_len: Dist = field(default_factory=lambda: parse_dist("lognormal:128,0.8"))
    output_len: Dist = field(default_factory=lambda: parse_dist("lognormal:64,0.5"))
    turns: Dist = field(default_factory=lambda: parse_dist("uniform:4,12"))
    think_s: Dist = field(default_factory=lambda: parse_dist("exp:0.5"))
    think_cap_s: float = 10.0
    subagent_prob: float = 0.15
    num_subagents: Dist = field(default_factory=lambda: parse_dist("uniform:2,3"))
    subagent_turns: Dist = field(default_factory=lambda: parse_dist("uniform:1,3"))
    max_context: int = 16384
    cancel_prob: float = 0.0

    def __post_init__(self) -> None:
        for name in ("subagent_prob", "cancel_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"agentx {name} must be in [0, 1], got {value}")
        if self.max_context < 1:
            raise ValueError(f"agentx max_context must be >= 1, got {self.max_context}")


class AgentXWorkload:
    """`session(k)` is a pure function of (config, k)."""

    name = "agentx"
    is_open_loop = False

    def __init__(self, config: AgentXConfig) -> None:
        self.config = config
        num_system = config.system_len.sample_int(random.Random(f"{config.seed}:system"), minimum=0)
        self._system = Message("system", seeded_words(f"system:{config.seed}", num_system), num_system)

    def describe(self) -> dict[str, str]:
        return {k: str(v) for k, v in vars(self.config).items()}

    def _request(self, rng: random.Random, rid: str, sid: str, msgs: list[Message], think: float) -> RequestSpec:
        cfg = self.config
        out = cfg.output_len.sample_int(rng)
        cancel = max(1, out // 2) if cfg.cancel_prob and rng.random() < cfg.cancel_prob else None
        return RequestSpec(rid, tuple(msgs), out, sid, think, None, cancel)

    def _message(self, rng: random.Random, role: str, dist: Dist | int) -> Message:
        num = dist if isinstance(dist, int) else dist.sample_int(rng)
        return Message(role, words(rng, num), num)

    def _think(self, rng: random.Random) -> float:
        return self.config.think_s.sample_float(rng, 0.0, self.config.think_cap_s)

    def _fork(self, rng: random.Random, sid: str, prefix: str, msgs: list[Message]) -> Fork:
        cfg = self.config
        branches: list[tuple[Step, ...]] = []
        for j in range(cfg.num_subagents.sample_int(rng)):
            branch_msgs = msgs + [self._message(rng, "user", cfg.task_len)]
            steps: list[Step] = []
            for u in range(cfg.subagent_turns.sample_int(rng)):
                spec = self._request(rng, f"{prefix}.a{j}.u{u}", sid, branch_msgs, self._think(rng) if u else 0.0)
                if spec.num_input_tokens + spec.max_tokens > cfg.max_context:
                    break
                steps.append(spec)
                branch_msgs += [self._message(rng, "assistant", spec.max_tokens),
                                self._message(rng, "user", cfg.tool_len)]
            if steps:
                branches.append(tuple(steps))
        return Fork(tuple(branches))

    def session(self, index: int) -> Session:
        cfg = self.config
        rng = StreamRandom(f"{cfg.seed}:session:{index}")
        sid = f"agentx-{cfg.seed}-{index}"
        msgs = [self._system, self._message(rng, "user", cfg.task_len)]
        steps: list[Step] = []
        num_turns = cfg.turns.sample_int(rng)
        for turn in range(num_turns):
            spec = self._request(rng, f"{sid}.t{turn}", sid, msgs, self._think(rng) if turn else 0.0)
            if spec.num_input_tokens + spec.max_tokens > cfg.max_context:
                break
            steps.append(spec)
            msgs = msgs + [self._message(rng, "assistant", spec.max_tokens)]
            if turn < num_turns - 1 and rng.random() < cfg.subagent_prob:
                fork = self._fork(rng, sid, f"{sid}.t{turn}", msgs)
                if fork.branches:
                    steps.append(fork)
            msgs.append(self._message(rng, "user", cfg.tool_len))
        return Session(sid, tuple(steps))
