"""From an OpenAI request to engine input, and from engine token events back to text.

- `prepare()`: chat template or prompt -> token ids (the served model's tokenizer: its chat template, a
  prompt's BOS), limits checked against the context (OpenAI-style 400s naming the bad value), sampling fields ->
  `engine.api.SamplingParams` (whose own checks become 400s), the model's other EOS ids added to `stop_token_ids`
  unless `ignore_eos`.
- `TextAssembler`: the tokenizer's incremental detokenisation (never half a UTF-8 character; the prompt's last
  tokens as left context), and stop strings (the text up to the stop string is emitted, the stop string is not, as
  in vLLM).
- `generate_pieces()`: drives one request's event stream into text pieces with finish reasons and a
  `RequestTiming` for the metrics. Leaving the iterator early aborts the request on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from engine.api import EngineFailure, PromptLogprobs, SamplingParams, SamplingParamsError, TokenEvent
from kv_transfer.params import KVParamsError, KVTransferParams
from node.metrics import RequestTiming
from serving.errors import APIError
from serving.protocol import ChatCompletionRequest, CompletionRequest

Kind = Literal["completion", "chat"]


class Tokenizer(Protocol):
    """The served model's tokenizer as the HTTP layer uses it (node/tokenizer.py `ServerTokenizer`)."""

    vocab_size: int
    stop_token_ids: tuple[int, ...]
    """EOS ids the engine does not stop on by itself (a checkpoint may name several)."""
    fingerprint: str

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_chat(self, messages: list[Any], add_generation_prompt: bool = True) -> list[int]: ...

    def decoder(self, context_ids: Sequence[int] = ()) -> Any:
        """An incremental decoder: `add(token_id) -> str` (text that became final), `flush() -> str`."""


@dataclass(frozen=True)
class Limits:
    """Request limits of a node."""

    max_context: int
    default_max_tokens: int = 256


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    kind: Kind
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool
    """Completions: the answer's text (and log-probs) start with the prompt's."""
    prompt_logprobs: bool
    """Answer with vLLM's `prompt_logprobs` list."""
    kv_params: KVTransferParams | None
    """The request's parsed `kv_transfer_params` (None when absent)."""
    session: str = ""
    """The router's opaque session key (`x-pdcluster-session`), "" when the request belongs to none."""
    cache_salt: str = ""
    """The prefix cache's salt (`cache_salt` below): "" when neither a tenant nor the body's `cache_salt` names one."""
    return_token_ids: bool = False
    """Stream chunks carry the token ids they cover."""

    @property
    def num_resumed(self) -> int:
        """Tokens at the end of `prompt_token_ids` that an earlier stream of this request already sent."""
        return self.sampling.num_resumed

    @property
    def client_prompt_ids(self) -> tuple[int, ...]:
        """The prompt as the client sent it (without the resumed tokens)."""
        return self.prompt_token_ids[:len(self.prompt_token_ids) - self.num_resumed]

    @property
    def resumed_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids[len(self.prompt_token_ids) - self.num_resumed:]


SESSION_HEADER = "x-pdcluster-session"
TENANT_HEADER = "x-pdcluster-tenant"
"""The router's digest of the client's API key (router/identity.py `cache_scope`; never the key itself)."""
_HEX = frozenset("0123456789abcdefABCDEF")


def _parse_hex_header(name: str, value: str | None) -> str:
    """Absent -> "", 1..64 hex characters -> itself, anything else a 400 naming the header."""
    if value is None:
        return ""
    if not 0 < len(value) <= 64 or not set(value) <= _HEX:
        raise APIError(400, f"{name} must be 1 to 64 hex characters", name)
    return value


def parse_session(value: str | None) -> str:
    """The `x-pdcluster-session` header (the router's opaque session key)."""
    return _parse_hex_header(SESSION_HEADER, value)


def parse_tenant(value: str | None) -> str:
    """The `x-pdcluster-tenant` header (the router's digest of the tenant; absent: no tenant)."""
    return _parse_hex_header(TENANT_HEADER, value).lower()


