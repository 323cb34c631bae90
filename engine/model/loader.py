"""Load a checkpoint directory's safetensors weights into a built KimiModel, as a server must.

- One plan first (`plan_load`): every engine parameter is filled by `Piece`s, each naming its checkpoint tensor(s)
  and the slice of the parameter it fills (the dialect's name map, engine/model/names.py). Before one byte of
  tensor data is read, the plan must cover every parameter exactly and use every tensor of the files: a missing,
  extra or wrongly shaped tensor is refused by name. DeepSeek's multi-token-prediction layers (index >=
  num_hidden_layers, `num_nextn_predict_layers`) are skipped with one log line.
- Then the bytes, tensor by tensor, in file order. A tensor stored exactly as a CPU parameter wants it (same
  dtype, the whole parameter) becomes that parameter's storage: a read-only, pre-populated memory mapping of its
  bytes (`zero_copy`: the page cache's own pages, shared by every rank of the node; nothing is copied). Such a
  parameter is read-only memory: the engine never writes a weight in place (the expert-parallel wrapper and the
  fast kernels make their own copies), and code that wants to must clone it first. Any other tensor is viewed in place in a mapping of its file (`torch.frombuffer`, no
  copy), converted straight into its slice of the parameter (on the parameter's device and dtype), and its pages
  are released (`madvise(MADV_DONTNEED)`); a whole tensor (any dtype but FP8) is instead read with `preadv` straight
  into its parameter, or through one 64 MB bounce buffer when it changes dtype or device. Resident memory stays close to the parameters' own bytes: no second
  full copy, no state dict.
- FP8 block-scaled weights (`weight` in float8_e4m3fn + `weight_scale_inv` [ceil(out/b0), ceil(in/b1)], with
  `quantization_config = {"quant_method": "fp8", "weight_block_size": [b0, b1]}`) are dequantized on the way in.
Every rank of a node runs this on the same files (the page cache serves the second reader).
"""

from __future__ import annotations

import logging
import mmap
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.model.checkpoint import CheckpointError, read_header, weight_files
from engine.model.model import KimiModel
from engine.model.shards import TensorSplit

log = logging.getLogger(__name__)

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
          "F64": torch.float64}


@dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor's bytes live."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


@dataclass(frozen=True)
class Piece:
    """Fills `param[index]` (index None: the whole parameter) from checkpoint tensors `sources`, combined by
    `combine` (None: the one source, reshaped to the slice's shape when only unit dims differ)."""

    param: str
    sources: tuple[str, ...]
    index: tuple | None = None
    combine: Callable[..., torch.Tensor] | None = None


def scan(directory: str | Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint's weight files, by name (a name in two files is refused)."""
    entries: dict[str, TensorEntry] = {}
    for path in weight_files(directory):
        header, data_start, _ = read_header(path)
        for name, info in header.items():
            dtype = DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}; supported: "
                                      f"{', '.join(DTYPES)}")
            if name in entries:
                raise CheckpointError(f"{path}: tensor {name} is also in {entries[name].path.name}")
            begin, end = info["data_offsets"]
            entries[name] = TensorEntry(name, path, dtype, tuple(info["shape"]), data_start + begin,
                                        data_start + end)
    return entries


