"""Byte-level tokenizer in code (no files, no hub) and a small chat template.

Ids 0..255 are the bytes of UTF-8 text; 256 BOS, 257 EOS, 258 <|role|> (starts a message: role name, newline,
content), 259 <|end|> (ends a message). Ids >= 260 are never produced by encode; the model may still emit them
(random weights), and decode skips every id that is not a byte unless asked to show specials.
"""

from __future__ import annotations

from dataclasses import dataclass

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
