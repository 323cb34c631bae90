"""Node facts the router reads from a node's own endpoints: `/v1/models` and `/metrics`.

- `/v1/models`: served model ids and `max_model_len` (vLLM and our nodes both report it), the weights
  identity: `weights_fingerprint` (reference nodes: model config, seed, tokenizer) and `root` (vLLM: the
  model path it loaded).
- `/metrics`: `vllm:cache_config_info` labels (block_size, cache_dtype, num_gpu_blocks; our reference
  nodes add layout_fingerprint, tp_size, dcp_size, engine), and load figures
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`.
Parsing is pure (text in, frozen dataclass out) so it is tested without a server.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


KNOWN_ENGINES = ("vllm", "reference")
"""vLLM's own `engine` label is the engine index ("0"); only these values name an engine kind."""


@dataclass(frozen=True)
class CacheFacts:
    block_size: int | None = None
    cache_dtype: str | None = None
    num_gpu_blocks: int | None = None
    layout_fingerprint: str | None = None
    tp_size: int | None = None
    dcp_size: int | None = None
    engine: str | None = None


@dataclass(frozen=True)
class LoadFacts:
    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass(frozen=True)
class ModelFacts:
    model_ids: tuple[str, ...] = ()
    max_model_len: int | None = None
    weights_fingerprint: str | None = None
    root: str | None = None
    raw_cards: tuple[dict, ...] = field(default=(), compare=False)


def _int_or_none(value: str | None) -> int | None:
    if value in (None, "", "None"):
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def parse_metrics(text: str) -> tuple[CacheFacts, LoadFacts]:
    """Cache facts and load figures out of a Prometheus text exposition."""
    cache = CacheFacts()
    running = waiting = usage = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels = sample.name, sample.labels
            if name.startswith("vllm:cache_config_info"):
                cache = CacheFacts(
                    block_size=_int_or_none(labels.get("block_size")),
                    cache_dtype=labels.get("cache_dtype"),
                    num_gpu_blocks=_int_or_none(labels.get("num_gpu_blocks")),
                    layout_fingerprint=labels.get("layout_fingerprint") or None,
                    tp_size=_int_or_none(labels.get("tp_size")),
                    dcp_size=_int_or_none(labels.get("dcp_size")),
                    engine=labels.get("engine") if labels.get("engine") in KNOWN_ENGINES else None,
                )
            elif name == "vllm:num_requests_running":
                running += sample.value
            elif name == "vllm:num_requests_waiting":
                waiting += sample.value
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage = max(usage, sample.value)
    return cache, LoadFacts(num_running=running, num_waiting=waiting, kv_usage=usage)


def parse_models(body: dict) -> ModelFacts:
    """Model ids and the smallest max_model_len out of a `/v1/models` answer."""
    cards = [card for card in body.get("data", []) if isinstance(card, dict) and "id" in card]
    lengths = [card["max_model_len"] for card in cards if isinstance(card.get("max_model_len"), int)]
    first = cards[0] if cards else {}
    fingerprint, root = first.get("weights_fingerprint"), first.get("root")
    return ModelFacts(model_ids=tuple(str(card["id"]) for card in cards),
                      max_model_len=min(lengths) if lengths else None,
                      weights_fingerprint=str(fingerprint) if fingerprint else None,
                      root=str(root) if root else None, raw_cards=tuple(cards))
