"""`pdcluster sim calibrate`: measure a CPU profile on this machine's reference cluster.

It starts the cluster of `--config` (default cluster/default.yaml: P TP=2, D `tp` TP=1, D `dcp` DCP=2), drives it
with loadgen's `random` scenario at fixed lengths (`POINTS`: one request shape and concurrency each, so TTFT
isolates the prefill and TPOT the decode batch; three untimed requests first warm the pairs and caches), and fits the profile's step costs:
- prefill (the P pool's tp): TTFT(T) = C + sum over the chunks c of the T new tokens (after those cached) (the pool's max_step_tokens) of
  base + prefill_token_s*c + prefill_attn_s*c*c/2 + prefill_ctx_s*c*start (start: tokens before the chunk), with base the TP=1 decode fit's (a per-request constant
  and a per-step one are the same unknown when a prompt takes one step) and one cost per attended (query, key)
  pair, prefill_attn_s = prefill_ctx_s (`fit_prefill`), least squares over the `ttft_*` points
  weighted by 1/TTFT (a coefficient that comes out negative is dropped and the rest refitted); C, the request's
  path outside the engine (router, both legs, the READ), becomes `http.prefill_leg_s`;
- decode, TP=1 pool: step = base + decode_seq_s*b + decode_ctx_s*S (b requests, S their summed context) from
  batch 1 short, batch 4 short and batch 1 long; each point's step is what its decode node saw (`node_step`: the
  node's token-gap histogram over the point, every token of every stream, a few hundred rounds), where a
  measured.json from before it has only the client's TPOT (divided by `first_chunk_share`);
- decode, DCP=2 pool: base and decode_seq_s from batch 1 and 2 at the same context; decode_ctx_s is taken as
  half the TP=1 pool's (each rank holds half the tokens): an assumption the profile states.
- the TP=1 decode node's own prefill (colocated turns, skipped P legs): the `COLOCATED` points on a second cluster
  of the same pools whose router never sends a P leg, fitted like the P pool's (its chunks, its base).
- core sharing (`StepCost.contention`): each step kind's from its `BESIDE` point (measured while a background load
  keeps one other instance busy) with node figures only (`fit_contention`), per round, the median round's kept and
  every round's in the fit: a decode step from its node's token gaps beside and alone, over the share of the
  point's wall time the P node computed prefills (its `pdcluster_node_prefill_seconds` sum over the point); the P
  prefill from that histogram's mean step beside and alone, with the background's own prefills among the point's
  steps (each background request's short prompt, one or more a round) taken out at the fitted prefill's price for
  their length (every round of the calibration of 2026-12-06 07:00 counted one: leaving such rounds out left none,
  and the prefill kept 1.0, which the point measured as 0.16). From clients' TTFT and TPOT the same points moved 45-127%
  between the rounds of one calibration (2026-12-06 03:50), so a point without node figures (a measured.json from
  before them) keeps `TIME_SHARING` (1.0: the kernel splits a core evenly between its runnable threads, every rank
  one torch thread pinned to its core, node/executor.py), and its beside point is reported as a prediction of it
  (`used_for_fit` false).
Every point is measured in `--rounds` rounds (default ROUNDS), round after round over the whole calibration, each
with words of its own; a point's figures are its median round's (`combine_rounds`), and the profile's `fit` list
keeps each round's figure and their spread, so a calibration says how far its own points moved.
A point's prompt may start with tokens the prefill node has cached (the points' words share a prefix): each
point records its mean cached tokens and the fit prefills only the rest.
- the DCP prefill's gather (`StepCost.prefill_prefix_s`): `DCP_RESUME` on the colocated cluster, second turns
  whose DCP instance prefills their new tokens after about 7,000 cached ones (`fit_prefix`).
Not measured (stated in the profile's notes): the DCP pool's own per-token prefill (set to the P pool's: both are
two-rank SPMD prefills). Transfer costs come from benchmarks/RESULTS.md (CPU loopback).
Every measured point and what the fitted model gives for it are written to the profile's `fit` list.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster.config import DEFAULT_CONFIG_PATH, ClusterConfig, load_config, node_settings_class
from loadgen.lengths import parse_dist
from loadgen.scenarios.random_requests import RandomConfig, RandomWorkload

PROG = "pdcluster sim calibrate"
WORD_BYTES = 5
"""loadgen's words are four letters and a space: the byte tokenizer sees five tokens per word."""
TEMPLATE_TOKENS = 19 - 1
"""BOS, ROLE "user\\n", END, ROLE "assistant\\n" around one user message (the last word has no space)."""


@dataclass(frozen=True)
class Point:
    name: str
    words: int
    output: int
    concurrency: int
    requests: int


TPOT_TOKENS = 97
"""Output tokens of the TPOT points. A client's TPOT spans its first to its last chunk, and the first chunk is the
first token that releases text (about one in seven on the CPU presets: `first_chunk_share`), so a stream's span
misses a geometric number of its first steps; over 32 steps that offset moved a point's mean of two streams by up
to a third between rounds (tpot_tp_b1_short 10.8 / 16.1 / 16.7 ms on 2026-12-06 03:50). At text_token_p 0.14 the
offset alone gives a two-stream mean a coefficient of variation of 17% at 33 tokens, 5% at 97 (drawn 20,000
times); the longer streams cost about +1.5 min over a calibration of three rounds (a --quick calibration of one
round took 5:21 at load 10)."""
LEGACY_TPOT_TOKENS = 33
"""The TPOT points' output before TPOT_TOKENS: a measured.json whose points carry no `output` was measured with it."""

POINTS = (
    Point("ttft_w20", 20, 2, 1, 3), Point("ttft_w300", 300, 2, 1, 2), Point("ttft_w700", 700, 2, 1, 2),
    Point("ttft_w1200", 1200, 2, 1, 2),
    Point("tpot_tp_b1_short", 20, TPOT_TOKENS, 1, 2), Point("tpot_tp_b4_short", 20, TPOT_TOKENS, 4, 8),
    Point("tpot_tp_b1_long", 1000, TPOT_TOKENS, 1, 2),
    Point("tpot_dcp_b1", 1400, TPOT_TOKENS, 1, 2), Point("tpot_dcp_b2", 1400, TPOT_TOKENS, 2, 4),
    Point("ttft_append_w600_w300", 600, 300, 1, 6),
)
COLOCATED = (Point("colo_ttft_w20", 20, 2, 1, 3), Point("colo_ttft_w300", 300, 2, 1, 2),
             Point("colo_ttft_w1200", 1200, 2, 1, 2), Point("colo_append_w600_w300", 600, 300, 1, 6))
