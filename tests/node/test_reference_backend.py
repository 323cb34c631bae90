"""The reference backend's command handling on one rank (no transport): commands that race an abort, and a
prefill-role backend's export imported by a decode-role one (rows copied as a NIXL read does) giving the colocated
tokens under the penalties."""

from __future__ import annotations

from engine.api import EngineConfig, ExportedRows, ImportKV, SamplingParams, Submit, TokenEvent
from engine.model.tokenizer import ByteTokenizer
from engine.parallel.groups import ParallelContext
from node.backend import build_backend
from node.rank import WorkerConfig
from tests.engine.test_penalties import PENALTIES, repeating_prompt


def _backend(role: str = "decode"):
    config = WorkerConfig(engine=EngineConfig(num_rows=8, max_batch=2), role=role, engine_id="test", transport=False)
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


def _events(backend, request_id: str, events: list | None = None) -> list:
    """Step until the request's final event; its events (those already given first)."""
    events = list(events or [])
    while not events or not events[-1].is_final:
        events += [e for e in backend.step() if e.request_id == request_id]
    return events


def _served(backend, request_id: str, prompt: list[int], sampling: SamplingParams) -> list[tuple[int, float]]:
    backend.submit(Submit(request_id, tuple(prompt), sampling))
    return [(e.token_id, e.logprob) for e in _events(backend, request_id)]


def test_penalties_change_greedy_and_prefill_to_decode_equals_colocated():
    """What a node's ranks do with a penalised request: colocated (Submit) on the decode backend, and exported by
    a prefill backend then imported (ImportKV with the prompt and the prefill's first token, then StartDecode).
    The prompt makes the greedy answer repeat its first token, which the prefill side samples: the decode side
    must count it (and the prompt) to serve the colocated tokens."""
    colocated_node, prefill, decode = _backend(), _backend("prefill"), _backend()
    base = ByteTokenizer().encode("Log-probs travel with every token.")
    plain = _served(colocated_node, "plain", base, SamplingParams(max_tokens=32, ignore_eos=True))
    prompt = repeating_prompt([token for token, _ in plain], base, False)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True, **PENALTIES)
    colocated = _served(colocated_node, "colo", prompt, sampling)
    assert colocated != _served(colocated_node, "plain2", prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    prefill.submit(Submit("pd", tuple(prompt), sampling, export=True))
    (exported,) = _events(prefill, "pd")
    assert isinstance(exported, ExportedRows)
    attn, kda = decode.allocate_import(ImportKV(request_id="pd", prompt_token_ids=tuple(prompt), sampling=sampling,
                                                first=exported.first, params=None, peer=None))
    for src, dst in zip(exported.attn_row_ids + exported.kda_row_ids, attn + kda):
        decode.pool_buffer()[dst] = prefill.pool_buffer()[src]  # what a NIXL read does
    served = _events(decode, "pd", decode.start_decode("pd"))
    assert [(e.token_id, e.logprob) for e in served] == colocated
