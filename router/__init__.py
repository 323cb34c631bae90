"""OpenAI-compatible PD router: registry, pairing matrix, session placement, two-leg orchestration, metrics."""