"""The same shapes with the router never sending a P leg: the TP=1 decode node prefills (in its chunks)."""
"""`ttft_append_*` / `colo_append_*`: agent sessions of two turns (a 600-word system prompt, a 300-word tool result): the second
turn's TTFT is a prefill of the new tokens attending over the cached prefix (its `output` is the new words). Both
turns stay within the TP pool's 8,192 tokens with the router's growth allowance, so the second turn goes where
the first left its cache; `_append_point` refuses a run whose second turns found nothing cached."""
DCP_RESUME = Point("dcp_resume_w1400_w2", 1400, 2, 1, 2)
"""A two-turn agent session on the colocated cluster's DCP pool (a 1,400-word system prompt: past the TP pool's
8,192 tokens with the router's growth allowance) whose second turn adds a 2-word tool result: the DCP instance
prefills the tokens it does not hold (37 new ones, and its last partial block when it kept no tail: about 500)
in one or two chunks after about 7,000 cached tokens. The DCP prefill all-gathers the whole prefix before every
chunk (engine/parallel/spmd.py `DCPModel.prefill`), which is most of such a step: the point fits the DCP step's
`prefill_prefix_s` (`fit_prefix`). On the disaggregated cluster the same turn takes a P leg (37 uncached tokens
reach the router's `disagg_min_uncached_tokens` of 32), so it is measured where no P leg is sent."""


@dataclass(frozen=True)
class Beside:
    """A point measured while a background load keeps another instance busy (sim/measure.py `background`: one
    request at a time, `words` fresh words, `max_tokens` out), against the point `alone` of the same shape measured
    without it: how much sharing the cores lengthens a step (sim/profile.py `StepCost.contention`)."""

    point: Point
    alone: str
    words: int
    max_tokens: int
    step: int
    """The step whose core sharing it checks: 0 the P prefill, 1 the TP=1 decode, 2 the DCP decode."""

    @property
    def busy_role(self) -> str:
        """The pool the background keeps busy beside the point: the P pool for a decode point, the TP=1 decode pool
        for the prefill point."""
        return "decode" if self.step == 0 else "prefill"


BESIDE = (
    Beside(Point("tpot_tp_beside_prefill", 20, TPOT_TOKENS, 1, 2), "tpot_tp_b1_short", 1400, 2, step=1),
    Beside(Point("ttft_beside_tp_decode", 300, 2, 1, 2), "ttft_w300", 20, 400, step=0),
    Beside(Point("tpot_dcp_beside_prefill", 1400, TPOT_TOKENS, 1, 2), "tpot_dcp_b1", 1000, 2, step=2),
)
"""The TP=1 decode beside the P prefill (the background's 1,400-word prompts go to the DCP pool: P prefills them
and the DCP pool decodes two tokens each); the P prefill beside the TP=1 decode (400-token answers to 20-word
prompts); the DCP decode beside the P prefill (1,000-word prompts that go to the TP=1 pool for two tokens).
Each point's own words come from another seed than the points', so its prompts are not cached."""
BESIDE_NAMES = frozenset(b.point.name for b in BESIDE)
POINT_SEED = 7
APPEND_SEED = 11
BESIDE_SEED = 13
BACKGROUND_SEED = 17
"""The background's words: another stream than every point's, so neither finds the other's prompts cached."""
ROUNDS = 3
"""Rounds of the points per calibration (the median round per point). The quiet calibrations of 2026-12-05 23:34
and 2026-12-06 00:53 measured ttft_w300 at 0.95 s and 1.30 s, and in the second, the same shape beside a busy
decode instance at 1.07 s, faster than alone: a disturbance of a minute or two moved every point it overlapped by
a third, and the validation's random levels at c1 came out 20% under and 20% over the real ones with the two."""
ROUND_SEED_STEP = 100
"""Round r draws its words from each point's seed plus r times this: no round finds another's prompts cached,
and within a round the points share their words' prefix as in the first."""
QUICK = ("ttft_w20", "ttft_w300", "ttft_w700", "tpot_tp_b1_short", "tpot_tp_b4_short", "tpot_tp_b1_long",
         "tpot_dcp_b1", "tpot_dcp_b2", "ttft_append_w600_w300", DCP_RESUME.name)


ALL = (*(p.name for p in POINTS), DCP_RESUME.name)
"""What a calibration measures without --quick (the BESIDE and COLOCATED points come with their POINTS)."""


def prompt_tokens(words: int) -> int:
    return TEMPLATE_TOKENS + WORD_BYTES * words


def chunk_features(tokens: int, chunk: int | None, cached: int = 0) -> tuple[int, int, float, float]:
    """(steps, new tokens, sum of c*c/2, sum of c*start) of a prompt of `tokens` prefilled from position `cached` in
    chunks of `chunk` tokens (c: a chunk's tokens, start: the tokens before it)."""
    size = chunk or tokens
    steps, within, ctx, done = 0, 0.0, 0.0, cached
    while done < tokens:
        c = min(size, tokens - done)
        within += c * c / 2
        ctx += c * done
        done += c
        steps += 1
    return steps, tokens - cached, within, ctx


def nonneg_lstsq(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a negative one is dropped, the rest refitted)."""
    keep = list(range(features.shape[1]))
    while True:
        coef = np.zeros(features.shape[1])
        sol, *_ = np.linalg.lstsq(features[:, keep], target, rcond=None)
        coef[keep] = sol
        bad = [k for k in keep if coef[k] < 0]
        if not bad:
            return coef
        keep.remove(min(bad, key=lambda k: coef[k]))


def fit_prefill(rows: list[list[float]], y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(constant, prefill_token_s, prefill_attn_s, prefill_ctx_s) from points' rows `[1, steps, new tokens, sum
    c*c/2, sum c*start]` (`chunk_features`) and their times less the per-step base (`y`), weighted least squares,
    every coefficient >= 0. Attention costs the same per (query, key) pair whether the key was cached or computed in
    the same step, so `prefill_attn_s` and `prefill_ctx_s` are one unknown over c*c/2 + c*start pairs: fitted apart,
    the points (whose largest uncached prompt is about 3,000 tokens after as many cached) put it all on one of them
    (2026-12-06 03:50: prefill_attn_s 0 for the P pool), which a 6,000-token prompt prefilled from nothing (agentx
    with the prefix cache off) then pays none of."""
    feats = np.array([[row[0], row[2], row[3] + row[4]] for row in rows])
    const, per_token, per_pair = nonneg_lstsq(feats * weights[:, None], y * weights)
    return np.array([const, per_token, per_pair, per_pair])


