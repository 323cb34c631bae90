"""What a checkpoint directory says about its tokenizer: which vocabulary file, the special tokens, the EOS set,
the chat template, and a digest of all of it.

Read, in this order of authority (a missing file is fine, a malformed one is a `TokenizerFileError` naming it):
- the vocabulary: `tokenizer.json` (the `tokenizers` format) or, without it, `tiktoken.model` (Kimi's base64 BPE
  ranks); neither is an error naming both;
- `tokenizer_config.json`: the named special tokens (`bos_token`, `eos_token`, ...: a string or an AddedToken
  object with `content`), `added_tokens_decoder` (id -> token, how a tiktoken vocabulary numbers its specials),
  `add_bos_token` / `add_eos_token`, and `chat_template` (a string, or a list of named templates whose
  `default` is used);
- `chat_template.jinja` beside it, which takes priority over the config's template (as transformers loads it);
- the EOS set: the tokenizer's `eos_token`, `config.json`'s `eos_token_id` and `generation_config.json`'s
  `eos_token_id` (each an id or a list of ids); a generation ends on any of them.
Invariant: `digest` changes whenever any byte of a file read here changes (it joins the weights fingerprint that
the router pairs prefill and decode instances by).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens a template sees by name (`{{ bos_token }}`)."""
TEMPLATE_FILE = "chat_template.jinja"
VOCAB_FILES = {"tokenizer.json": "tokenizers", "tiktoken.model": "tiktoken"}


class TokenizerFileError(ValueError):
    """A checkpoint's tokenizer files cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class AddedTokenSpec:
    """One entry of `added_tokens_decoder`: a token with a fixed id, matched before the BPE runs."""

    token_id: int
    content: str
    special: bool


@dataclass(frozen=True)
class TokenizerFiles:
    """The parsed tokenizer files of one checkpoint directory."""

    directory: Path
    kind: Literal["tokenizers", "tiktoken"]
    """Which vocabulary format the directory holds."""
    vocab_path: Path
    named_specials: tuple[tuple[str, str], ...]
    """(attribute, token text) of each named special the config sets, e.g. ("bos_token", "<s>")."""
    added_tokens: tuple[AddedTokenSpec, ...]
    """`added_tokens_decoder`, sorted by id (empty when the config has none)."""
    add_bos_token: bool | None
    """The config's `add_bos_token` (None: not set)."""
    add_eos_token: bool | None
    chat_template: str | None
    """The Jinja chat template (None: the checkpoint has none; chat requests are then refused)."""
    config_eos_ids: tuple[int, ...]
    """EOS ids from config.json and generation_config.json (in that order, without repeats)."""
    digest: str
    """blake2b of every file read (names and bytes)."""

    def special(self, name: str) -> str | None:
        return dict(self.named_specials).get(name)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerFileError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TokenizerFileError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any, where: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken object, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerFileError(f"{where}: a special token must be a string or an object with a string `content`, "
                             f"got {value!r}")


def _ids(value: Any, where: str) -> tuple[int, ...]:
    """`eos_token_id` as configs write it: an id, a list of ids, or null."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerFileError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    return tuple(values)


def _added_tokens(raw: Any, where: str) -> tuple[AddedTokenSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise TokenizerFileError(f"{where}: added_tokens_decoder must map ids to tokens, got {type(raw).__name__}")
    out = []
    for key, token in raw.items():
        if not str(key).isdigit():
            raise TokenizerFileError(f"{where}: added_tokens_decoder key {key!r} is not a token id")
        content = _token_text(token, f"{where}: added_tokens_decoder[{key}]")
        if content is None:
            raise TokenizerFileError(f"{where}: added_tokens_decoder[{key}] has no content")
        special = bool(token.get("special", False)) if isinstance(token, dict) else False
        out.append(AddedTokenSpec(int(key), content, special))
    return tuple(sorted(out, key=lambda t: t.token_id))


def _chat_template(config: dict[str, Any], directory: Path, where: str) -> str | None:
    template_file = directory / TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    raw = config.get("chat_template")
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TokenizerFileError(f"{where}: chat_template lists templates {sorted(map(str, named))} but none named "
                                 "'default'")
    raise TokenizerFileError(f"{where}: chat_template must be a string or a list of named templates")


def _flag(config: dict[str, Any], name: str, where: str) -> bool | None:
    value = config.get(name)
    if value is not None and not isinstance(value, bool):
        raise TokenizerFileError(f"{where}: {name} must be true or false, got {value!r}")
    return value


def vocab_file(directory: str | Path) -> tuple[Path, str] | None:
    """The directory's vocabulary file and the package that reads it (the first of VOCAB_FILES present); None
    for a checkpoint that ships weights only."""
    directory = Path(directory)
    return next(((directory / name, kind) for name, kind in VOCAB_FILES.items() if (directory / name).is_file()),
                None)


def read_tokenizer_files(directory: str | Path) -> TokenizerFiles:
    """Parse a checkpoint directory's tokenizer files (see the module docstring); raises TokenizerFileError."""
    directory = Path(directory)
    found = vocab_file(directory)
    if found is None:
        raise TokenizerFileError(f"{directory}: no tokenizer: expected {' or '.join(VOCAB_FILES)}")
    vocab_path, kind = found
    config_path = directory / "tokenizer_config.json"
    config = _read_json(config_path)
    where = str(config_path)
    named = tuple((name, text) for name in NAMED_SPECIALS
                  if (text := _token_text(config.get(name), f"{where}: {name}")) is not None)
    eos_ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        for token_id in _ids(_read_json(directory / name).get("eos_token_id"), str(directory / name)):
            if token_id not in eos_ids:
                eos_ids.append(token_id)
    digest = hashlib.blake2b(digest_size=16)
    for path in (vocab_path, config_path, directory / TEMPLATE_FILE, directory / "config.json",
                 directory / "generation_config.json"):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return TokenizerFiles(directory=directory, kind=kind, vocab_path=vocab_path, named_specials=named,
                          added_tokens=_added_tokens(config.get("added_tokens_decoder"), where),
                          add_bos_token=_flag(config, "add_bos_token", where),
                          add_eos_token=_flag(config, "add_eos_token", where),
                          chat_template=_chat_template(config, directory, where), config_eos_ids=tuple(eos_ids),
                          digest=digest.hexdigest())
