"""Engine-test fixtures: `tiny_model`, the path of tests/engine/tiny.py's TINY saved as a ModelConfig JSON file."""

from __future__ import annotations

import pytest

from engine.layout import plan_layout
from tests.engine.tiny import TINY, TINY_BLOCK


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """What EngineConfig(model=...) takes for TINY (served with the byte tokenizer, as a preset is)."""
    assert plan_layout(TINY).block_size == TINY_BLOCK
    path = tmp_path_factory.mktemp("tiny-model") / "kimi-k3.1-tiny.json"
    TINY.save(path)
    return str(path)