def host_cores() -> int:
    """Cores this process may run on (what every rank of the local cluster shares)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _pools(config: ClusterConfig) -> tuple:
    prefill = config.pools_by_role("prefill")
    tp = [p for p in config.pools_by_role("decode") if p.dcp == 1 and p.tp == 1]
    dcp = [p for p in config.pools_by_role("decode") if p.dcp > 1]
    if len(prefill) != 1 or len(tp) != 1 or len(dcp) != 1:
        raise ValueError("calibration needs one prefill pool, one TP=1 decode pool and one DCP decode pool "
                         "(cluster/default.yaml's shape)")
    return prefill[0], tp[0], dcp[0]


def run_points(config: ClusterConfig, names: tuple[str, ...], out_dir: Path, repeat: int = 1,
               rounds: int = ROUNDS) -> dict[str, dict]:
    """Measure each point `rounds` times on one started cluster, round after round (every round sends each point
    `repeat` times its requests, with words of its own: the points' seeds plus ROUND_SEED_STEP times the round),
    and combine each point's rounds (`combine_rounds`: the median round, each round's figures kept). A disturbance
    of the machine that lasts a minute then moves one round of the points it overlaps, not the point."""
    if repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {repeat}")
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {rounds}")
    from sim.measure import RealCluster, Warmup

    warmup = (Warmup(300, 3),)  # on each cluster: its first READs, its caches

    found: dict[str, list[dict]] = {}

    def keep(name: str, got: dict, r: int) -> None:
        found.setdefault(name, []).append(got)
        print(f"{name} (round {r + 1} of {rounds}): {got}", file=sys.stderr)

    with RealCluster(config, out_dir / "logs") as real:
        real.warm_up(warmup, out_dir)
        for r in range(rounds):
            shift, where = ROUND_SEED_STEP * r, out_dir / f"round{r + 1}"
            for point in POINTS:
                if point.name not in names:
                    continue
                if point.name.startswith("ttft_append"):
                    keep(point.name, _append_point(real, point, where, repeat, APPEND_SEED + shift), r)
                else:
                    keep(point.name, _random_point(real, point, where, repeat, POINT_SEED + shift,
                                                   decode_node(config, point.name),
                                                   prefill=prefill_node(config, point.name)), r)
            for beside in BESIDE:
                if beside.alone not in names:
                    continue
                with real.background(beside.words, beside.max_tokens, BACKGROUND_SEED + shift) as done:
                    got = _random_point(real, beside.point, where, repeat, BESIDE_SEED + shift,
                                        decode_node(config, beside.point.name), busy_node(config, beside),
                                        prefill_node(config, beside.point.name))
                got["background_done"] = len(done)
                keep(beside.point.name, got, r)
    colocated = config.model_copy(update={"router": config.router.model_copy(update={
        "settings": {**config.router.settings, "disagg_min_uncached_tokens": 10**9}})})
    with RealCluster(colocated, out_dir / "logs-colocated") as real:
        real.warm_up(warmup, out_dir / "colocated")
        for r in range(rounds):
            shift, where = ROUND_SEED_STEP * r, out_dir / f"round{r + 1}"
            for point in COLOCATED:
                if "append" in point.name:
                    keep(point.name, _append_point(real, point, where, repeat, APPEND_SEED + shift), r)
                else:
                    keep(point.name, _random_point(real, point, where, repeat, POINT_SEED + shift), r)
            if DCP_RESUME.name in names:
                keep(DCP_RESUME.name, _append_point(real, DCP_RESUME, where, repeat, APPEND_SEED + shift), r)
    return {name: combine_rounds(got) for name, got in found.items()}


SUMMED = frozenset({"num_ok", "later_chunks", "later_tokens", "background_done", "node_gaps"})
"""Counts a point's rounds add up (the stream model pools chunks over every stream)."""


ROUND_KEYS = {"ttft_s": "ttft_rounds", "tpot_s": "tpot_rounds", "step_s": "step_rounds",
              "busy_share": "busy_share_rounds", "prefill_step_s": "prefill_step_rounds",
              "prefill_steps": "prefill_steps_rounds"}
"""A point's figures whose every round `combine_rounds` keeps, and the key it keeps them under."""


def combine_rounds(rounds: list[dict]) -> dict:
    """One point over its rounds: each figure the median of the rounds' (token counts rounded to whole tokens),
    the counts in SUMMED added up; `ttft_rounds` / `tpot_rounds` keep every round's TTFT and TPOT (the fit writes
    their spread into the profile). One round: that round's figures."""
    if not rounds:
        raise ValueError("combine_rounds: a point without a round")
    out: dict = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        if key in SUMMED:
            out[key] = sum(values)
        elif isinstance(values[0], int):
            out[key] = round(statistics.median(values))
        else:
            out[key] = statistics.median(values)
    for key, kept in ROUND_KEYS.items():
        if key in out:
            out[kept] = [r[key] for r in rounds]
    return out


def decode_node(config: ClusterConfig, point: str) -> str | None:
    """The decode instance a TPOT point's streams run on (its pool's first; the points send one request shape
    that the router places there): `tpot_tp_*` the TP=1 pool's, `tpot_dcp_*` the DCP pool's; None for others."""
    from cluster.plan import instance_names

    _, tp_pool, dcp_pool = _pools(config)
    for prefix, pool in (("tpot_tp_", tp_pool), ("tpot_dcp_", dcp_pool)):
        if point.startswith(prefix):
            return instance_names(pool)[0]
    return None


