"""Router test fixtures: the session-scoped vLLM producer/consumer pair lives in tests/vllm_fixtures.py."""

from tests.vllm_fixtures import tiny_llama_dir, vllm_pd_pair  # noqa: F401