def cache_salt(tenant: str, salt: str | None) -> str:
    """The prefix cache's salt of a request: a digest of its tenant (the router's `x-pdcluster-tenant`) and the
    body's `cache_salt`, "" when it has neither (every such request shares the unsalted cache). Blocks are keyed by
    (salt, content), so a tenant never reuses, nor learns through `cached_tokens`, a prefix another sent, and a
    client's `cache_salt` narrows its sharing further, as in vLLM."""
    if not tenant and not salt:
        return ""
    data = tenant.encode("ascii") + b"\0" + (salt or "").encode("utf-8")
    return hashlib.blake2b(data, digest_size=16, person=b"pdc-cache-salt").hexdigest()


def _prompt_ids(req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        try:
            return tokenizer.encode_chat(req.messages, req.add_generation_prompt)
        except ValueError as exc:  # the template refused the conversation (or the model has no template)
            raise APIError(400, str(exc), "messages") from exc
    if isinstance(req.prompt, str):
        return tokenizer.encode(req.prompt) if req.prompt else []
    bad = [tok for tok in req.prompt if not 0 <= tok < tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                       "prompt")
    return list(req.prompt)


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives per sampled token the request asks for (None: no log-probs)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def _prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Alternatives per prompt position the engine must compute (None: no prompt log-probs): vLLM's
    `prompt_logprobs`, or an echo (the echoed prompt comes back with its tokens' log-probs when `logprobs` is
    set; the engine's prompt event also carries the prompt's place in the stream)."""
    counts = [req.prompt_logprobs] if req.prompt_logprobs is not None else []
    if isinstance(req, CompletionRequest) and req.echo:
        counts.append(req.logprobs or 0)
    return max(counts) if counts else None


def _kv_params(raw: dict[str, Any] | None) -> KVTransferParams | None:
    try:
        return KVTransferParams.from_wire(raw)
    except KVParamsError as exc:
        raise APIError(400, str(exc), "kv_transfer_params") from exc


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest, kv_params: KVTransferParams | None) -> None:
    """400 naming the first parameter this engine does not implement (every other one is honoured)."""
    name = req.refused_parameter()
    if name is not None:
        raise APIError(400, f"parameter {name!r} is not supported by this server (the reference engine does not "
                            f"implement it); send the request without it", name)
    asks_prompt = req.prompt_logprobs is not None or (isinstance(req, CompletionRequest) and req.echo)
    if asks_prompt and kv_params is not None and kv_params.do_remote_prefill:
        raise APIError(400, "prompt log-probs (echo or prompt_logprobs) are computed by a local prefill: send the "
                            "request without a remote prefill", "kv_transfer_params")


SAMPLING_FIELDS = frozenset(spec.name for spec in dataclasses.fields(SamplingParams)) - {"stop"}
"""SamplingParams fields a request may set. `stop` is not one: the node ends a stream on stop strings itself
(`TextAssembler`), so the engine's stays empty."""


def _resumed_ids(req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer, max_tokens: int,
                 is_export: bool) -> list[int]:
    """`resume_token_ids`, checked: in the vocabulary, fewer than `max_tokens` (unless the request is a prefill
    leg, whose `max_tokens` is 1: the one token it hands over), and not with prompt scoring."""
    resumed = list(req.resume_token_ids or ())
    if not resumed:
        return []
    if req.prompt_logprobs is not None or (isinstance(req, CompletionRequest) and req.echo):
        raise APIError(400, "resume_token_ids cannot be combined with echo or prompt_logprobs", "resume_token_ids")
    bad = [tok for tok in resumed if not 0 <= tok < tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"resume_token_ids: token id {bad[0]} is outside the vocabulary [0, "
                            f"{tokenizer.vocab_size})", "resume_token_ids")
    if len(resumed) >= max_tokens and not is_export:
        raise APIError(400, f"resume_token_ids has {len(resumed)} tokens: max_tokens ({max_tokens}) leaves none to "
                            "generate", "resume_token_ids")
    return resumed


def _sampling(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
              eos_ids: tuple[int, ...] = (), num_resumed: int = 0) -> SamplingParams:
    """The request's SamplingParams: the fields below are translated (defaults, vLLM's spellings, OpenAI's two
    log-prob shapes, the model's other EOS ids `eos_ids` joining `stop_token_ids` unless `ignore_eos`); every other
    field both the request and SamplingParams declare passes as sent when set, so a new sampling parameter needs no
    code here. A value out of its range is a 400 naming the field."""
    stop_ids = list(req.stop_token_ids or ())
    if not req.ignore_eos:
        stop_ids += [token_id for token_id in eos_ids if token_id not in stop_ids]
    translated = {
        "max_tokens": max_tokens - num_resumed, "num_resumed": num_resumed,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_k": max(0, req.top_k or 0), "stop_token_ids": tuple(stop_ids),
        "logprobs": _logprobs(req), "prompt_logprobs": _prompt_logprobs(req),
    }
    shared = (SAMPLING_FIELDS & type(req).model_fields.keys()) - translated.keys()
    as_sent = {name: getattr(req, name) for name in shared if getattr(req, name) is not None}
    try:
        return SamplingParams(**as_sent, **translated)
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), exc.field) from exc


