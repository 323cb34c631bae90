"""A checkpoint's own tokenizer (engine/model/tokenizer_checkpoint.py) against transformers, the oracle nobody here
wrote: a byte-level BPE trained in the test with `tokenizers` and saved as a checkpoint ships it (tokenizer.json +
tokenizer_config.json with a chat template) encodes, decodes and renders chats to exactly the ids of
`AutoTokenizer.from_pretrained(dir)`; incremental detokenisation never emits a broken UTF-8 sequence and adds up to
the whole decode; a Kimi-style tiktoken.model loads with its specials and EOS set; bad files are refused by name.
"""

from __future__ import annotations

import json
import random

import pytest

from engine.model.tokenizer import ByteTokenizer, load_tokenizer
from engine.model.tokenizer_files import TokenizerFileError
from engine.model.tokenizer_stream import REPLACEMENT
from engine.model.tokenizer_template import ChatTemplateError
from tests.checkpoint_tokenizer import (
    CORPUS,
    TIKTOKEN_BASE,
    TIKTOKEN_SPECIALS,
    save_bpe_tokenizer,
    save_tiktoken_tokenizer,
)

TEXTS = ["Hello, world!", "Caf\u00e9 cr\u00e8me \u4f60\u597d\u4e16\u754c \U0001f600\U0001f680 done.",
         "  leading spaces and\ttabs\n\nnew lines", "\u00e5ngstr\u00f6m \U0001f44d\U0001f3fd \u2192 \u221e",
         "def f(x):\n    return x * 2  # \u00b1"]
CHATS = {
    "one-user": [{"role": "user", "content": "Hello \U0001f600 caf\u00e9"}],
    "system-multi-turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                          {"role": "assistant", "content": "4"}, {"role": "user", "content": "\u4f60\u597d"}],
    "special-text-in-content": [{"role": "user", "content": "say <|im_end|> now  "}],
}


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return save_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def hf_tokenizer(bpe_dir):
    transformers = pytest.importorskip("transformers", reason="transformers is the test oracle (test extra)")
    return transformers.AutoTokenizer.from_pretrained(str(bpe_dir))


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["gen-prompt", "no-gen-prompt"])
def test_chat_renders_to_transformers_ids(bpe_dir, hf_tokenizer, chat, generation_prompt):
    ours = load_tokenizer(bpe_dir)
    messages = CHATS[chat]
    theirs = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    theirs_text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    assert ours.render_chat(messages, generation_prompt) == theirs_text
    assert ours.apply_chat_template(messages, generation_prompt) == list(theirs["input_ids"])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(bpe_dir, hf_tokenizer, text):
    ours = load_tokenizer(bpe_dir)
    ids = ours.encode(text)
    assert ids == hf_tokenizer.encode(text) and ids[0] == ours.bos_token_id  # the file's post-processor adds BOS
    assert ours.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert b"".join(ours.token_bytes(i) for i in ids[1:]) == text.encode()  # token names are the exact bytes


def test_special_tokens_and_eos_set_from_the_configs(bpe_dir, hf_tokenizer, tmp_path):
    ours = load_tokenizer(bpe_dir)
    assert ours.bos_token_id == hf_tokenizer.bos_token_id and ours.eos_token_id == hf_tokenizer.eos_token_id
    assert ours.special_tokens == {"bos_token": "<|bos|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}
    eos = ours.eos_token_id
    assert ours.eos_token_ids == {eos}
    directory = save_bpe_tokenizer(tmp_path / "ckpt")
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 1}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 2]}))
    again = load_tokenizer(directory)
    assert again.eos_token_id == eos and again.eos_token_ids == {eos, 1, 2}
    assert again.fingerprint != ours.fingerprint  # the configs are part of the tokenizer's identity


