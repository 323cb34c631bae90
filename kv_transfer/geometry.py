"""`Geometry`: what pairing a prefill instance with a decode instance needs to know about each side.

One type for the router's pairing matrix (router/compat.py, from discovery facts, fields may be unknown) and
the decode node's admission check (decode_node/importer.py, from the prefill node's kv_transfer_params and its
own pool). `kv_transfer.remap.pair_problems(p, d)` reads `tp`, `dcp`, `block_size`, `layout_fingerprint`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    """One instance's pool geometry (None: not known yet)."""

    tp: int | None
    """Ranks the pool's KDA heads / attention heads are split over (the pool's world size on a DCP pool)."""
    dcp: int | None
    """Decode-context-parallel size (the cache split by token); 1 on prefill pools and TP decode pools."""
    block_size: int | None
    """Tokens per attention row (a power of two)."""
    layout_fingerprint: str | None
    """engine.layout.RowLayout.fingerprint: formats, sub-block and model shapes."""
    name: str = ""
    """Instance name (router registry) for messages."""
    engine: str | None = None
    """"reference" or "vllm"."""
    model: str | None = None
    cache_dtype: str | None = None
    weights: str | None = None
    """Weights + tokenizer identity: a reference node's `weights_fingerprint`, a vLLM node's model path
    (`root` of its model card). KV made with other weights or another tokenizer means other tokens."""
