"""Workload scenarios: `agentx` (agent sessions), `random` (independent requests), `trace` (Mooncake replay)."""
