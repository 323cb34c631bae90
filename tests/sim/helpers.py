"""Small clusters and profiles for the simulator's tests."""

from __future__ import annotations

from cluster.config import ClusterConfig, parse_config
from sim.profile import HttpCost, Profile, StepCost, TransferCost
from sim.tokens import Template


def cluster(decode_settings: dict | None = None, router: dict | None = None, prefill_tp: int = 2,
            decode_pools: tuple[tuple[str, int, int], ...] = (("tp", 1, 1),)) -> ClusterConfig:
    pools = [{"name": "prefill", "role": "prefill", "tp": prefill_tp}]
    for name, tp, dcp in decode_pools:
        pools.append({"name": name, "role": "decode", "tp": tp, "dcp": dcp, "settings": dict(decode_settings or {})})
    return parse_config({"model": "kimi-k3.1-mini", "router": {"port": None, "settings": dict(router or {})},
                         "pools": pools})


def profile(base_s: float = 0.01, token_s: float = 0.0, seq_s: float = 0.0, ctx_s: float = 0.0,
            kind: str = "words", http: HttpCost | None = None, prefix_s: float = 0.0) -> Profile:
    steps = [StepCost(tp=tp, dcp=dcp, base_s=base_s, prefill_token_s=token_s, decode_seq_s=seq_s, decode_ctx_s=ctx_s,
                      prefill_prefix_s=prefix_s)
             for tp, dcp in ((1, 1), (2, 1), (1, 2))]
    return Profile(name="test", model="kimi-k3.1-mini", device="test", template=Template(kind, 0), steps=steps,
                   transfer=TransferCost(bytes_per_s=1e9), http=http or HttpCost(), sources=["tests/sim/helpers.py"])
