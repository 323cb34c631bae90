"""Launch settings of the fast kernels (engine/fast/): the Triton interpreter flag and per-kernel tuning.

Which kernel set an engine runs (`reference` or `fast`, and `auto`) is decided by the kernel registry,
engine/kernels.py; `interpreter_active` is its (the one read of TRITON_INTERPRET), re-exported here for the
kernels, which pass it to their launches.
"""

from __future__ import annotations

from engine.kernels import interpreter_active

__all__ = ["interpreter_active", "launch_tuning"]


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