def prefill_node(config: ClusterConfig, point: str) -> str | None:
    """The P instance whose prefill steps a point records (`_random_point`'s `prefill`): the prefill point beside a
    decode load and its alone point (`Beside` with step 0); None for others."""
    from cluster.plan import instance_names

    wanted = {name for b in BESIDE if b.step == 0 for name in (b.point.name, b.alone)}
    return instance_names(_pools(config)[0])[0] if point in wanted else None


def busy_node(config: ClusterConfig, beside: Beside) -> tuple[str, str] | None:
    """(instance, histogram) whose sum over a beside decode point is how long the background kept the P instance
    computing: its prefill steps (PREFILL_SECONDS, observed as each step ends). None for the prefill point: a
    decode node observes its token gaps when a request finishes (node/metrics.py `observe_request`), not as they
    pass, so they say nothing of a window shorter than a request; that point's busy share is 1 by construction
    (`fit_contention`)."""
    from cluster.plan import instance_names
    from sim.measure import PREFILL_SECONDS

    if beside.busy_role != "prefill":
        return None
    return instance_names(_pools(config)[0])[0], PREFILL_SECONDS


def _random_point(real, point: Point, out_dir: Path, repeat: int = 1,  # noqa: ANN001 - sim.measure.RealCluster
                  seed: int = POINT_SEED, node: str | None = None, busy: tuple[str, str] | None = None,
                  prefill: str | None = None) -> dict:
    """One point's figures; with `node` (a TPOT point's decode instance) also its decode step as the node saw it
    (`node_step`); with `busy` (`busy_node`) also the share of the point's wall time that instance computed
    (`busy_share`); with `prefill` (the P instance) also its prefill steps over the point and their mean
    (`prefill_steps`, `prefill_step_s`)."""
    from sim.measure import PREFILL_SECONDS

    workload = RandomWorkload(RandomConfig(seed=seed, input_len=parse_dist(str(point.words)),
                                           output_len=parse_dist(str(point.output))))
    before = real.token_gaps(node) if node else None
    busy_before = real.node_totals(*busy) if busy else None
    prefill_before = real.node_totals(prefill, PREFILL_SECONDS) if prefill else None
    started = time.monotonic()
    summary = real.sweep(workload, "random", [point.concurrency], 1e6, out_dir / point.name,
                         max_requests=point.requests * repeat, drain_s=600.0)
    wall = time.monotonic() - started
    level = summary.levels[0]
    if not level.num_ok:
        raise RuntimeError(f"calibration point {point.name}: no request succeeded ({level.errors_by_kind})")
    steps = node_step(before, real.token_gaps(node), level.num_ok) if before is not None else {}
    if busy_before is not None and wall > 0:
        steps["busy_share"] = min(1.0, (real.node_totals(*busy)[0] - busy_before[0]) / wall)
    if prefill_before is not None:
        total, count = real.node_totals(prefill, PREFILL_SECONDS)
        if count > prefill_before[1]:
            steps["prefill_steps"] = count - prefill_before[1]
            steps["prefill_step_s"] = (total - prefill_before[0]) / steps["prefill_steps"]
    ok = [r for r in level.records if r.is_ok]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    return {"ttft_s": level.ttft_ms.p50 / 1000, "tpot_s": statistics.mean(tpots) if tpots else 0.0,
            "prompt_tokens": level.input_tokens // level.num_ok, "num_ok": level.num_ok, "output": point.output,
            "cached_tokens": round(sum(r.cached_tokens or 0 for r in ok) / len(ok)), **chunk_counts(level.records),
            **steps}


def node_step(before: tuple[float, int], after: tuple[float, int], num_streams: int) -> dict:
    """A TPOT point's decode step from its decode node's token gaps (sim/measure.py TOKEN_GAPS: (sum, count)
    before and after it): the gaps' sum over the rounds they span, which is their count less one per stream (an
    imported stream's first token leaves the node with its second, in one round: a gap of about 0). Every token
    of every stream counts, not the client's chunks, so neither `text_token_p` nor the first chunk's offset enters
    (`first_chunk_share`). {} when the node saw no gap (a node without the histogram)."""
    total, count = after[0] - before[0], after[1] - before[1]
    rounds = count - num_streams
    if rounds <= 0 or total <= 0:
        return {}
    return {"step_s": total / rounds, "node_gaps": count}


def chunk_counts(records: list) -> dict[str, int]:
    """Over the successful streams: chunks after each one's first, and tokens after each one's first (the
    stream model's evidence: every token but the last releases text with probability text_token_p)."""
    ok = [r for r in records if r.is_ok and r.completion_tokens]
    return {"later_chunks": sum(max(0, len(r.chunk_s) - 1) for r in ok),
            "later_tokens": sum(r.completion_tokens - 1 for r in ok)}


def stream_probabilities(measured: dict[str, dict]) -> tuple[float, float]:
    """(first_token_p, text_token_p) of the stream model (sim/profile.py `StreamModel`), pooled over the points. A
    point whose streams are two tokens long (later_tokens == num_ok) has one chunk after its first exactly when its
    first token released text (the last token always ends a chunk): those give first_token_p. A longer stream's
    chunks after its first are its first token's (first_token_p) and those of the tokens between its first and its
    last (text_token_p each): text_token_p = (their later chunks - first_token_p * streams) / (later tokens -
    streams). Without one kind of point, both are the pooled share of all (chunks after the first over tokens after
    the first). The first token is far likelier to release text on the CPU presets: 34 of 75 two-token streams
    against about 0.12 of later tokens in the calibration of 2026-12-06 07:00 (the random-weight model's first
    sampled id is often an ASCII byte, later ones mostly specials or bytes >= 0x80)."""
    chunks = sum(v.get("later_chunks", 0) for v in measured.values())
    tokens = sum(v.get("later_tokens", 0) for v in measured.values())
    if chunks <= 0 or tokens <= 0:
        raise ValueError("the measured points carry no chunk counts (later_chunks, later_tokens): measure again "
                         "(a measured.json from before they were kept cannot fit the stream model)")
    pooled = min(1.0, chunks / tokens)
    short = [v for v in measured.values() if v.get("later_tokens", 0) > 0 and v["later_tokens"] == v.get("num_ok")]
    long = [v for v in measured.values() if v.get("later_tokens", 0) > v.get("num_ok", 0) > 0]
    if not short or not long:
        return pooled, pooled
    first = sum(v["later_chunks"] for v in short) / sum(v["num_ok"] for v in short)
    streams = sum(v["num_ok"] for v in long)
    rest = (sum(v["later_chunks"] for v in long) - first * streams) / (sum(v["later_tokens"] for v in long) - streams)
    return min(1.0, max(first, 1e-3)), min(1.0, max(rest, 1e-3))


