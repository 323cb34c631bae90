"""Packed row layout planner: pure arithmetic, no torch.

One pool of equal-size contiguous rows per GPU. A row holds either one block of tokens for the attention
group (the latent page and the index-key page of every DSA layer) or one request's state of one KDA group.

API
---
`plan_layout(cfg, tp_size=1, dcp_size=1, latent_format=None, index_key_format=None, subblock_tokens=64,
block_size=None, dcp_interleave=None) -> RowLayout` (frozen dataclass). Formats default to
`cfg.latent_dtype` / `cfg.index_key_dtype`. `block_size=None` picks the smallest legal power of two; a larger
power of two may be forced (tests pair instances with different block sizes).

Per-token bytes (`RowLayout.latent_bytes`, `index_bytes` per token per DSA layer):
- latent fp8: `kv_lora_rank + qk_rope_dim` (1 B each; the scale is per tensor, not cached per token).
- latent nvfp4: `kv_lora_rank / 2` (e2m1) + `kv_lora_rank / 16` (one e4m3 scale per 16 values) +
  `qk_rope_dim` (the rope/NoPE key part kept in FP8). K3.1 Pro: 256 + 32 + 64 = 352.
- index key fp8: `index_head_dim` + 4 B fp32 scale per 128 dims. Pro 132, mini 64 + 4 = 68.
- index key mxfp4: `index_head_dim / 2` + one e8m0 scale byte per 32 dims. Pro 64 + 4 = 68, mini 34.
`attn_bytes_per_token` (a) = num DSA layers * (latent + index): Pro 13,824 (latent only, `latent_bytes *
layers`), 16,992 / 11,616 / 10,080 for fp8+fp8 / nvfp4+fp8 / nvfp4+mxfp4; mini 2 * (80 + 68) = 296.
Under TP every rank holds every token (replicated); under DCP=W each rank holds 1/W of the tokens, so
`bytes_per_token_per_gpu = a / dcp_size`.

Block size B (tokens per block, instance-wide) is the smallest power of two with `(B / dcp) * a >= s`, where
`s` = `kda_state_bytes` (one KDA group's state of one request on one GPU), and `B / dcp` is a multiple of the
sub-block and of the DCP interleave. `tokens_per_row = B / dcp` (tokens of a block one GPU stores),
`row_bytes = tokens_per_row * a`.

Attention row, sub-block-major (sub-block = kernel page of `subblock_tokens` tokens, b0):
  row = [sub-block 0][sub-block 1]...; sub-block = [L0 latent page][L0 index page][L1 latent][L1 index]...
  latent page = b0 * latent_bytes, index page = b0 * index_bytes, `subblock_bytes` = b0 * a is the stride.
  `latent_page_offset(j, layer)` / `index_page_offset(j, layer)` give byte offsets inside a row; inside a
  page token t (0..b0-1) sits at `t * latent_bytes` (resp. `t * index_bytes`). Every aligned run of 2^m
  sub-blocks is one contiguous byte range (`subblock_range(first, count)`), which is what lets a P row of
  2^k tokens become D rows of 2^j tokens with one read each.
  Under DCP, rank r owns the tokens t with `(t // dcp_interleave) % dcp == r`; its row for block k holds its
  owned tokens of [k*B, (k+1)*B) in increasing order (`dcp_owner`, `dcp_local_token`).

KDA row (one group, one request), head-major so a TP slice of heads is one contiguous range:
  row = [head 0][head 1]... (the `kda_heads_per_gpu` heads this rank owns, global heads
  `[rank*H/tp, (rank+1)*H/tp)`); head = [layer 0 recurrent][layer 0 conv][layer 1 recurrent][layer 1 conv]...
  for the `kda_layers_per_group` layers of the group (in layer order). recurrent = the [d_k, d_v] state
  matrix, row-major, `ssm_state_bytes` per value; conv = the short-conv state of the head's q, k and v
  channels, shape [3, head_dim, conv_size - 1] row-major, `conv_state_bytes` per value. The conv state
  lives in the KDA row beside the recurrent state (both are per request and constant in context length),
  so one read moves all of a request's KDA state. `kda_head_offset(h)`, `kda_recurrent_offset(h, l)`,
  `kda_conv_offset(h, l)`, `kda_head_slice(first, count)`. Bytes after `kda_state_bytes` are padding.

`fingerprint`: sha256 (16 hex chars) over everything a peer must agree on for bytes to mean the same on
both sides and be remappable: per-token formats and sizes, DSA layer count, sub-block size, KDA group shape,
head layout and state dtypes. It excludes tp_size, dcp_size, block_size and dcp_interleave: peers with
different parallelism pair through the remap (kv_transfer/remap.py), which checks those separately.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from engine.model.config import ModelConfig

LATENT_FORMATS = ("fp8", "fp32", "nvfp4")
INDEX_KEY_FORMATS = ("fp8", "fp32", "mxfp4")
LAYOUT_VERSION = 1


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def latent_bytes_per_token(cfg: ModelConfig, fmt: str) -> int:
    """Cached latent bytes of one token in one DSA layer."""
    if fmt == "fp8":
        return cfg.kv_lora_rank + cfg.qk_rope_dim
    if fmt == "fp32":
        return 4 * (cfg.kv_lora_rank + cfg.qk_rope_dim)
    if fmt == "nvfp4":
        if cfg.kv_lora_rank % 16:
            raise ValueError(f"nvfp4 latent needs kv_lora_rank % 16 == 0, got {cfg.kv_lora_rank}")
        return cfg.kv_lora_rank // 2 + cfg.kv_lora_rank // 16 + cfg.qk_rope_dim
    raise ValueError(f"unknown latent format {fmt!r}; known: {', '.join(LATENT_FORMATS)}")


def index_key_bytes_per_token(cfg: ModelConfig, fmt: str) -> int:
    """Cached index-key bytes (values + scales) of one token in one DSA layer."""
    d = cfg.index_head_dim
    if fmt == "fp8":
        return d + 4 * -(-d // 128)
    if fmt == "fp32":
        return 4 * d + 4
    if fmt == "mxfp4":
        if d % 2:
            raise ValueError(f"mxfp4 index key needs an even index_head_dim, got {d}")
        return d // 2 + -(-d // 32)
    raise ValueError(f"unknown index-key format {fmt!r}; known: {', '.join(INDEX_KEY_FORMATS)}")


def kda_head_layer_bytes(cfg: ModelConfig) -> tuple[int, int]:
    """(recurrent, conv) state bytes of one KDA head in one layer."""
    d = cfg.kda_head_dim
    recurrent = d * d * cfg.ssm_state_bytes
    conv = 3 * d * (cfg.kda_conv_size - 1) * cfg.conv_state_bytes
    return recurrent, conv


@dataclass(frozen=True)
class RowLayout:
    """Byte layout of one GPU's row pool. All sizes in bytes unless the name says tokens."""

    model: str
    tp_size: int
    dcp_size: int
    latent_format: str
    index_key_format: str
    num_dsa_layers: int
    latent_bytes: int
    """Latent bytes per token per DSA layer."""
    index_bytes: int
    """Index-key bytes per token per DSA layer."""
    attn_bytes_per_token: int
    """a: bytes of one token over all DSA layers (replicated on every TP rank that holds the token)."""
    kda_groups: int
    kda_layers_per_group: int
    kda_heads_total: int
    kda_heads_per_gpu: int
    kda_recurrent_bytes: int
    """Recurrent state bytes of one head in one layer."""
    kda_conv_bytes: int
    """Conv state bytes of one head in one layer."""
    kda_head_bytes: int
    """One head's state over the group's layers (the head stride of a KDA row)."""
    kda_state_bytes: int
    """s: one KDA group's state of one request on one GPU (heads_per_gpu * head_bytes)."""
    block_size: int
    """B: tokens per block, instance-wide (power of two)."""
    tokens_per_row: int
    """Tokens of a block stored on one GPU: B / dcp_size."""
    row_bytes: int
    subblock_tokens: int
    subblock_bytes: int
    """Sub-block stride inside a row: subblock_tokens * a."""
    subblocks_per_row: int
    dcp_interleave: int
    """Tokens per DCP ownership unit (power of two, multiple of the sub-block); = tokens_per_row if dcp=1."""
    latent_page_bytes: int
    index_page_bytes: int
    layer_stride: int
    """Bytes of one DSA layer's two pages inside a sub-block."""
    fingerprint: str

    @property
    def bytes_per_token_per_gpu(self) -> float:
        """Attention bytes per token per GPU: a (TP, replicated) or a / W (DCP)."""
        return self.attn_bytes_per_token / self.dcp_size

    @property
    def latent_only_bytes_per_token(self) -> int:
        """Latent bytes of one token over all DSA layers, without index keys (Pro fp8: 13,824)."""
        return self.num_dsa_layers * self.latent_bytes

    @property
    def kda_fill(self) -> float:
        """Fraction of a row a KDA group state uses."""
        return self.kda_state_bytes / self.row_bytes

    def rows_per_request(self, num_tokens: int) -> tuple[int, int]:
        """(attention rows, KDA rows) one request of num_tokens needs on each GPU."""
        return -(-num_tokens // self.block_size), self.kda_groups

    # attention pages -------------------------------------------------------------------------------
    def _check_page(self, subblock: int, layer: int) -> None:
        if not 0 <= subblock < self.subblocks_per_row:
            raise IndexError(f"sub-block {subblock} outside 0..{self.subblocks_per_row - 1}")
        if not 0 <= layer < self.num_dsa_layers:
            raise IndexError(f"DSA layer {layer} outside 0..{self.num_dsa_layers - 1}")

    def latent_page_offset(self, subblock: int, layer: int) -> int:
        """Offset inside a row of the latent page of (sub-block, DSA layer index 0-based)."""
        self._check_page(subblock, layer)
        return subblock * self.subblock_bytes + layer * self.layer_stride

    def index_page_offset(self, subblock: int, layer: int) -> int:
        """Offset inside a row of the index-key page of (sub-block, DSA layer index 0-based)."""
        return self.latent_page_offset(subblock, layer) + self.latent_page_bytes

    def page_offsets(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """[sub-block][layer] -> (latent page offset, index page offset)."""
        return tuple(
            tuple((self.latent_page_offset(j, l), self.index_page_offset(j, l)) for l in range(self.num_dsa_layers))
            for j in range(self.subblocks_per_row)
        )

    def token_range(self, first_token: int, num_tokens: int) -> tuple[int, int]:
        """(offset, length) of row-local tokens [first, first+n); both must be whole sub-blocks."""
        b0 = self.subblock_tokens
        if first_token % b0 or num_tokens % b0 or num_tokens <= 0:
            raise ValueError(f"token range ({first_token}, {num_tokens}) is not whole sub-blocks of {b0}")
        return self.subblock_range(first_token // b0, num_tokens // b0)

    def subblock_range(self, first: int, count: int) -> tuple[int, int]:
        """(offset, length) of sub-blocks [first, first+count) of a row: always one contiguous range."""
        if count <= 0 or first < 0 or first + count > self.subblocks_per_row:
            raise IndexError(f"sub-blocks [{first}, {first + count}) outside a row of {self.subblocks_per_row}")
        return first * self.subblock_bytes, count * self.subblock_bytes

    # DCP ownership --------------------------------------------------------------------------------
    def dcp_owner(self, token: int) -> int:
        """DCP rank that stores request token `token`."""
        return (token // self.dcp_interleave) % self.dcp_size

    def dcp_local_token(self, token: int) -> int:
        """Position of `token` among its owner's tokens (row = local // tokens_per_row)."""
        u, w = self.dcp_interleave, self.dcp_size
        return (token // (u * w)) * u + token % u

    # KDA rows -------------------------------------------------------------------------------------
    def kda_head_offset(self, head: int) -> int:
        """Offset of local head `head` (0..heads_per_gpu-1) inside a KDA row."""
        if not 0 <= head < self.kda_heads_per_gpu:
            raise IndexError(f"KDA head {head} outside 0..{self.kda_heads_per_gpu - 1}")
        return head * self.kda_head_bytes

    def kda_recurrent_offset(self, head: int, layer_in_group: int) -> int:
        if not 0 <= layer_in_group < self.kda_layers_per_group:
            raise IndexError(f"KDA layer {layer_in_group} outside 0..{self.kda_layers_per_group - 1}")
        return self.kda_head_offset(head) + layer_in_group * (self.kda_recurrent_bytes + self.kda_conv_bytes)

    def kda_conv_offset(self, head: int, layer_in_group: int) -> int:
        return self.kda_recurrent_offset(head, layer_in_group) + self.kda_recurrent_bytes

    def kda_head_slice(self, first: int, count: int) -> tuple[int, int]:
        """(offset, length) of local heads [first, first+count): one contiguous range."""
        if count <= 0 or first < 0 or first + count > self.kda_heads_per_gpu:
            raise IndexError(f"KDA heads [{first}, {first + count}) outside 0..{self.kda_heads_per_gpu}")
        return first * self.kda_head_bytes, count * self.kda_head_bytes

    def global_heads(self, tp_rank: int) -> tuple[int, int]:
        """Global KDA heads [start, end) that TP rank `tp_rank` owns."""
        n = self.kda_heads_per_gpu
        return tp_rank * n, (tp_rank + 1) * n

    def to_dict(self) -> dict:
        return asdict(self)


def layout_fingerprint(fields: dict) -> str:
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _fingerprint_fields(cfg: ModelConfig, latent_format: str, index_key_format: str, b0: int) -> dict:
    return {
        "version": LAYOUT_VERSION,
        "num_dsa_layers": cfg.num_mla_layers,
        "latent_format": latent_format,
        "latent_bytes": latent_bytes_per_token(cfg, latent_format),
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_rope_dim": cfg.qk_rope_dim,
        "index_key_format": index_key_format,
        "index_bytes": index_key_bytes_per_token(cfg, index_key_format),
        "index_head_dim": cfg.index_head_dim,
        "subblock_tokens": b0,
        "kda_layers": list(cfg.kda_layers),
        "kda_groups": cfg.kda_state_groups,
        "kda_num_heads": cfg.kda_num_heads,
        "kda_head_dim": cfg.kda_head_dim,
        "kda_conv_size": cfg.kda_conv_size,
        "ssm_state_bytes": cfg.ssm_state_bytes,
        "conv_state_bytes": cfg.conv_state_bytes,
        "kda_row_order": "head,layer,[recurrent dk*dv][conv 3*d*(K-1)]",
        "attn_row_order": "subblock,layer,[latent page][index page]",
    }


DESCRIPTOR_TARGET_BYTES = 256 * 1024
"""DCP ownership units of at least this many bytes run near the one-descriptor ceiling (research notes)."""


def default_dcp_interleave(subblock_tokens: int, attn_bytes_per_token: int, tokens_per_row: int) -> int:
    """Smallest power-of-two multiple of the sub-block whose bytes reach DESCRIPTOR_TARGET_BYTES, capped at
    a row's tokens. Pro (b0=64, 1.09 MB sub-block): 64. Mini (296 B/token): 1024 capped to the row."""
    u = subblock_tokens
    while u * attn_bytes_per_token < DESCRIPTOR_TARGET_BYTES and u < tokens_per_row:
        u *= 2
    return min(u, tokens_per_row)


def plan_layout(
    cfg: ModelConfig,
    tp_size: int = 1,
    dcp_size: int = 1,
    latent_format: str | None = None,
    index_key_format: str | None = None,
    subblock_tokens: int = 64,
    block_size: int | None = None,
    dcp_interleave: int | None = None,
) -> RowLayout:
    """Plan the row layout of one instance (see the module docstring)."""
    lf = latent_format or cfg.latent_dtype
    kf = index_key_format or cfg.index_key_dtype
    lat, idx = latent_bytes_per_token(cfg, lf), index_key_bytes_per_token(cfg, kf)
    if tp_size < 1 or cfg.kda_num_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide the {cfg.kda_num_heads} KDA heads")
    if dcp_size < 1 or tp_size % dcp_size or not _is_pow2(dcp_size):
        raise ValueError(f"dcp_size {dcp_size} must be a power of two dividing tp_size {tp_size}")
    if not _is_pow2(subblock_tokens):
        raise ValueError(f"subblock_tokens {subblock_tokens} must be a power of two")
    layers = cfg.num_mla_layers
    a = layers * (lat + idx)
    groups = cfg.kda_state_groups
    per_group = cfg.num_kda_layers // groups
    heads = cfg.kda_num_heads // tp_size
    rec, conv = kda_head_layer_bytes(cfg)
    head_bytes = per_group * (rec + conv)
    s = heads * head_bytes
    min_row_tokens = max(subblock_tokens, _next_pow2(-(-s // a)))
    unit = subblock_tokens if dcp_interleave is None else dcp_interleave
    if not _is_pow2(unit) or unit % subblock_tokens:
        raise ValueError(f"dcp_interleave {unit} must be a power-of-two multiple of the sub-block {subblock_tokens}")
    min_block = dcp_size * max(min_row_tokens, unit)
    if block_size is None:
        block_size = min_block
    elif not _is_pow2(block_size) or block_size < min_block:
        raise ValueError(f"block_size {block_size} must be a power of two >= {min_block} for this instance")
    tokens_per_row = block_size // dcp_size
    if dcp_interleave is None:
        unit = default_dcp_interleave(subblock_tokens, a, tokens_per_row) if dcp_size > 1 else tokens_per_row
    return RowLayout(
        model=cfg.name,
        tp_size=tp_size,
        dcp_size=dcp_size,
        latent_format=lf,
        index_key_format=kf,
        num_dsa_layers=layers,
        latent_bytes=lat,
        index_bytes=idx,
        attn_bytes_per_token=a,
        kda_groups=groups,
        kda_layers_per_group=per_group,
        kda_heads_total=cfg.kda_num_heads,
        kda_heads_per_gpu=heads,
        kda_recurrent_bytes=rec,
        kda_conv_bytes=conv,
        kda_head_bytes=head_bytes,
        kda_state_bytes=s,
        block_size=block_size,
        tokens_per_row=tokens_per_row,
        row_bytes=tokens_per_row * a,
        subblock_tokens=subblock_tokens,
        subblock_bytes=subblock_tokens * a,
        subblocks_per_row=tokens_per_row // subblock_tokens,
        dcp_interleave=unit,
        latent_page_bytes=subblock_tokens * lat,
        index_page_bytes=subblock_tokens * idx,
        layer_stride=subblock_tokens * (lat + idx),
        fingerprint=layout_fingerprint(_fingerprint_fields(cfg, lf, kf, subblock_tokens)),
    )