def check_plan(model: KimiModel, pieces: list[Piece], entries: dict[str, TensorEntry],
               skipped: set[str]) -> None:
    """Refuse before reading: a parameter no piece fills, a tensor no piece reads, a missing source, a shape."""
    params = _full_params(model)
    filled = {p.param for p in pieces}
    unfilled = sorted(set(params) - filled)
    if unfilled:
        raise CheckpointError(f"no checkpoint tensor fills engine parameters {unfilled[:8]}")
    wanted = {s for p in pieces for s in p.sources}
    missing = sorted(wanted - set(entries))
    if missing:
        raise CheckpointError(f"checkpoint is missing tensors {missing[:8]}" + (" ..." if len(missing) > 8 else ""))
    scale_names = {n for n in entries if n.endswith(".weight_scale_inv")}
    extra = sorted(set(entries) - wanted - skipped - scale_names)
    if extra:
        raise CheckpointError(f"checkpoint has tensors the model does not use: {extra[:8]}"
                              + (" ..." if len(extra) > 8 else ""))
    orphan = sorted(n for n in scale_names if n[: -len("_scale_inv")] not in wanted and n not in skipped)
    if orphan:
        raise CheckpointError(f"checkpoint has scales of no weight: {orphan[:8]}")
    for piece in pieces:
        if piece.combine is not None:
            continue
        target = params[piece.param] if piece.index is None else params[piece.param][piece.index]
        entry = entries[piece.sources[0]]
        if _squeeze(entry.shape) != _squeeze(tuple(target.shape)):
            raise CheckpointError(f"tensor {entry.name} has shape {list(entry.shape)}, the engine's "
                                  f"{piece.param} needs {list(target.shape)}")


def _full_params(model: KimiModel) -> dict[str, torch.Tensor]:
    """Every parameter as the whole model has it: the rank's own where it holds all of it, else a stride-0 view of
    one zero with the full shape (no memory; what the plan's shapes are checked against)."""
    out = {}
    for name, p in model.named_parameters():
        split = model.splits[name]
        out[name] = torch.zeros(1).expand(*split.full_shape) if split.is_sharded else p
    return out


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


READ_CHUNK_BYTES = 64 << 20
"""Bytes per read of `_Reader.read_into` (and the size of its one bounce buffer)."""


