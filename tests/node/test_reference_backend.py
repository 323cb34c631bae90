"""The reference backend's command handling on one rank (no transport): commands that race an abort."""

from __future__ import annotations

from engine.api import ImportKV, SamplingParams, TokenEvent
from engine.parallel.groups import ParallelContext
from node.backend import build_backend
from node.runtime import WorkerConfig


def _backend():
    config = WorkerConfig(model="kimi-k3.1-mini", role="decode", seed=None, num_rows=8, block_size=None, tp_size=1,
                          dcp_size=1, max_num_seqs=2, engine_id="test", transport=False)
    return build_backend(config, ParallelContext.single())


def _import(backend, request_id: str) -> None:
    backend.allocate_import(ImportKV(request_id=request_id, prompt_token_ids=(1, 72, 105),
                                     first=TokenEvent(request_id=request_id, token_id=33),
                                     sampling=SamplingParams(max_tokens=4), params=None, peer=None))


def test_start_decode_after_an_abort_is_a_no_op():
    """The router's abort can reach a decode node between a request's import and its StartDecode (a client
    leaving between the legs); the StartDecode that follows must not take the rank down (it raised KeyError,
    which killed every rank of the node)."""
    backend = _backend()
    _import(backend, "left")
    aborted = backend.abort("left")
    assert [e.finish_reason for e in aborted] == ["abort"]
    assert backend.start_decode("left") == []
    _import(backend, "stays")  # the rank goes on serving
    first = backend.start_decode("stays")
    assert [(e.request_id, e.token_id) for e in first] == [("stays", 33)]
