"""The P x D pairing matrix: which prefill instance may hand KV to which decode instance, and why not.

Computed from node geometry before any request; an incompatible pair is never used, and `/v1/pools`
shows every verdict with its reasons.

Rules:
- engines: a vLLM instance never pairs with a reference instance (different wire-level KV layouts).
- both engines: same served model, same KV cache dtype, every geometry fact known, the same weights and
  tokenizer (`Geometry.weights`: reference nodes must report their fingerprint; vLLM nodes are compared
  by model path when both report one, and refused when only one does).
- vLLM (NixlConnector, vLLM 0.32/0.33): TP sizes divide one another (either direction); D's block size
  is a multiple of P's (P <= D), and equal when P_TP > D_TP; DCP sizes divide their TP size and divide
  one another.
- reference engine: decided by the reference KV planner's own check (`reference_pair_problems`, the
  adapter onto kv_transfer.remap.pair_problems: layout fingerprint, TP, DCP and block-size rules).
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.geometry import Geometry
from kv_transfer.remap import pair_problems as remap_pair_problems


@dataclass(frozen=True)
class PairVerdict:
    prefill: str
    decode: str
    reasons: tuple[str, ...]

    @property
    def is_compatible(self) -> bool:
        return not self.reasons


def _missing(g: Geometry, fields: tuple[str, ...]) -> list[str]:
    return [f"{g.name}: {f} unknown" for f in fields if getattr(g, f) is None]


def vllm_pair_problems(p: Geometry, d: Geometry) -> list[str]:
    """vLLM NixlConnector's pairing rules (TP ratio, block-size ratio, DCP)."""
    problems: list[str] = []
    p_tp, d_tp = p.tp or 1, d.tp or 1
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        problems.append(f"TP sizes {p_tp} (prefill) and {d_tp} (decode) do not divide one another")
    if p.block_size and d.block_size:
        if d.block_size % p.block_size:
            problems.append(f"decode block size {d.block_size} is not a multiple of prefill block size {p.block_size}")
        elif p_tp > d_tp and p.block_size != d.block_size:
            problems.append(f"prefill TP {p_tp} > decode TP {d_tp} needs equal block sizes "
                            f"({p.block_size} vs {d.block_size})")
    p_dcp, d_dcp = p.dcp or 1, d.dcp or 1
    for g, dcp, tp in ((p, p_dcp, p_tp), (d, d_dcp, d_tp)):
        if tp % dcp:
            problems.append(f"{g.name}: DCP {dcp} does not divide TP {tp}")
    if max(p_dcp, d_dcp) % min(p_dcp, d_dcp):
        problems.append(f"DCP sizes {p_dcp} (prefill) and {d_dcp} (decode) do not divide one another")
    return problems


def reference_pair_problems(p: Geometry, d: Geometry) -> list[str]:
    """Adapter onto the reference engine's KV remap rules (kv_transfer/remap.py `pair_problems`): equal
    layout fingerprints, power-of-two TP and block sizes, DCP only on the decode side and dividing its TP.
    Block sizes may differ in either direction (P rows split into or gather from D rows)."""
    return list(remap_pair_problems(p, d))


def weights_problems(p: Geometry, d: Geometry) -> list[str]:
    """A pair must share weights and tokenizer: other weights turn the same KV into other tokens."""
    if p.weights and d.weights:
        if p.weights != d.weights:
            return [f"weights or tokenizer differ ({p.weights} vs {d.weights}): the decode would produce "
                    "other tokens than the prefill's model"]
        return []
    if p.engine == "reference" or d.engine == "reference":
        return [f"{g.name}: weights fingerprint unknown" for g in (p, d) if not g.weights]
    if p.weights or d.weights:
        return [f"{g.name}: weights identity unknown (the other side reports one)" for g in (p, d) if not g.weights]
    return []


def pair_verdict(p: Geometry, d: Geometry) -> PairVerdict:
    """Every reason the pair (p -> d) cannot transfer KV; no reasons means compatible."""
    required = ("engine", "model", "cache_dtype", "block_size")
    reasons = _missing(p, required) + _missing(d, required)
    if p.engine and d.engine and p.engine != d.engine:
        reasons.append(f"engines differ ({p.engine} vs {d.engine}): never mix vLLM and reference nodes")
    if p.model and d.model and p.model != d.model:
        reasons.append(f"models differ ({p.model} vs {d.model})")
    if p.cache_dtype and d.cache_dtype and p.cache_dtype != d.cache_dtype:
        reasons.append(f"KV cache dtypes differ ({p.cache_dtype} vs {d.cache_dtype})")
    reasons.extend(weights_problems(p, d))
    if not reasons:
        rules = vllm_pair_problems if p.engine == "vllm" else reference_pair_problems
        reasons.extend(rules(p, d))
    return PairVerdict(prefill=p.name, decode=d.name, reasons=tuple(reasons))


def compat_matrix(prefills: list[Geometry], decodes: list[Geometry]) -> dict[tuple[str, str], PairVerdict]:
    """Verdicts for every (prefill, decode) pair, keyed by instance names."""
    return {(p.name, d.name): pair_verdict(p, d) for p in prefills for d in decodes}


def move_matrix(decodes: list[Geometry]) -> dict[tuple[str, str], PairVerdict]:
    """Verdicts for every (source, destination) pair of distinct reference decode instances: may the source's
    rows move to the destination (a session outgrowing its pool, router/placement.py `move_source`)? The same
    rules as a P -> D pair, the source in P's place (a DCP source is refused: its rows are split by token)."""
    sources = [g for g in decodes if g.engine == "reference"]
    return {(s.name, d.name): pair_verdict(s, d) for s in sources for d in decodes if d.name != s.name}
