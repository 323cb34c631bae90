"""Loadgen settings: defaults for the CLI flags, overridable by LOADGEN_* environment variables."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every field can be set as LOADGEN_<NAME>; command-line flags win over both."""

    model_config = SettingsConfigDict(env_prefix="LOADGEN_", extra="ignore")

    url: str | None = None
    """Base URL of the OpenAI-compatible endpoint, without /v1 (e.g. http://127.0.0.1:8000)."""
    model: str | None = None
    """Model name sent in requests; None asks GET /v1/models and takes the first id."""
    api_key: str | None = None
    """Bearer token, if the endpoint wants one."""
    endpoint: str = "chat"
    """chat (/v1/chat/completions) or completions (/v1/completions)."""
    connect_timeout_s: float = 5.0
    """Seconds to open a connection."""
    request_timeout_s: float = 600.0
    """Seconds of silence on a stream before it counts as a timeout."""
    drain_s: float = 60.0
    """Seconds in-flight requests get after a level's duration before they are cancelled."""
    schedule_units: int = 64
    """How many sessions (or trace lines) the schedule hash covers."""
