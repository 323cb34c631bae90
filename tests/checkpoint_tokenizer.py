"""Tokenizers trained in the test run and saved beside tiny checkpoints, as a checkpoint ships them.

    save_bpe_tokenizer(dir)        # tokenizer.json (byte-level BPE, BOS post-processor) + tokenizer_config.json
    save_bpe_tokenizer_without_template(dir)   # the same without a chat template
    save_tiktoken_tokenizer(dir)   # tiktoken.model (Kimi's format) + tokenizer_config.json with added specials

Both are trained on `CORPUS` (English, accented Latin, Chinese, emoji), so rare multi-byte characters stay split
over several byte tokens (what incremental detokenisation must hold back). Both write a ChatML-style
`CHAT_TEMPLATE` that uses `bos_token`, `raise_exception`, a loop, a namespace and `add_generation_prompt`.
`BPE_VOCAB_SIZE` / `TIKTOKEN_VOCAB_SIZE` bound the ids: a checkpoint's `vocab_size` must be at least that.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

BPE_SPECIALS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>")
"""Ids 0..4: pad, BOS and EOS at the ids tests/checkpoints.py configs name (0, 1, 2)."""
BPE_VOCAB_SIZE = 400
"""Ids of the trained BPE tokenizer (specials included) are below this."""
TIKTOKEN_BASE = 300
TIKTOKEN_SPECIALS = {TIKTOKEN_BASE: "[BOS]", TIKTOKEN_BASE + 1: "[EOS]", TIKTOKEN_BASE + 2: "<|im_start|>",
                     TIKTOKEN_BASE + 3: "<|im_end|>", TIKTOKEN_BASE + 4: "<|im_middle|>"}
TIKTOKEN_VOCAB_SIZE = TIKTOKEN_BASE + 256
"""Kimi reserves 256 special ids after the BPE ranks: a checkpoint carrying this tokenizer needs a vocab_size of at
least 556 (a node refuses a tokenizer with more ids than its model)."""

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The agent reads the file, patches the diff and runs the tests.",
    "Hello, world! How are you today? I am fine, thank you. Let us decode the prefill and route the request.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve fa\u00e7ade, \u00fcber Stra\u00dfe, \u00e5ngstr\u00f6m.",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002\u6211\u4eec\u4e00\u8d77\u5b66\u4e60\u3002",
    "Emoji: \U0001f600 \U0001f680 \U0001f44d\U0001f3fd and symbols \u2192 \u2211 \u221e \u00b1 \u00a7.",
    "def main(argv):\n    return run(argv[1:], timeout=30)\n\nfor i in range(10):\n    print(i * 2)",
    "numbers 0 1 2 3 12 123 1234 3.14159 2026-12-05 user assistant system message content role",
] * 20

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(turns=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + message['role']) }}"
    "{% endif %}"
    "{% set ns.turns = ns.turns + 1 %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)


def save_bpe_tokenizer(directory: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Train a byte-level BPE on CORPUS and save it as a checkpoint ships it; returns `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, special_tokens=list(BPE_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", bos)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
              "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
              "pad_token": "<|pad|>", "model_max_length": 4096, "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def save_bpe_tokenizer_without_template(directory: Path) -> Path:
    """`save_bpe_tokenizer` with no chat template (such a checkpoint serves completions only)."""
    return save_bpe_tokenizer(directory, chat_template=None)


def save_tiktoken_tokenizer(directory: Path) -> Path:
    """A tiktoken.model of TIKTOKEN_BASE ranks (the 256 bytes, then BPE merges learned on CORPUS) with Kimi's
    tokenizer_config.json shape (added_tokens_decoder for the specials, a chat template); returns `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=TIKTOKEN_BASE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    from engine.model.tokenizer_hf import byte_alphabet

    table = byte_alphabet()
    pieces = sorted(bpe.get_vocab().items(), key=lambda item: item[1])
    ranked = [bytes([b]) for b in range(256)]
    ranked += [bytes(table[ch] for ch in piece) for piece, _ in pieces if len(piece) > 1][:TIKTOKEN_BASE - 256]
    lines = [f"{base64.b64encode(raw).decode()} {rank}" for rank, raw in enumerate(ranked)]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    added = {str(i): {"content": text, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False} for i, text in TIKTOKEN_SPECIALS.items()}
    config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "added_tokens_decoder": added,
              "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [TIKTOKEN_BASE + 1,
                                                                                    TIKTOKEN_BASE + 3]}))
    return directory
