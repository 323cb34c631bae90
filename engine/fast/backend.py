"""The engine's kernel choice: `reference` (engine/model/, fp32, plain PyTorch) or `fast` (engine/fast/, Triton).

`auto` (or None) picks `fast` where the engine supports it (a CUDA device and an engine shape the fast set
covers: `fast_unsupported` says why not) and its model wants it by default (a single rank; the fast TP decode
runs only when asked for), else `reference`; so on CPU `auto` is always `reference`. An explicit
`fast` where it is not supported is refused with the reason (never a silent fallback). `fast` on a CPU device
runs only under the Triton interpreter (`TRITON_INTERPRET=1`, how the CPU tests run the kernels); the
interpreter flag is read here and nowhere else in the package.
"""

from __future__ import annotations

import os

import torch

KERNELS = ("reference", "fast")
CHOICES = ("auto", *KERNELS)


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch_tuning(env_name: str, defaults: dict[str, int], text: str) -> dict[str, int]:
    """A kernel's launch parameters: `defaults`, overridden by `text` (the value of the environment variable
    `env_name`, "name=int,name=int": what a sweep in benchmarks/gemv_sweep.py finds best on another GPU). An
    unknown name or a value that is not an integer is an error naming `env_name`."""
    tune = dict(defaults)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in tune or not value.strip().isdigit():
            raise ValueError(f"{env_name}: {item!r} is not one of {sorted(tune)}=<int>")
        tune[name] = int(value)
    return tune


def fast_unsupported(tp_size: int = 1, dcp_size: int = 1) -> str | None:
    """Why an engine of this parallel shape cannot run the fast set (None: it can). `tp_size` > 1 is the plain
    engine's (no SPMD model); a TP group runs the fast decode through engine/parallel/spmd.py `TPModel`."""
    if dcp_size > 1:
        return (f"the fast kernels need the DCP SPMD model for dcp_size={dcp_size} (engine/parallel/spmd.py "
                "DCPModel); a plain engine runs them single-rank only")
    if tp_size > 1:
        return (f"the fast kernels need the TP SPMD model for tp_size={tp_size} (engine/parallel/spmd.py "
                "TPModel); a plain engine runs them single-rank only")
    return None


def resolve_kernels(choice: str | None, device: torch.device | str, unsupported: str | None = None,
                    auto_fast: bool = True) -> str:
    """The kernel set an engine on `device` runs. `choice`: "reference", "fast", or None/"auto" (fast on CUDA
    where supported and `auto_fast`, else reference); `unsupported`: why this engine cannot run the fast set
    (None: it can). Raises ValueError naming the reason when `fast` is asked for where it cannot run."""
    device = torch.device(device)
    if choice in (None, "auto"):
        return "fast" if device.type == "cuda" and unsupported is None and auto_fast else "reference"
    if choice not in KERNELS:
        raise ValueError(f"unknown kernels {choice!r}; choose one of: {', '.join(CHOICES)}")
    if choice == "reference":
        return choice
    if device.type != "cuda" and not interpreter_active():
        raise ValueError(f"kernels='fast' needs a CUDA device (this engine runs on {device.type}); use "
                         "kernels='reference' or 'auto' on CPU (tests run the fast kernels with TRITON_INTERPRET=1)")
    if unsupported is not None:
        raise ValueError(f"kernels='fast' cannot run here: {unsupported}; use kernels='reference' or 'auto'")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise ValueError("kernels='fast' needs the triton package") from exc
    return choice
