"""A checkpoint directory's own tokenizer: its vocabulary (tokenizer.json or tiktoken.model), special tokens, EOS
set and chat template, behind the same methods as the presets' `ByteTokenizer`.

- `encode(text)`: a prompt as the checkpoint encodes one (its post-processor's BOS, or `add_bos_token` for
  tiktoken); `apply_chat_template(messages)`: the template rendered (engine/model/tokenizer_template.py) and encoded
  without added specials, so the ids equal transformers' `apply_chat_template(..., tokenize=True)`;
- `decode(ids)` skips special tokens; `token_bytes(id)` is the token's own bytes (log-prob names);
  `decoder(context)` an `IncrementalDecoder` (engine/model/tokenizer_stream.py) for streamed text;
- `eos_token_id`: the tokenizer's `eos_token` (else the configs' first EOS id); `eos_token_ids`: every EOS id the
  checkpoint names (engine/model/tokenizer_files.py);
- `fingerprint`: the digest of every tokenizer file read (KV is interchangeable only between equal tokenizers).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from engine.model.tokenizer_files import TokenizerFileError, TokenizerFiles, read_tokenizer_files
from engine.model.tokenizer_stream import IncrementalDecoder
from engine.model.tokenizer_template import ChatTemplate


class Codec(Protocol):
    """A vocabulary backend (engine/model/tokenizer_hf.py, engine/model/tokenizer_tiktoken.py)."""

    vocab_size: int
    special_ids: frozenset[int]

    def token_to_id(self, text: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def _codec(files: TokenizerFiles) -> Codec:
    if files.kind == "tiktoken":
        from engine.model.tokenizer_tiktoken import TiktokenCodec

        return TiktokenCodec(files)
    from engine.model.tokenizer_hf import TokenizersCodec

    return TokenizersCodec(files)


class CheckpointTokenizer:
    """The tokenizer of one checkpoint directory (see the module docstring)."""

    def __init__(self, files: TokenizerFiles) -> None:
        self.files = files
        self.codec = _codec(files)
        self.vocab_size = self.codec.vocab_size
        self.special_tokens = {name: text for name, text in files.named_specials}
        bos = files.special("bos_token")
        self.bos_token_id = self.codec.token_to_id(bos) if bos is not None else None
        eos = files.special("eos_token")
        named_eos = self.codec.token_to_id(eos) if eos is not None else None
        if eos is not None and named_eos is None:
            raise TokenizerFileError(f"{files.directory}: eos_token {eos!r} is not a token of {files.vocab_path.name}")
        ids = ([named_eos] if named_eos is not None else []) + list(files.config_eos_ids)
        self.eos_token_ids = frozenset(ids)
        self.eos_token_id = ids[0] if ids else None
        self._template = ChatTemplate(files.chat_template) if files.chat_template is not None else None
        self.fingerprint = f"{files.kind}:{files.digest}"

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.codec.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.codec.decode(token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.codec.token_bytes(token_id)

    def render_chat(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
        """The template's text for `messages` (objects with `role` and `content`, or dicts)."""
        if self._template is None:
            raise ValueError(f"the checkpoint {self.files.directory.name!r} has no chat template (tokenizer_config.json "
                             "chat_template or chat_template.jinja): send completions instead")
        plain = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        return self._template.render(plain, add_generation_prompt, self.special_tokens)

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def decoder(self, context_ids: Sequence[int] = ()) -> IncrementalDecoder:
        return IncrementalDecoder(self.decode, context_ids)


def is_checkpoint_dir(spec: str | Path) -> bool:
    """True when `spec` names a directory (a checkpoint), not a preset or a config file."""
    return Path(spec).is_dir()


def load_checkpoint_tokenizer(directory: str | Path) -> CheckpointTokenizer:
    """The tokenizer of a checkpoint directory; raises TokenizerFileError naming the bad file or field."""
    return CheckpointTokenizer(read_tokenizer_files(directory))