def first_chunk_share(num_tokens: int, p: float, first_with_second: bool = True, first_p: float | None = None) -> float:
    """The expected client TPOT of a steady stream of `num_tokens` tokens over its step time: the span from the
    first chunk to the last, over num_tokens - 1 steps. The first chunk is the first token that releases text
    (the first with probability `first_p`, default p, each later one with p; the last always flushes); an imported
    request's first token leaves with its second (`first_with_second`), so the span never starts before the second
    token."""
    if num_tokens <= 1:
        return 1.0
    n1, stay, total = num_tokens - 1, 1.0, 0.0
    for k in range(n1):  # the first chunk is token k
        q = p if k or first_p is None else first_p
        total += stay * q * (n1 - max(k, 1 if first_with_second else 0))
        stay *= 1.0 - q
    return total / n1


def _append_point(real, point: Point, out_dir: Path, repeat: int = 1,  # noqa: ANN001 - sim.measure.RealCluster
                  seed: int = APPEND_SEED) -> dict:
    """Second turns of two-turn agent sessions: median TTFT, their prompt and cached tokens; the first turns'
    median TTFT and prompt tokens beside them (`first_*`: what DCP_RESUME's prediction is checked against)."""
    from loadgen.scenarios.agentx import AgentXConfig, AgentXWorkload

    cfg = AgentXConfig(seed=seed, system_len=parse_dist(str(point.words)), task_len=parse_dist("20"),
                       tool_len=parse_dist(str(point.output)), output_len=parse_dist("2"), turns=parse_dist("2"),
                       think_s=parse_dist("0"), subagent_prob=0.0, max_context=10**6)
    summary = real.sweep(AgentXWorkload(cfg), "agentx", [point.concurrency], 1e6, out_dir / point.name,
                         max_requests=point.requests * repeat, drain_s=600.0)
    second = [r for r in summary.levels[0].records if r.is_ok and r.request_id.endswith(".t1")]
    if not second:
        raise RuntimeError(f"calibration point {point.name}: no second turn succeeded")
    if not any(r.cached_tokens for r in second):
        raise RuntimeError(f"calibration point {point.name}: no second turn reused the first's cache (did the "
                           "session change pools?)")
    first = [r for r in summary.levels[0].records if r.is_ok and r.request_id.endswith(".t0")]
    ttfts = sorted(r.ttft_s for r in second)
    got = {"ttft_s": ttfts[len(ttfts) // 2], "tpot_s": 0.0, "num_ok": len(second), **chunk_counts(second),
           "prompt_tokens": round(sum(r.prompt_tokens or 0 for r in second) / len(second)),
           "cached_tokens": round(sum(r.cached_tokens or 0 for r in second) / len(second))}
    if first:
        got["first_ttft_s"] = statistics.median(r.ttft_s for r in first)
        got["first_prompt_tokens"] = round(statistics.median(r.prompt_tokens or 0 for r in first))
    return got


ROUTER_S = 0.0005
"""The router's own work per request (benchmarks/RESULTS.md 2026-12-03, evening)."""


TIME_SHARING = 1.0
"""`StepCost.contention` of a calibrated step whose beside point carries no node figures (`fit_contention`): a core's
time split evenly between its runnable threads (the kernel's fair scheduler), each rank one pinned torch thread, so
a step beside k - 1 busy ranks takes k times its time (module docstring)."""


def _per_round(point: dict, key: str) -> list | None:
    """A point's figure `key` in each round (`combine_rounds`' lists), or its one figure, or None."""
    got = point.get(ROUND_KEYS.get(key, ""))
    return list(got) if got else ([point[key]] if key in point else None)


def own_steps_mean(mean_s: float, counted: int, own: int, extra_step_s: float) -> float:
    """The mean of a point's `own` steps, where its node counted `counted` (> own: the background's, each
    `extra_step_s`) with mean `mean_s`; `mean_s` as it is when the counts agree or `own` is 0."""
    if counted <= own or own <= 0:
        return mean_s
    return (mean_s * counted - (counted - own) * extra_step_s) / own


def fit_contention(beside: dict, alone: dict, figure: str = "step_s", count: str | None = None,
                   extra_step_s: float | None = None) -> list[float] | None:
    """A step's `StepCost.contention`, one per round, from its beside point and the point `alone` of the same shape,
    both with the node's figure of the step (`figure`: `step_s` a decode step from the token gaps, `prefill_step_s`
    a P prefill step from its histogram) and the beside point with the share of its wall time the background's
    instance computed (`busy_share`, u). Beside one busy instance on its cores the step has k = 2 (sim/instance.py
    `HostCores`: the P instance's two ranks and a decode instance's rank 0 share core 0), so a step takes `1 + c`
    times its time alone for a share u of the point and its time for the rest: beside = alone * (1 + c * u),
    c = (beside / alone - 1) / u, at least 0. Round r of the beside point pairs with round r of the alone point;
    with `count` (the figure's number of steps: the prefill point beside a decode load), `figure` is the mean of
    `count` steps, and a round whose beside point counted more steps than the alone one's counted the background's
    own prefills among the point's: with `extra_step_s` (what the fitted prefill gives for one background prompt)
    each extra step's time is taken out of the round's sum and the rest is the point's own steps, without it the
    round is left out (as is a round that counted fewer). A kept round has u = 1 unless the point says otherwise:
    the background's request decodes throughout the point (its prefill among the point's is one short step, taken
    out). None (the caller keeps TIME_SHARING) when a figure is missing, u is 0, or no round is left."""
    betas, alones, shares = _per_round(beside, figure), _per_round(alone, figure), _per_round(beside, "busy_share")
    if shares is None and count is not None and betas:
        shares = [1.0] * len(betas)
    if not (betas and alones and shares) or not len(betas) == len(alones) == len(shares):
        return None
    keep = [True] * len(betas)
    if count is not None:
        got, want = _per_round(beside, count), _per_round(alone, count)
        if not got or not want or len(got) != len(betas) or len(want) != len(betas):
            return None
        keep = [g == w or (g > w and extra_step_s is not None) for g, w in zip(got, want)]
        betas = [own_steps_mean(b, g, w, extra_step_s or 0.0) for b, g, w in zip(betas, got, want)]
    rounds = [(b, a, u) for b, a, u, k in zip(betas, alones, shares, keep) if k and a > 0 and u > 0]
    if not rounds:
        return None
    return [max(0.0, (b / a - 1.0) / u) for b, a, u in rounds]


def decode_source(point: dict) -> str:
    return ("Decode step from the node's token gaps (node_step), s" if "step_s" in point
            else "TPOT mean over streams (first to last chunk), s")


def output_tokens(point: dict) -> int:
    """The output tokens a measured TPOT point asked for (LEGACY_TPOT_TOKENS for a measured.json from before points
    recorded it)."""
    return int(point.get("output", LEGACY_TPOT_TOKENS))


def fit_profile(config: ClusterConfig, measured: dict[str, dict], name: str, command: str) -> dict:
    """The profile JSON (a dict) fitted to `measured` (see the module docstring for the model).

    What the client measures is chunks (sim/stream.py): every TPOT point (the mean of its streams' TPOTs) is
    divided by the expected share of its steps that its first-to-last chunk span covers (`first_chunk_share`, with
    the stream model's text_token_p, itself measured from the points' chunk counts) before the step costs are
    fitted; a disaggregated TTFT ends
    with the decode node's first step (the prefill node's token leaves with the second one), a colocated one
    with the prefill step plus, when the first token releases no text, a decode step."""
    prefill, tp_pool, dcp_pool = _pools(config)
    p_eng = node_settings_class("prefill").model_validate(prefill.settings).engine
    first_p, text_p = stream_probabilities(measured)

    def ctx(point: str, batch: int) -> float:
        return batch * (measured[point]["prompt_tokens"] + output_tokens(measured[point]) / 2)

    def share(point: str) -> float:
        """What the point's figure is of its decode step: 1 for the node's step, the chunk share of a TPOT."""
        return 1.0 if "step_s" in measured[point] else first_chunk_share(output_tokens(measured[point]), text_p,
                                                                                        first_p=first_p)

    def figure(point: str) -> float:
        return measured[point]["step_s" if "step_s" in measured[point] else "tpot_s"]

    tp_names = ("tpot_tp_b1_short", "tpot_tp_b4_short", "tpot_tp_b1_long")
    tp_rows = [[1, 1, ctx(tp_names[0], 1)], [1, 4, ctx(tp_names[1], 4)], [1, 1, ctx(tp_names[2], 1)]]
    tp_y = [figure(k) / share(k) for k in tp_names]
    d_base, d_seq, d_ctx = nonneg_lstsq(np.array(tp_rows, dtype=float), np.array(tp_y))

    def d_step(prompt_tokens: float) -> float:
        """The TP=1 decode node's step for one request right after its prompt."""
        return d_base + d_seq + d_ctx * (prompt_tokens + 1)

    # prefill: a step's fixed cost is the decode pool's base (a constant per request cannot be told apart from
    # it when prompts take one step); the fit weighs every point by 1/TTFT (relative error)
    p_base = d_base
    ttft = [(k, v) for k, v in measured.items() if k.startswith("ttft_") and k not in BESIDE_NAMES]
    rows = [[1.0, *chunk_features(v["prompt_tokens"], p_eng.max_step_tokens, v.get("cached_tokens", 0))]
            for _, v in ttft]
    y = np.array([v["ttft_s"] - p_base * row[1] - d_step(v["prompt_tokens"]) for (_, v), row in zip(ttft, rows)])
    weights = np.array([1.0 / v["ttft_s"] for _, v in ttft])
    c0, p_tok, p_attn, p_ctx = fit_prefill(rows, y, weights)
    dcp_ctx = d_ctx / 2
    dcp_names = (("tpot_dcp_b1", 1), ("tpot_dcp_b2", 2))
    dcp_y = [figure(k) / share(k) - dcp_ctx * ctx(k, b) for k, b in dcp_names]
    dcp_base, dcp_seq = nonneg_lstsq(np.array([[1.0, 1.0], [1.0, 2.0]]), np.array(dcp_y))
    p_world = max(prefill.tp, prefill.dcp)
    d_eng = node_settings_class("decode").model_validate(tp_pool.settings).engine
    colo = [(k, v) for k, v in measured.items() if k.startswith("colo_")]
    colo_rows = [[1.0, *chunk_features(v["prompt_tokens"], d_eng.max_step_tokens, v.get("cached_tokens", 0))]
                 for _, v in colo]
    colo_fit = None
    if len(colo) >= 4:
        y = np.array([v["ttft_s"] - d_base * row[1] - (1.0 - first_p) * d_step(v["prompt_tokens"])
                      for (_, v), row in zip(colo, colo_rows)])
        colo_fit = fit_prefill(colo_rows, y, np.array([1.0 / v["ttft_s"] for _, v in colo]))
    # the decode leg (router -> D, until the node starts on it) is the colocated path's constant; the prefill
    # leg is what the disaggregated path's constant has beyond it (the READ's setup stays in it)
    decode_leg = max(0.0, float(colo_fit[0]) - ROUTER_S) if colo_fit is not None else 0.0
    prefill_leg = max(0.0, float(c0) - ROUTER_S - decode_leg)

    def step(pool, base: float, seq: float, ctx_s: float) -> dict:
        if colo_fit is not None and pool is tp_pool:
            tok, attn, pctx = colo_fit[1:]
        else:
            scale = p_world / max(pool.tp, pool.dcp)
            tok, attn, pctx = p_tok * scale, p_attn * scale, p_ctx * scale
        return {"tp": pool.tp, "dcp": pool.dcp, "base_s": base, "prefill_token_s": tok, "prefill_attn_s": attn,
                "prefill_ctx_s": pctx, "decode_seq_s": seq, "decode_ctx_s": ctx_s}

    steps = [{"tp": prefill.tp, "dcp": 1, "base_s": p_base, "prefill_token_s": p_tok, "prefill_attn_s": p_attn,
              "prefill_ctx_s": p_ctx, "decode_seq_s": d_seq, "decode_ctx_s": d_ctx},
             step(tp_pool, d_base, d_seq, d_ctx), step(dcp_pool, dcp_base, dcp_seq, dcp_ctx)]
    fit = []
    for (k, v), row in zip(ttft, rows):
        fit.append({"name": k, "measured": v["ttft_s"], "used_for_fit": True, "source": "TTFT p50, s",
                    "modelled": float(np.dot([c0, p_base, p_tok, p_attn, p_ctx], row) + d_step(v["prompt_tokens"]))})
    for k, row in zip(tp_names, tp_rows):
        fit.append({"name": k, "measured": figure(k), "used_for_fit": True, "source": decode_source(measured[k]),
                    "modelled": float((d_base + d_seq * row[1] + d_ctx * row[2]) * share(k))})
    for (k, v), row in zip(colo, colo_rows):
        if colo_fit is not None:
            fit.append({"name": k, "measured": v["ttft_s"], "used_for_fit": True, "source": "TTFT p50, s (colocated)",
                        "modelled": float(colo_fit[0] + d_base * row[1] + np.dot(colo_fit[1:], row[2:])
                                          + (1.0 - first_p) * d_step(v["prompt_tokens"]))})
    for k, b in dcp_names:
        fit.append({"name": k, "measured": figure(k), "used_for_fit": True, "source": decode_source(measured[k]),
                    "modelled": float((dcp_base + dcp_seq * b + dcp_ctx * ctx(k, b)) * share(k))})
    n300 = measured["ttft_w300"]["prompt_tokens"] - measured["ttft_w300"].get("cached_tokens", 0)
    contention = [TIME_SHARING] * len(steps)
    for beside in BESIDE:  # a decode step's contention from node figures; else predictions of time-sharing
        got = measured.get(beside.point.name)
        if got is None:
            continue
        alone = measured[beside.alone]
        figure, count, what = (("prefill_step_s", "prefill_steps", "Prefill step (the P node's)") if beside.step == 0
                               else ("step_s", None, "Decode step"))
        extra_s = None
        if beside.step == 0:  # the background's own prompts, prefilled among the point's steps
            n = prompt_tokens(beside.words)
            from sim.profile import StepCost

            extra_s = StepCost.model_validate(steps[0]).step_s(n, n)
        per_round = fit_contention(got, alone, figure, count, extra_s)
        if per_round is not None:
            c = statistics.median(per_round)
            contention[beside.step] = c
            own = got[figure]
            if count is not None:  # the point's own steps' mean
                own = own_steps_mean(own, got.get(count, 0), alone.get(count, 0), extra_s or 0.0)
            fit.append({"name": beside.point.name, "measured": own, "used_for_fit": True,
                        "source": f"{what} beside a busy instance, s (contention {c:.3f} over a busy share "
                                  f"{got.get('busy_share', 1.0):.3f}"
                                  + (", the background's prefills taken out)" if own != got[figure] else ")"),
                        "modelled": alone[figure] * (1.0 + c * got.get("busy_share", 1.0))})
            entry = {"name": f"{beside.point.name}_contention", "measured": c, "modelled": c, "used_for_fit": True,
                     "source": "Contention of the step, the median round's (fit_contention)"}
            if len(per_round) > 1:
                entry.update(rounds=per_round, spread=(max(per_round) - min(per_round)) / c if c else 0.0)
            fit.append(entry)
            continue
        if beside.point.name.startswith("ttft"):
            key, source, stretching = "ttft_s", "TTFT p50", p_base + p_tok * n300 + p_attn * n300 * n300 / 2
        else:  # the node's step where both points have it, else the client's TPOT
            key = "step_s" if "step_s" in got and "step_s" in alone else "tpot_s"
            source, stretching = ("Decode step" if key == "step_s" else "TPOT mean"), alone[key]
        fit.append({"name": beside.point.name, "measured": got[key], "used_for_fit": False,
                    "source": f"{source} beside a busy instance, s (time-sharing: contention {TIME_SHARING})",
                    "modelled": alone[key] + TIME_SHARING * stretching})
    for entry, c in zip(steps, contention):
        entry["contention"] = c
    resume = measured.get(DCP_RESUME.name)
    if resume is not None:
        chunk = node_settings_class("decode").model_validate(dcp_pool.settings).engine.max_step_tokens
        constant_s = ROUTER_S + decode_leg
        prefix_s = fit_prefix(resume, steps[2], first_p, constant_s, chunk)
        if prefix_s is not None:
            steps[2]["prefill_prefix_s"] = prefix_s
            fit.append({"name": DCP_RESUME.name, "measured": resume["ttft_s"], "used_for_fit": True,
                        "source": "TTFT p50 of second turns prefilled on the DCP pool (colocated), s",
                        "modelled": constant_s + _resume_s(resume, steps[2], first_p, chunk)})
        if resume.get("first_ttft_s"):  # a prediction: the first turns, prefilled from nothing in ~28 chunks
            first = {"prompt_tokens": resume["first_prompt_tokens"], "cached_tokens": 0}
            fit.append({"name": DCP_RESUME.name + "_first_turn", "measured": resume["first_ttft_s"],
                        "used_for_fit": False, "source": "TTFT p50 of first turns prefilled on the DCP pool "
                        "(colocated, from no cache), s", "modelled": constant_s + _resume_s(first, steps[2], first_p,
                                                                                             chunk)})
    for entry in fit:
        if entry["name"] in measured:
            key = {"TPOT": "tpot_s", "Deco": "step_s", "Pref": "prefill_step_s"}.get(entry["source"][:4], "ttft_s")
            entry.update(_rounds_of(measured[entry["name"]], key))
    return {
        "name": name, "model": config.model, "device": "cpu (this machine, reference engine)",
        "template": {"kind": "bytes", "tokens_per_message": 4}, "steps": steps,
        "transfer": {"setup_s": 0.002, "per_descriptor_s": 5e-6, "bytes_per_s": 5.3e9},
        "host_cores": host_cores(),
        "http": {"router_s": ROUTER_S, "prefill_leg_s": prefill_leg, "decode_leg_s": decode_leg},
        "stream": {"text_token_p": text_p, "first_token_p": first_p},
        "sources": [f"fitted by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} to loadgen "
                    "random points measured against the cluster of the config (sim/calibrate.py POINTS; with "
                    "--measured, an earlier run's measured.json)",
                    "transfer: benchmarks/RESULTS.md 2026-11-29 KV transfer over NIXL, CPU loopback (packed 5.3 GB/s, "
                    "a descriptor a few microseconds on CMA)",
                    "router_s: benchmarks/RESULTS.md 2026-12-03 (evening), the router's own work per request",
                    "stream: first_token_p from the two-token points' streams (a chunk after the first: the first "
                    "token released text), text_token_p from the longer streams' later chunks less their first "
                    "tokens' (sim/calibrate.py stream_probabilities)"],
        "fit": fit,
        "notes": ("the TP=1 decode node's prefill costs are fitted to the colo_* points (the router sending no P "
                  "leg) when measured; the DCP pool's are the P pool's (both two-rank SPMD prefills, not measured); "
                  "DCP decode_ctx_s is half the TP=1 pool's (assumed); the DCP step's prefill_prefix_s (its prefill's "
                  "gather of the prefix before every chunk) is fitted to the dcp_resume point when measured, 0 elsewhere; "
                  "http.decode_leg_s is the colocated path's "
                  "fitted constant less the router's work, http.prefill_leg_s what the disaggregated path's has "
                  "beyond both (the READ's setup included); TPOT points are divided by the share of steps a "
                  "chunk-level TPOT spans (sim/calibrate.py first_chunk_share) before fitting; a point's cached "
                  "tokens (the points share their words' prefix) are not prefilled; a step kind's contention is "
                  "fitted to its *_beside_* point where both it and its alone point carry node steps (fit_contention), "
                  "else time-sharing's 1.0, of which the point is then a prediction."),
    }


def _resume_s(point: dict, step: dict, first_p: float, chunk: int | None) -> float:
    """A resumed turn's engine time on the DCP pool: the steps prefilling its new tokens after its cached ones in
    chunks of `chunk` tokens and, when its first token releases no text (1 - first_p), the decode step after."""
    from sim.profile import StepCost

    cost, prompt, done = StepCost.model_validate(step), point["prompt_tokens"], point["cached_tokens"]
    total = (1.0 - first_p) * cost.step_s(batch=1, sum_context=prompt + 1)
    while done < prompt:
        c = min(chunk or prompt, prompt - done)
        total += cost.step_s(c, done + c)
        done += c
    return total


def fit_prefix(point: dict, step: dict, first_p: float, constant_s: float, chunk: int | None) -> float | None:
    """The DCP step's `prefill_prefix_s` from DCP_RESUME's second turns: what their TTFT has beyond the request's
    constant (router, decode leg: `constant_s`) and the steps' other terms (`_resume_s` with no prefix cost), over
    the cached tokens before each of their chunks, at least 0. None, with a warning, when they found nothing
    cached (the point measured something else)."""
    cached, prompt = point["cached_tokens"], point["prompt_tokens"]
    if cached <= 0 or cached >= prompt:
        print(f"{PROG}: warning: {DCP_RESUME.name}: second turns with {cached} of {prompt} tokens cached: "
              "prefill_prefix_s not measured, left 0", file=sys.stderr)
        return None
    starts, done = 0, cached
    while done < prompt:
        starts += done
        done += min(chunk or prompt, prompt - done)
    rest = _resume_s(point, {**step, "prefill_prefix_s": 0.0}, first_p, chunk)
    return max(0.0, (point["ttft_s"] - constant_s - rest) / starts)


def _rounds_of(point: dict, key: str) -> dict:
    """A fit entry's per-round figures and their spread, (max - min) / median, where the point has two or more."""
    got = point.get(ROUND_KEYS[key])
    if not got or len(got) < 2:
        return {}
    mid = statistics.median(got)
    return {"rounds": got, "spread": (max(got) - min(got)) / mid if mid else 0.0}


def main_calibrate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG_PATH)
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    p.add_argument("--name", default="cpu-mini-reference")
    p.add_argument("--work-dir", type=Path, default=Path("sim-calibrate"), help="loadgen outputs and node logs")
    p.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} points (no 1200-word TTFT)")
    p.add_argument("--repeat", type=int, default=None,
                   help="times each point's requests are sent per round (default 1: POINTS' counts)")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"rounds of every point, the median round kept (default {ROUNDS})")
    p.add_argument("--measured", type=Path, default=None, help="refit from a measured.json of an earlier run")
    p.add_argument("--figures", choices=("h200", "gb300"), default=None,
                   help="no measurement: fit a GPU profile to published figures (sim/figures.py)")
    args = p.parse_args(argv)
    for flag, value in (("--repeat", args.repeat), ("--rounds", args.rounds)):
        if value is not None and (args.figures or args.measured):
            p.error(f"{flag} sets how many requests each point measures; --figures and --measured measure nothing")
    try:
        if args.figures:
            from sim.figures import build

            return _write(build(args.figures), args.out)
        config = load_config(args.config)
        _pools(config)
        if args.measured:
            measured = json.loads(args.measured.read_text())
        else:
            measured = run_points(config, QUICK if args.quick else ALL, args.work_dir,
                                  1 if args.repeat is None else args.repeat,
                                  ROUNDS if args.rounds is None else args.rounds)
            args.work_dir.mkdir(parents=True, exist_ok=True)
            (args.work_dir / "measured.json").write_text(json.dumps(measured, indent=1))
        profile = fit_profile(config, measured, args.name, "pdcluster sim calibrate " + " ".join(argv))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return _write(profile, args.out)


def _write(profile: dict, out: Path) -> int:
    from sim.profile import Profile

    Profile.model_validate(profile)  # what `pdcluster sim` will read
    out.write_text(json.dumps(profile, indent=1) + "\n")
    for point in profile["fit"]:
        kind = "fit" if point["used_for_fit"] else "predicted"
        err = abs(point["modelled"] - point["measured"]) / point["measured"] if point["measured"] else 0.0
        spread = f", rounds {100 * point['spread']:.0f}% apart" if point.get("spread") is not None else ""
        print(f"{point['name']:>22}: measured {point['measured']:.4f}  modelled {point['modelled']:.4f}  "
              f"({kind}, {100 * err:.1f}%{spread})")
    print(f"wrote {out}")
    return 0
