"""The served model's tokenizer as a node's HTTP layer uses it: `load_tokenizer(model_config)` -> `ServerTokenizer`,
the presets' byte tokenizer or a checkpoint's own (engine/model/tokenizer.py), with the chat template over request
messages, the EOS set and incremental decoders. Loaded in the server process before the ranks start
(node/runtime.py `start_runtime`), so bad tokenizer files refuse a node's start at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ServerTokenizer:
    """The served model's tokenizer (engine/model/tokenizer.py `load_tokenizer`: the presets' byte tokenizer or a
    checkpoint's own) with what the OpenAI layer needs: the model's vocabulary size (token-id prompts are checked
    against it), the EOS ids the engine does not stop on by itself, the chat template over request messages and
    incremental decoders."""

    inner: Any
    vocab_size: int
    """The model's vocabulary (embedding rows), which may exceed the tokenizer's."""
    engine_eos_id: int
    """The EOS the engine stops on (ModelConfig.eos_token_id)."""

    @property
    def eos_token_id(self) -> int:
        return self.inner.eos_token_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's other EOS ids (generation_config.json lists several): a node adds them to a request's
        stop_token_ids unless it sets ignore_eos, as vLLM does."""
        return tuple(sorted(self.inner.eos_token_ids - {self.engine_eos_id}))

    @property
    def fingerprint(self) -> str:
        return self.inner.fingerprint

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.inner.encode(text, add_special_tokens)

    def decode(self, ids: Any) -> str:
        return self.inner.decode(list(ids))

    def token_bytes(self, token_id: int) -> bytes:
        return self.inner.token_bytes(token_id)

    def encode_chat(self, messages: list[Any], add_generation_prompt: bool = True) -> list[int]:
        """Request messages (serving.protocol.ChatMessage) through the model's chat template; a template's refusal
        is a ValueError with its message."""
        from engine.model.tokenizer import ChatMessage

        return self.inner.apply_chat_template([ChatMessage(m.role, m.text()) for m in messages], add_generation_prompt)

    def decoder(self, context_ids: Any = ()) -> Any:
        return self.inner.decoder(list(context_ids))


def load_tokenizer(model_config: Any) -> ServerTokenizer:
    """The tokenizer of the model the ranks serve: a checkpoint's own files (`model_config.checkpoint`), else the
    byte tokenizer. A tokenizer whose ids reach past the model's vocabulary is refused (ValueError naming both)."""
    from engine.model.tokenizer import ByteTokenizer
    from engine.model.tokenizer_checkpoint import load_checkpoint_tokenizer

    inner = load_checkpoint_tokenizer(model_config.checkpoint) if model_config.checkpoint else ByteTokenizer()
    if inner.vocab_size > model_config.vocab_size:
        raise ValueError(f"the tokenizer has {inner.vocab_size} ids but the model's vocab_size is "
                         f"{model_config.vocab_size}: the checkpoint's tokenizer does not belong to its weights")
    return ServerTokenizer(inner, model_config.vocab_size, model_config.eos_token_id)