class _Reader:
    """Memory-mapped views of checkpoint tensors; `release` drops a tensor's pages from this process;
    `read_into` reads a tensor's bytes straight into its parameter."""

    def __init__(self, entries: dict[str, TensorEntry], block_size: tuple[int, int] | None) -> None:
        self.entries = entries
        self.block_size = block_size
        self.maps: dict[Path, mmap.mmap] = {}
        self.files: list = []
        self.fds: dict[Path, int] = {}
        self.bounce: torch.Tensor | None = None

    def read_into(self, name: str, target: torch.Tensor) -> bool:
        """Fill `target` (contiguous, as many elements as the tensor) with the tensor's values by reading the file
        in READ_CHUNK_BYTES pieces: straight into a CPU parameter of the same dtype (one copy, from the page
        cache), else through one reused bounce buffer and a converting copy (another dtype or device). No page
        of a mapping is faulted in. False (nothing done) where this does not apply: FP8 (dequantized through
        `view`), a non-contiguous target, an element count that differs."""
        e = self.entries[name]
        size = torch.empty(0, dtype=e.dtype).element_size()
        count = (e.end - e.start) // size
        if e.dtype == torch.float8_e4m3fn or count == 0 or not target.is_contiguous() or target.numel() != count:
            return False
        flat = target.view(-1)
        direct = target.device.type == "cpu" and target.dtype == e.dtype
        per = max(1, READ_CHUNK_BYTES // size)
        fd = self._fd(e.path)
        done = 0
        while done < count:
            n = min(per, count - done)
            dst = flat[done:done + n] if direct else self._bounce(n * size)[: n * size].view(e.dtype)
            self._pread(fd, dst.view(torch.uint8).numpy(), e.start + done * size, name)
            if not direct:
                flat[done:done + n].copy_(dst)
            done += n
        return True

    def _fd(self, path: Path) -> int:
        if path not in self.fds:
            self.fds[path] = os.open(path, os.O_RDONLY)
        return self.fds[path]

    def _bounce(self, nbytes: int) -> torch.Tensor:
        if self.bounce is None or self.bounce.numel() < nbytes:
            self.bounce = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return self.bounce

    @staticmethod
    def _pread(fd: int, out, offset: int, name: str) -> None:  # noqa: ANN001 - a uint8 numpy view
        view, got = memoryview(out), 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise CheckpointError(f"tensor {name}: the file ended {len(view) - got} bytes early")
            got += n

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self.maps:
            fh = open(path, "rb")
            self.files.append(fh)
            self.maps[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        return self.maps[path]

    def view(self, name: str) -> torch.Tensor:
        """The tensor as stored (a view of the mapping; FP8 block-scaled weights dequantized to fp32)."""
        e = self.entries[name]
        count = (e.end - e.start) // torch.empty(0, dtype=e.dtype).element_size()
        raw = torch.frombuffer(self._map(e.path), dtype=e.dtype, count=count, offset=e.start) if count else \
            torch.empty(0, dtype=e.dtype)
        raw = raw.view(e.shape)
        if e.dtype == torch.float8_e4m3fn:
            return self._dequantize(name, raw)
        return raw

    def view_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the tensor's dim 0 as stored (FP8: only those rows dequantized, with their scales)."""
        e = self.entries[name]
        if e.dtype != torch.float8_e4m3fn:
            return self.view(name)[lo:hi]
        count = (e.end - e.start)
        raw = torch.frombuffer(self._map(e.path), dtype=e.dtype, count=count, offset=e.start).view(e.shape)
        return self._dequantize(name, raw, lo, hi)

    def _dequantize(self, name: str, raw: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        scale_name = name[: -len("weight")] + "weight_scale_inv" if name.endswith("weight") else None
        if scale_name is None or scale_name not in self.entries:
            raise CheckpointError(f"tensor {name} is float8_e4m3fn without a weight_scale_inv")
        if self.block_size is None:
            raise CheckpointError(f"tensor {name} is FP8 but config.json has no fp8 quantization_config")
        scale = self.view(scale_name).float()
        b0, b1 = self.block_size
        rows, cols = raw.shape
        want = (-(-rows // b0), -(-cols // b1))
        if tuple(scale.shape) != want:
            raise CheckpointError(f"tensor {scale_name} has shape {list(scale.shape)}, blocks of {b0}x{b1} over "
                                  f"{name} {list(raw.shape)} need {list(want)}")
        hi = rows if hi is None else hi
        first = lo // b0  # only the scale rows of rows [lo, hi)
        full = scale[first:-(-hi // b0)].repeat_interleave(b0, 0)[lo - first * b0:hi - first * b0]
        full = full.repeat_interleave(b1, 1)[:, :cols]
        self.release(scale_name)
        return raw[lo:hi].float() * full

    def mapped(self, name: str, shape: torch.Size) -> torch.Tensor | None:
        """The tensor as a private, populated mapping of its own bytes (None when its offset is not aligned to
        its element size)."""
        e = self.entries[name]
        size = torch.empty(0, dtype=e.dtype).element_size()
        if e.end <= e.start or e.start % size:
            return None
        page = mmap.ALLOCATIONGRANULARITY
        lo = e.start // page * page
        with open(e.path, "rb") as fh:  # a writable private mapping would be populated by copying every page
            mm = mmap.mmap(fh.fileno(), e.end - lo, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE, prot=mmap.PROT_READ,
                           offset=lo)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            view = torch.frombuffer(mm, dtype=e.dtype, count=(e.end - e.start) // size, offset=e.start - lo)
        return view.view(shape)

    def release(self, name: str) -> None:
        e = self.entries[name]
        mm = self.maps.get(e.path)
        if mm is None or e.end <= e.start:
            return
        page = mmap.PAGESIZE
        lo = e.start // page * page
        mm.madvise(mmap.MADV_DONTNEED, lo, e.end - lo)

    def close(self) -> None:
        for mm in self.maps.values():
            mm.close()
        for fh in self.files:
            fh.close()
        for fd in self.fds.values():
            os.close(fd)


def _can_share(piece: Piece, target: torch.Tensor, entries: dict[str, TensorEntry]) -> bool:
    entry = entries[piece.sources[0]]
    return (piece.index is None and piece.combine is None and target.device.type == "cpu"
            and entry.dtype == target.dtype and entry.shape == tuple(target.shape))


def fp8_block_size(quantization: dict | None) -> tuple[int, int] | None:
    """The weight block size of a DeepSeek-style fp8 quantization_config; anything else is refused."""
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"config.json quantization_config.quant_method {method!r} is not supported "
                              "(supported: 'fp8' with weight_block_size)")
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"quantization_config.fmt {quantization.get('fmt')!r} is not supported (e4m3 only)")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"quantization_config.weight_block_size {block!r}: expected two positive integers")
    return block[0], block[1]


def load_pieces(model: KimiModel, pieces: list[Piece], entries: dict[str, TensorEntry], skipped: set[str],
                block_size: tuple[int, int] | None, zero_copy: bool = True) -> None:
    """Check the plan, then fill every parameter, tensor by tensor in file order (module docstring; `zero_copy`
    False copies every tensor). A rank's shard (`model.splits`) reads only its rows of each sharded tensor
    (`_load_rows`): the tensors of other ranks' experts are not read at all."""
    check_plan(model, pieces, entries, skipped)
    if skipped:
        log.info("checkpoint: skipping %d tensors of multi-token-prediction layers", len(skipped))
    params = dict(model.named_parameters())
    order = sorted(pieces, key=lambda p: (str(entries[p.sources[0]].path), entries[p.sources[0]].start))
    reader = _Reader(entries, block_size)
    try:
        with torch.no_grad():
            for piece in order:
                if model.splits[piece.param].is_sharded:
                    _load_rows(reader, piece, params[piece.param], model.splits[piece.param])
                    continue
                target = params[piece.param] if piece.index is None else params[piece.param][piece.index]
                if zero_copy and _can_share(piece, target, entries):
                    shared = reader.mapped(piece.sources[0], target.shape)
                    if shared is not None:
                        params[piece.param].data = shared
                        continue
                if piece.combine is None and reader.read_into(piece.sources[0], target):
                    continue
                views = [reader.view(s) for s in piece.sources]
                value = piece.combine(*views) if piece.combine is not None else views[0].reshape(target.shape)
                if tuple(value.shape) != tuple(target.shape):
                    raise CheckpointError(f"{piece.sources} make shape {list(value.shape)}, the engine's "
                                          f"{piece.param} needs {list(target.shape)}")
                target.copy_(value)
                del views, value
                for s in piece.sources:
                    reader.release(s)
    finally:
        reader.close()


def _piece_rows(piece: Piece, full_rows: int) -> tuple[int, int, bool]:
    """The full parameter's dim-0 rows [lo, hi) a piece fills, and whether its source is one row of it (an
    integer index: one expert) rather than rows matching the source's dim 0."""
    if piece.index is None:
        return 0, full_rows, False
    first = piece.index[0]
    if isinstance(first, int):
        return first, first + 1, True
    lo, hi, step = first.indices(full_rows)
    assert step == 1 and len(piece.index) == 1, f"{piece.param}: pieces of a sharded tensor slice dim 0 only"
    return lo, hi, False


def _load_rows(reader: _Reader, piece: Piece, param: torch.Tensor, split: TensorSplit) -> None:
    """Fill this rank's rows of a sharded parameter from one piece: for every run of the rank's rows that the
    piece covers, only those rows of the source are read (a combined piece: rows of its first source, which its
    `combine` maps row by row, as `names._fold` does)."""
    lo, hi, is_one_row = _piece_rows(piece, split.full_shape[0])
    at = 0
    for run_lo, run_hi in split.rows:
        a, b = max(lo, run_lo), min(hi, run_hi)
        if a < b:
            dst = param[at + a - run_lo: at + b - run_lo]
            if is_one_row:
                value = reader.view(piece.sources[0]).reshape(dst.shape)
            else:
                first = reader.view_rows(piece.sources[0], a - lo, b - lo)
                rest = [reader.view(s) for s in piece.sources[1:]]
                value = piece.combine(first, *rest) if piece.combine is not None else first
                value = value.reshape(dst.shape)
            dst.copy_(value)
            del value
        at += run_hi - run_lo
    for s in piece.sources:
        reader.release(s)