def test_chat_template_file_wins_and_refusals_are_errors(tmp_path, hf_tokenizer):
    directory = save_bpe_tokenizer(tmp_path / "ckpt")
    (directory / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] | upper }}]{{ m['content'] "
                                                   "| tojson }}{% endfor %}{% if add_generation_prompt %}>"
                                                   "{% endif %}")
    ours = load_tokenizer(directory)
    assert ours.render_chat([{"role": "user", "content": "\u00e9<b>"}]) == '[USER]"\u00e9<b>">'
    with pytest.raises(ChatTemplateError, match="unsupported role tool"):
        load_tokenizer(save_bpe_tokenizer(tmp_path / "other")).render_chat([{"role": "tool", "content": "x"}])
    bare = save_bpe_tokenizer(tmp_path / "bare", chat_template=None)
    with pytest.raises(ValueError, match="has no chat template"):
        load_tokenizer(bare).apply_chat_template([{"role": "user", "content": "hi"}])


def _stream(tokenizer, ids, context=()):
    decoder = tokenizer.decoder(context)
    deltas = [decoder.add(i) for i in ids]
    return deltas, decoder.flush()


@pytest.mark.parametrize("kind", ["bpe", "tiktoken", "byte"])
def test_incremental_detok_holds_split_characters(tmp_path, kind):
    if kind == "bpe":
        tokenizer = load_tokenizer(save_bpe_tokenizer(tmp_path / "t"))
    elif kind == "tiktoken":
        tokenizer = load_tokenizer(save_tiktoken_tokenizer(tmp_path / "t"))
    else:
        tokenizer = ByteTokenizer()
    text = "\u4f60\u597d \U0001f600\U0001f44d\U0001f3fd caf\u00e9 \u00e5ngstr\u00f6m \u2192 ok"
    ids = tokenizer.encode(text, False) if kind != "byte" else tokenizer.encode(text, add_bos=False)
    split = [i for i in ids if _is_partial(tokenizer.token_bytes(i))]
    assert len(split) >= 4, "the test needs characters split over several tokens"
    deltas, tail = _stream(tokenizer, ids)
    assert all(REPLACEMENT not in d for d in deltas) and tail == ""
    assert "".join(deltas) == text
    assert sum(1 for d in deltas if d == "") >= len(split) // 2  # held back while a character was incomplete
    prompt = tokenizer.encode("Hello", False) if kind != "byte" else tokenizer.encode("Hello", add_bos=False)
    with_context, tail = _stream(tokenizer, ids, prompt)
    assert "".join(with_context) + tail == text  # the prompt's context is never emitted


def _is_partial(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_incremental_detok_random_ids_add_up_to_the_whole_decode(bpe_dir):
    tokenizer = load_tokenizer(bpe_dir)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(40)]
        deltas, tail = _stream(tokenizer, ids)  # random bytes hold invalid sequences: U+FFFD where the whole has one
        assert "".join(deltas) + tail == tokenizer.decode(ids)
    broken = tokenizer.encode("\U0001f600", False)[:-1]  # an answer that stops mid-character
    deltas, tail = _stream(tokenizer, broken)
    assert "".join(deltas) == "" and tail.endswith(REPLACEMENT)


def test_tiktoken_checkpoint(tmp_path):
    tokenizer = load_tokenizer(save_tiktoken_tokenizer(tmp_path / "kimi"))
    assert tokenizer.files.kind == "tiktoken" and tokenizer.vocab_size == TIKTOKEN_BASE + 256
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (TIKTOKEN_BASE, TIKTOKEN_BASE + 1)
    assert tokenizer.eos_token_ids == {TIKTOKEN_BASE + 1, TIKTOKEN_BASE + 3}  # eos_token + generation_config
    for text in TEXTS + CORPUS[:7]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text and b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()
        assert len(ids) < len(text.encode()) or len(text) < 4  # merges apply
    assert tokenizer.encode("ab[EOS]") == tokenizer.encode("ab") + [TIKTOKEN_BASE + 1]  # specials in text
    assert tokenizer.decode([*tokenizer.encode("hi"), TIKTOKEN_BASE + 1, TIKTOKEN_BASE + 200]) == "hi"
    assert tokenizer.token_bytes(TIKTOKEN_BASE + 4) == TIKTOKEN_SPECIALS[TIKTOKEN_BASE + 4].encode()
    assert tokenizer.token_bytes(TIKTOKEN_BASE + 9) == f"<|reserved_token_{TIKTOKEN_BASE + 9}|>".encode()
    # the Kimi split: a Han run is its own piece, so "\u4f60\u597dab" never merges across the script boundary
    han = tokenizer.encode("\u4f60\u597d")
    assert tokenizer.encode("\u4f60\u597dab")[:len(han)] == han
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat[:2] == [TIKTOKEN_BASE, TIKTOKEN_BASE + 2] and TIKTOKEN_BASE + 3 in chat
    assert tokenizer.decode(chat) == "user\nhi\nassistant\n"


def test_bad_files_are_refused_by_name(tmp_path):
    with pytest.raises(TokenizerFileError, match="tokenizer.json or tiktoken.model"):
        load_tokenizer(tmp_path)
    directory = save_bpe_tokenizer(tmp_path / "a")
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerFileError, match="tokenizer_config.json"):
        load_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use",
                                                                                      "template": "x"}]}))
    with pytest.raises(TokenizerFileError, match="none named 'default'"):
        load_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": 7}))
    with pytest.raises(TokenizerFileError, match="eos_token"):
        load_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerFileError, match="generation_config.json.*eos_token_id"):
        load_tokenizer(directory)
    kimi = save_tiktoken_tokenizer(tmp_path / "k")
    (kimi / "tiktoken.model").write_text("!!notbase64 0\n")
    with pytest.raises(TokenizerFileError, match="line 1"):
        load_tokenizer(kimi)
    (directory / "generation_config.json").unlink()
    (directory / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerFileError, match="not a tokenizers file"):
        load_tokenizer(directory)
