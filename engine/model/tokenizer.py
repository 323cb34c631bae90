"""The presets' byte-level tokenizer in code (no files, no hub) with a small chat template, and `load_tokenizer`,
which picks the tokenizer of a model spec.

Ids 0..255 are the bytes of UTF-8 text; 256 BOS, 257 EOS, 258 <|role|> (starts a message: role name, newline,
content), 259 <|end|> (ends a message). Ids >= 260 are never produced by encode; the model may still emit them
(random weights), and decode skips every id that is not a byte unless asked to show specials.
A checkpoint directory brings its own tokenizer (engine/model/tokenizer_checkpoint.py); both kinds answer the
same methods (`encode`, `decode`, `token_bytes`, `apply_chat_template`, `decoder`, `eos_token_ids`, `fingerprint`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.model.tokenizer_stream import IncrementalDecoder

if TYPE_CHECKING:
    from engine.model.tokenizer_checkpoint import CheckpointTokenizer

BOS_ID = 256
EOS_ID = 257
ROLE_ID = 258
END_ID = 259
SPECIAL_NAMES = {BOS_ID: "<|bos|>", EOS_ID: "<|eos|>", ROLE_ID: "<|role|>", END_ID: "<|end|>"}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class ByteTokenizer:
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    eos_token_ids = frozenset({EOS_ID})
    vocab_size = END_ID + 1
    fingerprint = "byte"
    has_chat_template = True

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID] + ids if add_bos else ids

    def decode(self, token_ids: list[int] | tuple[int, ...], skip_special: bool = True) -> str:
        out = bytearray()
        for tok in token_ids:
            if 0 <= tok < 256:
                out.append(tok)
            elif not skip_special:
                out.extend(SPECIAL_NAMES.get(tok, f"<|{tok}|>").encode())
        return out.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: its byte, or a special's name (`<|eos|>`, `<|1234|>` for unused ids)."""
        if 0 <= token_id < 256:
            return bytes([token_id])
        return SPECIAL_NAMES.get(token_id, f"<|{token_id}|>").encode()

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """BOS, then <|role|>role\\ncontent<|end|> per message, then <|role|>assistant\\n to prompt a reply."""
        ids = [BOS_ID]
        for msg in messages:
            ids += [ROLE_ID] + self.encode(f"{msg.role}\n{msg.content}", add_bos=False) + [END_ID]
        if add_generation_prompt:
            ids += [ROLE_ID] + self.encode("assistant\n", add_bos=False)
        return ids

    def decoder(self, context_ids: Sequence[int] = ()) -> IncrementalDecoder:
        """An incremental detokeniser (engine/model/tokenizer_stream.py) continuing after `context_ids`."""
        return IncrementalDecoder(self.decode, context_ids)


def load_tokenizer(model: str | Path) -> "ByteTokenizer | CheckpointTokenizer":
    """The tokenizer of a model spec: a checkpoint directory's own (raises TokenizerFileError naming a bad file or
    field), else the byte tokenizer (a preset name or a ModelConfig JSON file)."""
    from engine.model.tokenizer_checkpoint import is_checkpoint_dir, load_checkpoint_tokenizer

    if is_checkpoint_dir(model):
        return load_checkpoint_tokenizer(model)
    return ByteTokenizer()
