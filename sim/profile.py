"""Cost models as data: one profile JSON per (model config, device, parallelism set), what `pdcluster sim` reads.

Only time is modelled from a profile; every decision comes from the product code (docs/PLANNING.md).
- `steps`: one `StepCost` per instance parallelism (tp, dcp). An engine step that prefills a chunk of T prompt
  tokens after C tokens already in the cache (a cached prefix, earlier chunks) and decodes b requests whose
  contexts sum to S costs
  `base_s + prefill_token_s*T + prefill_attn_s*T*T/2 + prefill_ctx_s*T*C + prefill_prefix_s*C + decode_seq_s*b
  + decode_ctx_s*S` (each part only when the step has it): attention among the chunk's own tokens and attention to
  cached ones are separate terms (the engine reads the cached part from the row pool); `prefill_prefix_s*C` is
  what a step pays per cached token whatever the chunk's size (a DCP instance all-gathers the whole prefix into a
  whole-sequence cache before every chunk: engine/parallel/spmd.py `DCPModel.prefill`). A step is the node's
  whole round: the rank IPC is in `base_s`.
- `transfer`: a P->D READ of R rows (descriptors) and N bytes takes `setup_s + per_descriptor_s*R + N / bytes_per_s`.
- `http`: the prefill leg's round trip besides its engine time (`prefill_leg_s`), the decode leg's dispatch until
  the node starts on it (`decode_leg_s`), and what the router adds to a request (`router_s`), all per request.
- `stream`: how a node's stream splits into SSE chunks: a chunk goes out when a token completes text (see
  `StreamModel`); a client's TTFT is its first chunk's time and its TPOT spans its first to its last chunk.
- `template`: how a prompt becomes tokens (sim/tokens.py `Template`).
- `host_cores`: on one CPU host, the cores every instance's ranks share, pinned rank r to core r mod host_cores.
- `sources`: where every number came from; `fit`: for fitted profiles, which measured points were used for
  fitting and which are predictions (with their errors).
Bad input raises ValueError naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sim.tokens import Template


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepCost(_Strict):
    tp: int = Field(ge=1)
    dcp: int = Field(1, ge=1)
    base_s: float = Field(ge=0)
    prefill_token_s: float = Field(0.0, ge=0)
    prefill_attn_s: float = Field(0.0, ge=0)
    prefill_ctx_s: float = Field(0.0, ge=0)
    prefill_prefix_s: float = Field(0.0, ge=0)
    """Per cached token, once per step that prefills a chunk after them, whatever the chunk's size (the DCP
    prefill's gather of the prefix; 0 where a chunk reads its prefix in place)."""
    decode_seq_s: float = Field(0.0, ge=0)
    decode_ctx_s: float = Field(0.0, ge=0)
    contention: float = Field(1.0, ge=0)
    """On a shared host (`host_cores`): how much longer a step gets, as a share of its time, per other busy rank on
    its most loaded core: it takes `1 + contention * (k - 1)` times its time beside k - 1 others. 1.0: the core's
    time is split evenly and all of the step needs it (what `pdcluster sim calibrate` writes: the kernel's fair
    share between pinned single-thread ranks; its `*_beside_*` points are reported as predictions of it); below:
    part of the step waits on peers, which a shared core does not lengthen; above: it loses more than its share."""

    def prefill_part(self, num_tokens: int, end: int) -> float:
        cached = end - num_tokens
        t = num_tokens * (self.prefill_token_s + self.prefill_attn_s * num_tokens / 2 + self.prefill_ctx_s * cached)
        if self.prefill_prefix_s:
            t += self.prefill_prefix_s * cached
        return t

    def decode_part(self, batch: int, sum_context: int) -> float:
        return self.decode_seq_s * batch + self.decode_ctx_s * sum_context

    def stretched(self, num_sharing: int) -> float:
        """The factor a step takes when its most loaded core holds `num_sharing` busy ranks (its own included)."""
        return 1.0 + self.contention * (num_sharing - 1)

    def step_s(self, prefill_tokens: int = 0, prefill_end: int = 0, batch: int = 0, sum_context: int = 0) -> float:
        t = self.base_s
        if prefill_tokens:
            t += self.prefill_part(prefill_tokens, prefill_end)
        if batch:
            t += self.decode_part(batch, sum_context)
        return t