def prepare(req: CompletionRequest | ChatCompletionRequest, kind: Kind, request_id: str, model: str,
            tokenizer: Tokenizer, limits: Limits, tenant: str = "") -> PreparedRequest:
    """Validate and convert one request (`tenant`: the router's tenant digest, "" for none); raises APIError(400)
    on bad input."""
    if req.model is not None and req.model != model:
        raise APIError(404, f"The model `{req.model}` does not exist; this node serves `{model}`", "model",
                       "NotFoundError")
    kv_params = _kv_params(req.kv_transfer_params)
    _refuse_unsupported(req, kv_params)
    ids = _prompt_ids(req, tokenizer)
    param = "messages" if kind == "chat" else "prompt"
    if not ids:
        raise APIError(400, "the prompt is empty: send at least one token", param)
    room = limits.max_context - len(ids)
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {limits.max_context} tokens. However, your "
                            f"prompt has {len(ids)} tokens, leaving no room for output.", param)
    max_tokens = req.max_tokens if req.max_tokens is not None else min(limits.default_max_tokens, room)
    echo = isinstance(req, CompletionRequest) and req.echo
    if len(ids) + max_tokens > limits.max_context:
        raise APIError(400, f"This model's maximum context length is {limits.max_context} tokens. However, you "
                            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the {param}, {max_tokens} "
                            f"in the completion).", "max_tokens")
    is_export = kv_params is not None and kv_params.do_remote_decode
    resumed = _resumed_ids(req, tokenizer, max_tokens, is_export)
    sampling = _sampling(req, max_tokens + (len(resumed) if is_export else 0), tokenizer.stop_token_ids,
                         len(resumed))
    return PreparedRequest(request_id=request_id, kind=kind, model=model, prompt_token_ids=tuple(ids + resumed),
                           sampling=sampling, stop_strings=tuple(req.stop_strings), stream=req.stream,
                           include_usage=req.include_usage, echo=echo, prompt_logprobs=req.prompt_logprobs is not None,
                           kv_params=kv_params, cache_salt=cache_salt(tenant, req.cache_salt),
                           return_token_ids=req.return_token_ids)


class TextAssembler:
    """Token ids in, text deltas out; holds back incomplete UTF-8 (the tokenizer's incremental decoder, with
    `context_ids`, the prompt, as left context) and possible stop-string prefixes.

    Work per token is bounded: the decoder's window is (engine/model/tokenizer_stream.py), and each stop string is
    looked for only where it could end in the new text, over the text still held back (less than the longest stop
    string) plus that new text; the text emitted is kept as pieces, joined once (`text`). The request's stop strings
    are capped in number and length (serving/protocol.py `MAX_STOP_STRINGS`, `MAX_STOP_CHARS`)."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = (), context_ids: Sequence[int] = ()) -> None:
        self.decoder = tokenizer.decoder(context_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self._hold = max((len(s) - 1 for s in self.stop_strings), default=0)
        self._emitted: list[str] = []
        self._held = ""
        """Decoded text not emitted yet: at most `_hold` characters between tokens."""
        self.stopped = False

    @property
    def text(self) -> str:
        """All text so far (emitted and held back)."""
        return "".join(self._emitted) + self._held

    def add(self, token_id: int) -> str:
        """The text that became final with this token ('' when held back). Sets `stopped` on a stop string."""
        new = self.decoder.add(token_id)
        if not new:
            return ""
        held = self._held + new
        for stop in self.stop_strings:  # a match ending in `new` (one ending earlier was found earlier)
            at = held.find(stop, max(0, len(self._held) - len(stop) + 1))
            if at >= 0:
                self.stopped = True
                self._held = ""
                return self._emit(held[:at])
        cut = max(0, len(held) - self._hold)
        self._held = held[cut:]
        return self._emit(held[:cut])

    def flush(self) -> str:
        held = self._held
        if not self.stopped:
            held += self.decoder.flush()
        self._held = ""
        return self._emit(held)

    def _emit(self, delta: str) -> str:
        if delta:
            self._emitted.append(delta)
        return delta


@dataclass
class Piece:
    """A step of a response: a text delta, the token events it covers (every token since the previous piece,
    including those whose text was held back), and the finish reason on the last one."""

    text: str
    tokens: tuple[TokenEvent, ...]
    finish_reason: str | None = None
    is_prompt: bool = False
    """The prompt's log-probs (`tokens`: one per prompt position), and with `echo` its text, before any token."""
    is_flush: bool = False
    """Tokens whose text is still held back, sent (ids and log-probs, no text) because the stream ends here."""


