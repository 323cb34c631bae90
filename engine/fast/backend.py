"""The engine's kernel choice: `reference` (engine/model/, fp32, plain PyTorch) or `fast` (engine/fast/, Triton).

Default (`None` / `"auto"`): `fast` on CUDA, `reference` elsewhere. `fast` on a CPU device is refused unless the
Triton interpreter is on (`TRITON_INTERPRET=1`, how the CPU tests run the kernels); the interpreter flag is read
here and nowhere else in the package.
"""

from __future__ import annotations

import os

import torch

KERNELS = ("reference", "fast")


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_kernels(choice: str | None, device: torch.device | str) -> str:
    """The kernel set an engine on `device` runs: `choice`, or the device's default when None/"auto"."""
    device = torch.device(device)
    if choice in (None, "auto"):
        return "fast" if device.type == "cuda" else "reference"
    if choice not in KERNELS:
        raise ValueError(f"unknown kernels {choice!r}; choose one of: {', '.join(KERNELS)}")
    if choice == "fast" and device.type != "cuda" and not interpreter_active():
        raise ValueError(f"kernels='fast' needs a CUDA device (this engine runs on {device.type}); use "
                         "kernels='reference' on CPU (tests run the fast kernels with TRITON_INTERPRET=1)")
    if choice == "fast":
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise ValueError("kernels='fast' needs the triton package") from exc
    return choice
