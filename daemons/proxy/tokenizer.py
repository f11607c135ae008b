"""Tokenizers the proxy uses to count prompt tokens and turn output token ids into text.

The sim engine has no model, so its tokenizer is a deterministic word hash: each word or punctuation
mark is one token, and each token id decodes to a pronounceable pseudo-word. Real models bring their own
tokenizer (the vLLM backend work adds a Hugging Face one behind the same three methods).
"""

from __future__ import annotations

import re
import zlib
from typing import Protocol

_PIECES = re.compile(r"\w+|[^\w\s]")
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70 syllables


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode_token(self, token_id: int) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


class SimTokenizer:
    def __init__(self, vocab_size: int, eos_token_id: int):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._cache: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        span = self.vocab_size - 3
        return [3 + zlib.crc32(p.encode()) % span for p in _PIECES.findall(text)]

    def decode_token(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if token_id == self.eos_token_id or token_id < 3:
                text = ""
            else:
                n, parts = token_id, []
                while True:
                    n, r = divmod(n, len(_SYLLABLES))
                    parts.append(_SYLLABLES[r])
                    if n == 0:
                        break
                text = " " + "".join(parts)
            self._cache[token_id] = text
        return text

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        turns = [f"<|{m['role']}|> {m['content']}" for m in messages]
        return "\n".join(turns) + "\n<|assistant|>"
