"""Loaded by every interpreter of a vLLM instance that `pdcluster up` starts with this folder on PYTHONPATH
(cluster/plan.py: vLLM on CPU), before vLLM imports anything: it gives NIXL's UCX progress thread a wait between
progress passes, as kv_transfer/ucx_env.py `progress_delay` does for the reference nodes' agents.

NIXL's Python API builds every agent with `pthrDelay = 0`: its progress thread then polls the UCX workers in a busy
loop, a whole core per vLLM worker process even while the instance is idle (measured on the 2-core dev VM: an idle
vLLM P/D pair kept both cores busy). With a delay the thread sleeps in poll() on the workers' event fds between
passes and still wakes at once on traffic. `PDCLUSTER_NIXL_PROGRESS_DELAY_US` is the delay in microseconds; unset
or empty, nothing is changed. It runs in vLLM's own virtualenv, so it imports nothing of the project; the config
class itself is kv_transfer/nixl_delay.py's, loaded by path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

_BACKENDS = ("nixl_cu12", "nixl_cu13", "nixl_rocm")


DELAY_MODULE = Path(__file__).resolve().parents[2] / "kv_transfer" / "nixl_delay.py"
"""The project's config class with the delay, loaded by path (the standard library only; the project's packages
are not importable in vLLM's virtualenv)."""


def _with_delay(bindings, delay_us: int) -> None:  # type: ignore[no-untyped-def]
    """Replace the bindings' agent config class by one whose `pthrDelay` always reads back `delay_us`."""
    spec = importlib.util.spec_from_file_location("_pdcluster_nixl_delay", DELAY_MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bindings.nixlAgentConfig = module.delayed_config_class(bindings.nixlAgentConfig, delay_us)


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, delay_us: int) -> None:
        self.inner, self.delay_us = inner, delay_us

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:  # type: ignore[no-untyped-def]
        self.inner.exec_module(module)
        _with_delay(module, self.delay_us)


class _BindingsFinder(importlib.abc.MetaPathFinder):
    """Finds NIXL's `<backend>._bindings` as the path finder would and patches it once it is loaded."""

    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        package, _, name = fullname.rpartition(".")
        if name != "_bindings" or package not in _BACKENDS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, self.delay_us)
        return spec


def _install() -> None:
    raw = os.environ.get("PDCLUSTER_NIXL_PROGRESS_DELAY_US", "").strip()
    if not raw:
        return
    try:
        delay_us = int(raw)
    except ValueError:
        delay_us = -1
    if delay_us < 0:  # SystemExit: site.py reports an Exception here and goes on, which would hide the setting
        raise SystemExit(f"PDCLUSTER_NIXL_PROGRESS_DELAY_US must be an integer >= 0, got {raw!r}")
    sys.meta_path.insert(0, _BindingsFinder(delay_us))


_install()
