"""Decode step time on one GPU, fast path vs reference path, against the HBM roofline (used by
`benchmarks/engine.py --device cuda`).

Per (config, context C, batch B) cell, for each kernel set asked for:
- fast: `engine.fast.FastDecoder` on a packed row pool in GPU memory (plan_layout of the config, B requests of
  C cached tokens: random FP8 latents/keys with valid index scales, zero KDA states); the eager step time
  includes building the step's page table on the host; median of --steps timed steps after 2 warm-ups.
- reference: `KimiModel.decode` (fp32, exact fp64 indexer) over per-request `LocalSequenceCache`s on the GPU
  (as benchmarks/decode.py), median of --ref-steps after 1 warm-up.
- fast+graph: the fast step replayed as one CUDA graph (engine/fast/graphs.py) sized for the cell. Each request's
  rows are allocated up front, so its page table is loaded once (`GraphedDecode.set_pages`, as a running batch
  between two block allocations) and a step moves the token ids and positions from the host and replays
  (`GraphedDecode.step`); the step time includes those copies.
- fast+compile+graph: the same with `FastDecoder(compile=True)` (the torch segments between the Triton kernels
  through torch.compile), graphed. The log also gives each graph's replay alone (inputs already in place).
The bytes a step must read and the FLOPs it must do come from the config (`step_bytes`, `step_flops` below:
bf16 weights, expected distinct experts touched, every cached index key (FP8 + fp32 scale), top-k latents, KDA
state read and written); roofline fractions divide by the copy bandwidth ((read + write) / time of a 4 GiB
device copy) and the bf16 matmul rate (8192^3 GEMM) measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from engine.fast.decoder import FastDecoder
from engine.fast.graphs import GraphedDecode
from engine.fast.pages import build_page_batch, token_byte_offsets
from engine.layout import RowLayout, plan_layout
from engine.model.config import ModelConfig
from engine.model.numerics import device_scope
from engine.model.state import LocalSequenceCache

BF16_BYTES = 2


@dataclass(frozen=True)
class Cell:
    model: str
    context: int
    batch: int
    kernels: str
    step_ms: float
    bytes_per_step: float
    flops_per_step: float

    def hbm_fraction(self, copy_gbps: float) -> float:
        return self.bytes_per_step / (self.step_ms * 1e-3) / (copy_gbps * 1e9)

    def matmul_fraction(self, tflops: float) -> float:
        return self.flops_per_step / (self.step_ms * 1e-3) / (tflops * 1e12)


def _weight_params(cfg: ModelConfig, model) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(parameters read by every step except the routed experts and the embedding table, params of one expert)."""
    shared = 0
    for name, p in model.named_parameters():
        if p.dim() >= 2 and name != "embed" and not name.endswith((".w1", ".w2", ".w3")):
            shared += p.numel()
    return shared, 3 * cfg.moe_latent_dim * cfg.moe_intermediate


def _moe_layers(cfg: ModelConfig) -> int:
    return cfg.num_layers - cfg.first_dense_layers


def step_bytes(cfg: ModelConfig, layout: RowLayout, model, batch: int, context: int) -> float:  # type: ignore[no-untyped-def]
    shared, expert = _weight_params(cfg, model)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch)  # expected distinct experts per MoE layer
    weights = BF16_BYTES * (shared + _moe_layers(cfg) * touched * expert + batch * cfg.d_model)
    keys = context + 1
    attn = cfg.num_mla_layers * batch * (keys * layout.index_bytes + min(cfg.index_topk, keys) * layout.latent_bytes)
    kda = cfg.num_kda_layers * batch * 2 * layout.kda_heads_per_gpu * (layout.kda_recurrent_bytes
                                                                       + layout.kda_conv_bytes)
    return float(weights + attn + kda)


def step_flops(cfg: ModelConfig, model, batch: int, context: int) -> float:  # type: ignore[no-untyped-def]
    shared, expert = _weight_params(cfg, model)
    gemm = 2 * batch * (shared + _moe_layers(cfg) * cfg.num_experts_per_tok * expert)
    keys = context + 1
    index = 2 * batch * cfg.index_num_heads * cfg.index_head_dim * keys
    sel = min(cfg.index_topk, keys)
    mla = 2 * batch * cfg.num_heads * sel * (cfg.latent_dim + cfg.kv_lora_rank)
    kda = 8 * batch * cfg.kda_num_heads * cfg.kda_head_dim ** 2
    return float(gemm + cfg.num_mla_layers * (index + mla) + cfg.num_kda_layers * kda)


