"""Static router configuration from YAML: pools, instances, discovery, and a `router:` settings section.

    pools:
      - {name: tp, kind: tp, max_context_tokens: 131072}
      - {name: dcp, kind: dcp, max_context_tokens: 1048576}
    instances:
      - {name: p0, role: prefill, url: "http://10.0.0.1:8000", tp: 4, engine: vllm}
      - {name: d0, role: decode, url: "http://10.0.0.2:8000", pool: tp, tp: 8, block_size: 16}
    kubernetes: {namespace: serving, label_selector: "app.kubernetes.io/part-of=pdcluster"}
    router: {admin_token: "...", prefill_timeout_s: 10}

Instance fields left out (tp, block size, ...) are read from the node itself (/metrics, /v1/models).
A pool a decode instance names but the file does not declare is created as a TP pool whose capacity is
the smallest `max_model_len` its instances report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

Role = Literal["prefill", "decode"]
Engine = Literal["vllm", "reference"]


class InstanceSpec(BaseModel):
    """One node as configured or discovered; None means 'ask the node'."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    role: Role
    url: str
    pool: str = "default"
    engine: Engine | None = None
    tp: int | None = Field(default=None, ge=1)
    dcp: int | None = Field(default=None, ge=1)
    block_size: int | None = Field(default=None, ge=1)
    model: str | None = None
    ready: bool = True
    """Discovery's readiness (pod Ready); static instances are always eligible for health checks."""

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"instance url must start with http:// or https://, got {value!r}")
        return value.rstrip("/")


class PoolSpec(BaseModel):
    """A decode pool: TP pools serve short sessions, DCP pools long ones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    kind: Literal["tp", "dcp"] = "tp"
    max_context_tokens: int | None = Field(default=None, ge=1)
    """Session context the pool can hold; None: the smallest max_model_len its instances report."""


class KubeSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str
    label_selector: str = "app.kubernetes.io/part-of=pdcluster"


class RouterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    pools: list[PoolSpec] = Field(default_factory=list)
    instances: list[InstanceSpec] = Field(default_factory=list)
    kubernetes: KubeSpec | None = None
    router: dict[str, Any] = Field(default_factory=dict)

    @field_validator("instances")
    @classmethod
    def _unique_names(cls, value: list[InstanceSpec]) -> list[InstanceSpec]:
        names = [spec.name for spec in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate instance names: {dupes}")
        return value


def load_config(path: str | Path) -> RouterConfig:
    """Parse and validate a YAML config file."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return RouterConfig.model_validate(data)


def quick_start_config(prefill_urls: list[str], decode_urls: list[str], engine: Engine | None) -> RouterConfig:
    """One pool named 'default' with the given instances (`--prefill URL... --decode URL...`)."""
    instances = [InstanceSpec(name=f"prefill-{i}", role="prefill", url=url, engine=engine)
                 for i, url in enumerate(prefill_urls)]
    instances += [InstanceSpec(name=f"decode-{i}", role="decode", url=url, engine=engine)
                  for i, url in enumerate(decode_urls)]
    return RouterConfig(pools=[PoolSpec(name="default", kind="tp")], instances=instances)