@dataclass
class StreamMoved(APIError):
    """The stream ends on this node and continues on another with its KV (decode_node/moves.py): the error event
    carries the signed params the router hands to the next instance."""

    kv_transfer_params: dict = field(default_factory=dict)


@dataclass
class GenerationResult:
    """Filled while `generate_pieces` runs; complete once the iterator ends."""

    tokens: list[TokenEvent] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    timing: RequestTiming | None = None
    prompt_tokens: list[TokenEvent] = field(default_factory=list)
    """One event per prompt position with its log-prob, when the request asked for prompt log-probs."""

    @property
    def token_ids(self) -> list[int]:
        return [int(event.token_id) for event in self.tokens if event.token_id is not None]


async def generate_pieces(events: AsyncIterator[Any], prepared: PreparedRequest, tokenizer: Tokenizer,
                          result: GenerationResult, started: float | None = None) -> AsyncIterator[Piece]:
    """Turn a request's token events into text pieces; raises APIError when the engine fails it."""
    started = time.monotonic() if started is None else started
    assembler = TextAssembler(tokenizer, prepared.stop_strings, prepared.client_prompt_ids)
    for token_id in prepared.resumed_ids:  # the lost stream's state: what it held back is sent from here on
        assembler.add(token_id)
    if assembler.stopped:
        raise APIError(400, "resume_token_ids already end the stream on a stop string", "resume_token_ids")
    stamps: list[float] = []
    pending: list[TokenEvent] = []
    try:
        async for event in events:
            if isinstance(event, EngineFailure):
                if pending:  # tokens whose text is held back reach the client (their ids) before the failure, so
                    yield Piece("", tuple(pending), is_flush=True)  # a resume continues after every sampled token
                    pending.clear()
                if event.kv_transfer_params is not None:
                    raise StreamMoved(event.status, event.error, kv_transfer_params=event.kv_transfer_params)
                raise APIError(event.status, event.error)
            if isinstance(event, PromptLogprobs):
                result.prompt_tokens = list(event.tokens)
                echoed = tokenizer.decode(prepared.prompt_token_ids) if prepared.echo else ""
                yield Piece(echoed, event.tokens, is_prompt=True)
                continue
            if not isinstance(event, TokenEvent):
                continue
            result.num_cached_tokens = max(result.num_cached_tokens, event.num_cached_tokens)
            finish = event.finish_reason
            delta = ""
            if event.token_id is not None and finish != "abort":
                stamps.append(time.monotonic())
                result.tokens.append(event)
                pending.append(event)
                delta = assembler.add(event.token_id)
            if assembler.stopped:
                finish = "stop"
            if finish is not None:
                delta += assembler.flush()
                result.finish_reason = finish
                result.text = assembler.text
                yield Piece(delta, tuple(pending), finish)
                return
            if delta:
                yield Piece(delta, tuple(pending))
                pending.clear()
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # stops (aborts) the request if still running
        end = time.monotonic()
        gaps = tuple(b - a for a, b in zip(stamps, stamps[1:]))
        result.timing = RequestTiming(
            num_prompt_tokens=len(prepared.prompt_token_ids), num_output_tokens=len(result.tokens),
            finish_reason=result.finish_reason or "abort", e2e=end - started,
            ttft=(stamps[0] - started) if stamps else None, gaps=gaps)

