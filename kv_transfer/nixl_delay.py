"""NIXL's agent config class with a progress-thread delay that sticks (the standard library only).

NIXL's Python API builds every agent's config with `pthrDelay = 0`, so its UCX progress thread polls in a busy
loop. `delayed_config_class(base, delay_us)` subclasses the bindings' `nixlAgentConfig` so that whatever the API
writes, `pthrDelay` holds `delay_us`. Two users: kv_transfer/ucx_env.py `progress_delay` (the reference nodes'
agents, while one is built) and cluster/vllm_site/sitecustomize.py (every agent of a vLLM process, which loads this
file by path: it runs in vLLM's virtualenv, where the project's packages are not importable).
"""

from __future__ import annotations

from typing import Any


def delayed_config_class(base: Any, delay_us: int) -> Any:
    """A subclass of NIXL's bindings' `nixlAgentConfig` (`base`) whose `pthrDelay` always reads back `delay_us`."""

    class _DelayedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's field name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, delay_us)

    return _DelayedConfig