class TransferCost(_Strict):
    setup_s: float = Field(0.0, ge=0)
    per_descriptor_s: float = Field(0.0, ge=0)
    bytes_per_s: float = Field(gt=0)

    def read_s(self, num_descriptors: int, num_bytes: int) -> float:
        if num_descriptors <= 0:
            return self.setup_s
        return self.setup_s + self.per_descriptor_s * num_descriptors + num_bytes / self.bytes_per_s


class HttpCost(_Strict):
    router_s: float = Field(0.0, ge=0)
    prefill_leg_s: float = Field(0.0, ge=0)
    decode_leg_s: float = Field(0.0, ge=0)


class StreamModel(_Strict):
    """SSE chunks as a node sends them (node/textgen.py `generate_pieces`): a chunk is sent when the incremental
    detokeniser releases text, i.e. when a token leaves the text ending in a whole character; held tokens go out
    with the next chunk, and the last token always flushes. A stream's first token releases text with
    probability `first_token_p` (None: `text_token_p`), each later one but the last with `text_token_p`,
    independently (drawn per request from a seeded generator): 1.0 for tokenizers whose every token is text; on
    the CPU presets' random-weight byte-level model about 0.45 for the first token and 0.12 for later ones (its
    first sampled id is often an ASCII byte, later ones mostly bytes >= 0x80 or specials, which release
    nothing)."""

    text_token_p: float = Field(1.0, gt=0, le=1)
    first_token_p: float | None = Field(None, gt=0, le=1)

    @property
    def is_every_token(self) -> bool:
        """Every token ends a chunk (no chunk times needed to tell TTFT and TPOT)."""
        return self.text_token_p >= 1.0 and (self.first_token_p is None or self.first_token_p >= 1.0)


class FitPoint(_Strict):
    name: str
    measured: float
    modelled: float
    used_for_fit: bool
    source: str
    rounds: list[float] = Field(default_factory=list)
    """The point's figure in each round of the calibration (`pdcluster sim calibrate --rounds`), when it had more
    than one; `measured` is their median."""
    spread: float | None = Field(None, ge=0)
    """(max - min) / median of `rounds`: how far the point moved between rounds of one calibration."""

    @property
    def relative_error(self) -> float:
        return abs(self.modelled - self.measured) / abs(self.measured) if self.measured else 0.0


class Profile(_Strict):
    name: str
    model: str
    """Model preset (engine.model.config) whose layout sizes the rows."""
    device: str
    gpu: str | None = None
    """kv_transfer/capacity.py GPU profile for KV budgets (None: the cluster config's num_rows decide)."""
    latent: str | None = None
    index_key: str | None = None
    template: Template = Field(default_factory=Template)
    steps: list[StepCost]
    transfer: TransferCost
    http: HttpCost = Field(default_factory=HttpCost)
    stream: StreamModel = Field(default_factory=StreamModel)
    host_cores: int | None = Field(None, ge=1)
    """CPU profiles: every instance's ranks share this many cores, rank r of each on core r mod host_cores, as the
    nodes pin them (a step stretches by the busy ranks on the most loaded of its cores at its start, its own
    included: sim/instance.py `HostCores`). None: instances do not share compute (GPUs)."""
    sources: list[str] = Field(min_length=1)
    fit: list[FitPoint] = Field(default_factory=list)
    notes: str = ""

    def step(self, tp: int, dcp: int) -> StepCost:
        for cost in self.steps:
            if cost.tp == tp and cost.dcp == dcp:
                return cost
        have = ", ".join(f"tp{c.tp}/dcp{c.dcp}" for c in self.steps)
        raise ValueError(f"profile {self.name!r} has no step cost for tp={tp} dcp={dcp} (it has {have}); "
                         "calibrate that parallelism or add a `steps` entry")


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile JSON; ValueError naming the file and the bad field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile {path} is not JSON: {exc.msg} (line {exc.lineno})") from None
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"profile {path}: {problems}") from None


PROFILE_DIR = Path(__file__).with_name("profiles")


def resolve_profile(name_or_path: str) -> Profile:
    """A path, or the name of a shipped profile (sim/profiles/NAME.json)."""
    path = Path(name_or_path)
    if not path.exists() and (PROFILE_DIR / f"{name_or_path}.json").exists():
        path = PROFILE_DIR / f"{name_or_path}.json"
    return load_profile(path)