def copy_bandwidth_gbps(device: torch.device, gib: int = 4) -> float:
    src = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() / min(times) / 1e9


def matmul_tflops(device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize(device)
    return 10 * 2 * n**3 / (time.perf_counter() - start) / 1e12


def fast_pool(cfg: ModelConfig, layout: RowLayout, batch: int, capacity: int, device: torch.device):  # type: ignore[no-untyped-def]
    """A GPU pool of `batch` requests of `capacity` tokens: random FP8 bytes (no NaN patterns), index scales
    0.01, KDA rows zero. Returns (buffer, attention rows per request, KDA rows per request)."""
    num_attn, num_kda = layout.rows_per_request(capacity)
    buffer = torch.empty(batch * (num_attn + num_kda), layout.row_bytes, dtype=torch.uint8, device=device)
    buffer.random_(0, 256).bitwise_and_(0xF7)  # exponent never all ones: no e4m3 NaN
    attn = [list(range(b * num_attn, (b + 1) * num_attn)) for b in range(batch)]
    kda0 = batch * num_attn
    kda = [list(range(kda0 + b * num_kda, kda0 + (b + 1) * num_kda)) for b in range(batch)]
    buffer[kda0:] = 0
    pages = build_page_batch(layout, attn, kda, [capacity - 1] * batch, device)
    tokens = torch.arange(capacity, device=device).expand(batch, capacity)
    f32 = buffer.view(-1).view(torch.float32)
    for layer in range(cfg.num_mla_layers):
        off = token_byte_offsets(layout, pages, layer, tokens, index=True) + cfg.index_head_dim
        f32[(off // 4).reshape(-1)] = 0.01
    return buffer, attn, kda


FAST_RUNS = ("fast", "fast+graph", "fast+compile+graph")


class GraphedStepBench:
    """The graphed step of `decoder` for `batch` requests at `context` cached tokens on one `fast_pool`, for the
    scripts that capture it again and again (benchmarks/gemv_sweep.py, profile_step.py): `capture()` makes a
    GraphedDecode with the launch parameters and module constants in effect now (table loaded once, three
    warm-up steps); `replay_ms(runner, n)` is the median of n replays alone (inputs in place)."""

    def __init__(self, decoder: FastDecoder, cfg: ModelConfig, batch: int, context: int,
                 device: torch.device) -> None:
        self.decoder, self.cfg, self.batch, self.context, self.device = decoder, cfg, batch, context, device
        layout = decoder.layout
        self.capacity = context + 64
        self.buffer, self.attn, self.kda = fast_pool(cfg, layout, batch, self.capacity, device)
        self.num_pages = -(-self.capacity // layout.subblock_tokens)
        self.first = build_page_batch(layout, self.attn, self.kda, [context] * batch, device)

    def capture(self) -> GraphedDecode:
        layout, batch, device = self.decoder.layout, self.batch, self.device
        runner = GraphedDecode(self.decoder, self.buffer, batch, self.num_pages, layout.kda_groups, self.first,
                               torch.zeros(batch, dtype=torch.int64, device=device))
        runner.set_pages(build_page_batch(layout, self.attn, self.kda, [self.capacity - 1] * batch, device))
        for _ in range(3):
            runner.step(torch.randint(0, self.cfg.vocab_size, (batch,), device=device),
                        torch.full((batch,), self.context + 1, dtype=torch.int32))
        return runner

    @staticmethod
    def replay_ms(runner: GraphedDecode, replays: int) -> float:
        times = []
        for _ in range(replays):
            torch.cuda.synchronize()
            start = time.perf_counter()
            runner.graph.replay()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3


def time_fast(cfg: ModelConfig, batch: int, context: int, steps: int, decoders: dict[str, FastDecoder],
              device: torch.device, log=print) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """ms per step of each fast run on one pool (benchmark data; the graphs are captured on its rows):
    `fast` eager with `decoders["eager"]`, `fast+graph` its CUDA graph, `fast+compile+graph` the graph of
    `decoders["compiled"]` (torch.compile segments), each where its decoder is given."""
    layout = next(iter(decoders.values())).layout
    capacity = context + 3 * (steps + 2) + 6
    buffer, attn, kda = fast_pool(cfg, layout, batch, capacity, device)
    num_pages = -(-capacity // layout.subblock_tokens)
    runs = [(name, decoders.get("compiled" if "compile" in name else "eager"), "graph" in name) for name in FAST_RUNS]
    result, position = {}, context
    for name, decoder, graphed in runs:
        if decoder is None:
            continue
        runner = None
        if graphed:
            first = build_page_batch(layout, attn, kda, [position] * batch, device)
            runner = GraphedDecode(decoder, buffer, batch, num_pages, layout.kda_groups, first,
                                   torch.zeros(batch, dtype=torch.int64, device=device))
            position += 1
        if runner is not None:  # the rows are allocated up front: the table is loaded once, as a running batch's
            runner.set_pages(build_page_batch(layout, attn, kda, [capacity - 1] * batch, device))
        times, replay = [], []
        for step in range(steps + 2):
            tokens = torch.randint(0, cfg.vocab_size, (batch,), device=device)
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            if runner is None:
                logits = decoder.decode(buffer, tokens, build_page_batch(layout, attn, kda, [position] * batch, device))
            else:
                logits = runner.step(tokens, torch.full((batch,), position, dtype=torch.int32))
            torch.cuda.synchronize(device)
            if step >= 2:
                times.append(time.perf_counter() - start)
            position += 1
        if not bool(torch.isfinite(logits).all()):  # timed steps of a broken computation must not pass unnoticed
            log(f"  {name}: the last timed step's logits are not all finite")
        if runner is not None:  # the graph alone, inputs already in place
            for _ in range(steps):
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                runner.graph.replay()
                torch.cuda.synchronize(device)
                replay.append(time.perf_counter() - start)
            log(f"  {name}: replay alone {statistics.median(replay) * 1e3:.3f} ms")
        result[name] = statistics.median(times) * 1e3
        del runner
    del buffer
    return result


def time_reference(cfg: ModelConfig, model, batch: int, context: int, steps: int,  # type: ignore[no-untyped-def]
                   device: torch.device) -> float:
    times = []
    with device_scope(device), torch.no_grad():
        caches = [LocalSequenceCache(cfg, context + steps + 2) for _ in range(batch)]
        for cache in caches:
            cache.latent.random_(0, 256).bitwise_and_(0xF7)
            cache.index_key.random_(0, 256).bitwise_and_(0xF7)
            cache.index_scale.fill_(0.01)
        for step in range(steps + 1):
            tokens = torch.randint(0, cfg.vocab_size, (batch,), device=device)
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            model.decode(tokens, [context + step] * batch, caches)
            torch.cuda.synchronize(device)
            if step >= 1:
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_cells(cfg: ModelConfig, model, contexts: list[int], batches: list[int], kernels: list[str],  # type: ignore[no-untyped-def]
              steps: int, ref_steps: int, device: torch.device, log, compile_segments: bool = True) -> list[Cell]:
    layout = plan_layout(cfg)
    decoders = {}
    if "fast" in kernels:
        decoders["eager"] = FastDecoder(model, layout)
        if compile_segments:
            decoders["compiled"] = FastDecoder(model, layout, compile=True)
    cells = []
    for context in contexts:
        for batch in batches:
            nbytes, flops = step_bytes(cfg, layout, model, batch, context), step_flops(cfg, model, batch, context)
            for kind in kernels:
                if kind == "fast":
                    try:
                        timed = time_fast(cfg, batch, context, steps, decoders, device, log)
                    except RuntimeError as exc:  # a capture failure must not lose the other cells
                        log(f"fast cell failed: {exc!r}")
                        timed = {name: float("nan") for name in FAST_RUNS}
                else:
                    timed = {kind: time_reference(cfg, model, batch, context, ref_steps, device)}
                for name, ms in timed.items():
                    cells.append(Cell(cfg.name, context, batch, name, ms, nbytes, flops))
                    log(f"{cfg.name} ctx {context} batch {batch} {name}: {ms:.3f} ms")
                torch.cuda.empty_cache()
    return cells
