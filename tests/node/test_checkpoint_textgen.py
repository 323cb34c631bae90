"""A node serving a checkpoint speaks through the checkpoint's tokenizer (no engine needed): chat messages become
the template's ids (transformers' `apply_chat_template` ids), the checkpoint's other EOS ids end a generation
unless `ignore_eos`, streamed text never carries half a character and stop strings cut across tokens, a template's
refusal is a 400 naming `messages`, and a tokenizer larger than the model's vocabulary refuses the start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from engine.api import TokenEvent
from engine.model.config import ModelConfig
from node.tokenizer import ServerTokenizer, load_tokenizer
from node.textgen import GenerationResult, Limits, generate_pieces, prepare
from serving.errors import APIError
from serving.protocol import ChatCompletionRequest, CompletionRequest
from tests.checkpoint_tokenizer import BPE_VOCAB_SIZE, save_bpe_tokenizer

LIMITS = Limits(max_context=512)
TEXT = "Caf\u00e9 \u4f60\u597d \U0001f600\U0001f44d\U0001f3fd STOP here"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    directory = save_bpe_tokenizer(tmp_path_factory.mktemp("ckpt"))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    return directory


def _server_tokenizer(ckpt) -> ServerTokenizer:
    return load_tokenizer(ModelConfig(checkpoint=str(ckpt), vocab_size=BPE_VOCAB_SIZE + 24, eos_token_id=4))


def _chat(**fields) -> ChatCompletionRequest:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello \U0001f600"}]
    return ChatCompletionRequest.model_validate({"messages": messages, "max_tokens": 4, **fields})


def test_chat_prompt_is_the_templates_ids(ckpt):
    transformers = pytest.importorskip("transformers", reason="transformers is the test oracle (test extra)")
    tokenizer = _server_tokenizer(ckpt)
    prepared = prepare(_chat(), "chat", "r1", "m", tokenizer, LIMITS)
    messages = [m.model_dump(exclude_none=True) for m in _chat().messages]
    theirs = transformers.AutoTokenizer.from_pretrained(str(ckpt)).apply_chat_template(messages,
                                                                                        add_generation_prompt=True)
    assert list(prepared.prompt_token_ids) == list(theirs["input_ids"])
    completion = prepare(CompletionRequest(prompt=TEXT, max_tokens=2), "completion", "r2", "m", tokenizer, LIMITS)
    assert completion.prompt_token_ids[0] == tokenizer.inner.bos_token_id


def test_other_eos_ids_stop_unless_ignore_eos(ckpt):
    tokenizer = _server_tokenizer(ckpt)
    assert tokenizer.inner.eos_token_id == 4 and tokenizer.stop_token_ids == (2,)  # 4 is the engine's own EOS
    plain = prepare(_chat(stop_token_ids=[9]), "chat", "r1", "m", tokenizer, LIMITS).sampling
    assert plain.stop_token_ids == (9, *tokenizer.stop_token_ids)
    ignoring = prepare(_chat(stop_token_ids=[9], ignore_eos=True), "chat", "r1", "m", tokenizer, LIMITS).sampling
    assert ignoring.stop_token_ids == (9,)


def test_template_refusal_and_missing_template_are_400s(ckpt, tmp_path):
    tokenizer = _server_tokenizer(ckpt)
    tool = ChatCompletionRequest.model_validate({"messages": [{"role": "tool", "content": "x"}]})
    with pytest.raises(APIError) as info:
        prepare(tool, "chat", "r1", "m", tokenizer, LIMITS)
    assert info.value.status == 400 and info.value.param == "messages" and "unsupported role tool" in info.value.message
    bare = _server_tokenizer(save_bpe_tokenizer(tmp_path / "bare", chat_template=None))
    with pytest.raises(APIError) as info:
        prepare(_chat(), "chat", "r1", "m", bare, LIMITS)
    assert info.value.param == "messages" and "no chat template" in info.value.message


def test_tokenizer_larger_than_the_model_refuses(ckpt):
    with pytest.raises(ValueError, match="vocab_size is 100"):
        load_tokenizer(ModelConfig(checkpoint=str(ckpt), vocab_size=100))


async def _events(ids: list[int]):
    for n, token_id in enumerate(ids):
        yield TokenEvent(request_id="r", token_id=token_id, index=n, logprob=-1.0,
                         finish_reason="length" if n == len(ids) - 1 else None)


def _pieces(tokenizer, prepared, ids) -> tuple[list[str], GenerationResult]:
    result = GenerationResult()

    async def collect():
        return [piece.text async for piece in generate_pieces(_events(ids), prepared, tokenizer, result)]
    return asyncio.run(collect()), result


@pytest.mark.parametrize("stop", [None, "STOP"], ids=["no-stop", "stop-string"])
def test_streamed_text_never_splits_a_character(ckpt, stop):
    tokenizer = _server_tokenizer(ckpt)
    prepared = prepare(CompletionRequest(prompt="Say:", max_tokens=64, stop=stop), "completion", "r", "m", tokenizer,
                       LIMITS)
    prepared = dataclasses.replace(prepared, sampling=dataclasses.replace(prepared.sampling, stop_token_ids=()))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert sum(1 for i in ids if _partial(tokenizer.token_bytes(i))) >= 4  # characters split over tokens
    texts, result = _pieces(tokenizer, prepared, ids)
    want = TEXT if stop is None else TEXT[:TEXT.index(stop)]
    assert "".join(texts) == result.text == want and all("\ufffd" not in t for t in texts)
    assert result.finish_reason == ("length" if stop is None else "stop")


def _partial(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return True
    return False


def test_weights_fingerprint_tells_checkpoints_apart_not_their_paths(tmp_path):
    """What the router pairs by (node/runtime.py `served_weights_fingerprint`): another checkpoint or another
    tokenizer beside the same weights differ; a copy of the same files elsewhere does not."""
    pytest.importorskip("transformers", reason="tests/checkpoints.py builds checkpoints with transformers")
    import shutil

    from engine.model.config import resolve_model
    from node.runtime import served_weights_fingerprint
    from tests.checkpoint_tokenizer import save_bpe_tokenizer_without_template
    from tests.checkpoints import checkpoint_dir

    def fingerprint(directory) -> str:
        cfg = resolve_model(str(directory))
        return served_weights_fingerprint(cfg, 0, load_tokenizer(cfg))

    mix = checkpoint_dir("kimi-mix", tokenizer=save_bpe_tokenizer)
    copy = shutil.copytree(mix, tmp_path / "elsewhere" / "copy")
    other_weights = checkpoint_dir("kimi-dense-shared", tokenizer=save_bpe_tokenizer)
    other_tokenizer = checkpoint_dir("kimi-mix", tokenizer=save_bpe_tokenizer_without_template)
    assert fingerprint(mix) == fingerprint(copy)
    assert len({fingerprint(mix), fingerprint(other_weights), fingerprint(other_tokenizer)}) == 3
    assert served_weights_fingerprint(resolve_model("kimi-k3.1-mini"), 0, load_tokenizer(
        resolve_model("kimi-k3.1-mini"))) != fingerprint(mix)


def test_nul_in_text_encodes_as_transformers_does(ckpt):
    """NUL is text (a byte-level model writes byte 0, an agent sends it back): the checkpoint's tokenizer encodes it
    in a prompt and in chat turns as transformers does, and decodes it back."""
    transformers = pytest.importorskip("transformers", reason="transformers is the test oracle (test extra)")
    theirs = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    tokenizer = _server_tokenizer(ckpt)
    prompt = "a\x00b \x00\x00 Caf\u00e9\x00"
    completion = prepare(CompletionRequest(prompt=prompt, max_tokens=2), "completion", "r1", "m", tokenizer, LIMITS)
    assert list(completion.prompt_token_ids) == theirs(prompt)["input_ids"]
    assert tokenizer.decode(completion.prompt_token_ids) == prompt
    messages = [{"role": "user", "content": "zero?"}, {"role": "assistant", "content": "here: \x00"},
                {"role": "user", "content": "again\x00"}]
    chat = prepare(ChatCompletionRequest.model_validate({"messages": messages, "max_tokens": 2}), "chat", "r2", "m",
                   tokenizer, LIMITS)
    assert list(chat.prompt_token_ids) == list(theirs.apply_chat_template(messages, add_generation_prompt=True)
                                               ["input_ids"])
