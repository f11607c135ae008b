"""Tokenizers the proxy uses to count prompt tokens and turn output token ids into text.

- ``SimTokenizer``: the sim engine has no model; each word (cut into pieces of at most 16 characters, as a
  real vocabulary's tokens are bounded) or punctuation mark is one token (a hash), and each token id decodes
  to a pronounceable pseudo-word.
- ``HFTokenizer``: a real model's ``tokenizer.json`` (Hugging Face ``tokenizers``) with the chat template
  of its ``tokenizer_config.json``, or of ``chat_template.jinja`` beside it (where current transformers
  writes it). Byte-level BPE pieces can end inside a UTF-8 character, so output is
  detokenized incrementally: text is released only once it decodes cleanly, and what is still held back
  when the output ends (an incomplete UTF-8 sequence) is dropped, as vLLM's detokenizer drops it
  (tokenizers' ``DecodeStream`` never releases it).

Each request gets its own detokenizer (``tokenizer.detokenizer()``), since text depends on context.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path
from typing import Protocol

SIM_TOKEN_CHARS = 16  # the longest piece of text one sim token stands for
_PIECES = re.compile(r"\w{1,%d}|[^\w\s]" % SIM_TOKEN_CHARS)
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70 syllables
_NSYL = len(_SYLLABLES)
_NPAIRS = _NSYL * _NSYL
_PAIRS = [_SYLLABLES[k % _NSYL] + _SYLLABLES[k // _NSYL] for k in range(_NPAIRS)]  # two digits: low, then high


class Detokenizer(Protocol):
    def add(self, token_id: int) -> str:
        """The text this token adds to the output (may be "" until a character completes)."""

    def flush(self) -> str:
        """What is held back, at the end of the output, unless it is an incomplete character (dropped)."""


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def detokenizer(self) -> Detokenizer: ...

    def token_text(self, token_id: int) -> str: ...

    def token_str(self, token_id: int) -> str: ...

    def decode_all(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            extra: dict | None = None, tools: list[dict] | None = None) -> str: ...


class SimTokenizer:
    # No token stands for more characters than this: a text of more characters than the prompt limit times
    # this is refused before it is encoded (the proxy's checks), whatever it holds.
    max_token_chars = SIM_TOKEN_CHARS

    def __init__(self, vocab_size: int, eos_token_id: int):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._cache = _SimTexts(eos_token_id)
        # A token's text is a dict lookup in C (its detokenizer's ``add``), computed once on a miss.
        self.decode_token = self._cache.__getitem__

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        span = self.vocab_size - 3
        return [3 + zlib.crc32(p.encode()) % span for p in _PIECES.findall(text)]

    def token_text(self, token_id: int) -> str:
        return self.decode_token(token_id)

    def token_str(self, token_id: int) -> str:
        return self.decode_token(token_id)

    def decode_all(self, ids: list[int]) -> str:
        return "".join(map(self.decode_token, ids))

    def detokenizer(self) -> "_SimDetokenizer":
        return _SimDetokenizer(self.decode_token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            extra: dict | None = None, tools: list[dict] | None = None) -> str:
        turns = [f"<|{m['role']}|> {m['content']}" for m in messages]
        return "\n".join(turns) + ("\n<|assistant|>" if add_generation_prompt else "")


class _SimTexts(dict):
    """The text of each sim token id asked for so far; a missing one is computed (and kept) on lookup."""

    def __init__(self, eos_token_id: int):
        super().__init__()
        self.eos_token_id = eos_token_id

    def __missing__(self, token_id: int) -> str:
        """The id's syllables, lowest base-70 digit first (two digits at a time once past the first)."""
        if token_id == self.eos_token_id or token_id < 3:
            text = ""
        elif token_id < _NSYL:
            text = " " + _SYLLABLES[token_id]
        else:
            n, parts = token_id, []
            while n >= _NSYL:
                n, r = divmod(n, _NPAIRS)
                parts.append(_PAIRS[r])
            if n:
                parts.append(_SYLLABLES[n])
            text = " " + "".join(parts)
        self[token_id] = text
        return text


class _SimDetokenizer:
    __slots__ = ("add",)

    def __init__(self, decode_token):
        self.add = decode_token  # context-free: each token is its own text

    def flush(self) -> str:
        return ""


class TokenizerError(Exception):
    pass


class HFTokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) of a checkpoint directory."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise TokenizerError(f"{path}: no tokenizer.json (the proxy needs the model's fast tokenizer)")
        self._tok = _Tok.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._texts: dict[int, str] = {}  # token_text's, as they are asked for
        # The most characters one token stands for (a vocabulary entry has a character per byte, or per
        # character, of what it encodes): a text longer than N times this has more than N tokens, known
        # before the work of encoding it.
        self.max_token_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        conf_file = path / "tokenizer_config.json"
        conf = json.loads(conf_file.read_text()) if conf_file.exists() else {}
        self.bos_token = _token_text(conf.get("bos_token"))
        self.eos_token = _token_text(conf.get("eos_token"))
        self.add_bos = bool(conf.get("add_bos_token", False))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self._template = None
        template = conf.get("chat_template")
        if (path / "chat_template.jinja").exists():  # where current transformers writes it; it wins, as there
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Chat prompts pass add_special_tokens=False: the template already wrote BOS (as vLLM does)."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text alone (logprobs show it for the sampled token and each alternative: ~20 a token).
        Kept once decoded: there are at most vocab_size of them, and a Rust call costs more than a lookup."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            if 0 <= token_id < self.vocab_size:
                self._texts[token_id] = text
        return text

    def token_str(self, token_id: int) -> str:
        """The vocabulary entry (e.g. ``Ġhello``), as /tokenize's token_strs gives it."""
        return self._tok.id_to_token(token_id) or ""

    def decode_all(self, ids: list[int]) -> str:
        """All of ``ids`` as text, special tokens included (/detokenize, like vLLM's)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def detokenizer(self) -> "_IncrementalDetokenizer":
        return _IncrementalDetokenizer(self.decode)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            extra: dict | None = None, tools: list[dict] | None = None) -> str:
        """``tools``: the request's tools, as the template's ``tools`` variable (as transformers and vLLM pass them)."""
        if self._template is None:
            raise TokenizerError("this model's tokenizer has no chat template; use /v1/completions")
        context = {k: v for k, v in (extra or {}).items() if k not in ("messages", "bos_token", "eos_token", "tools")}
        context.update(messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", tools=tools)
        try:
            return self._template.render(**context)
        except TokenizerError:
            raise
        except Exception as exc:  # the template is data: whatever it trips over is the messages' fault
            raise TokenizerError(f"the chat template could not render these messages: {type(exc).__name__}: {exc}") from None


class _IncrementalDetokenizer:
    """Decode a growing id list, releasing text only when it no longer ends in a partial character.

    Decoding only a short window (from ``prefix`` on) keeps the cost per token constant; the window's
    first tokens give the context that decides leading spaces. Tokens that add no text (special tokens
    skipped, a space that shows only before the next token) are held at most ``HOLD`` tokens, and a
    character still incomplete after ``HOLD_PARTIAL`` is released as it decodes: the window never grows
    past that, so a stream of such tokens costs linear time, not quadratic.
    """

    HOLD = 8
    HOLD_PARTIAL = 64

    def __init__(self, decode):
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids before this are already emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        pending = len(self.ids) - self.read
        if len(text) > len(prefix_text) and not text.endswith("\ufffd") or pending > self.HOLD_PARTIAL:
            new = text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            return new
        if pending > self.HOLD and not text.endswith("\ufffd"):  # they decode to nothing: move on
            self.prefix, self.read = self.read, len(self.ids)
        return ""

    def flush(self) -> str:
        """Held-back text ends in an incomplete character (that is why it was held): vLLM's detokenizer
        never releases it, so neither do we (no trailing U+FFFD)."""
        prefix_text = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        held = text[len(prefix_text):]
        return "" if held.endswith("\ufffd") else held


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken form
        return value.get("content")
    return value


def _raise(message: str):
    raise TokenizerError(message)


def load_tokenizer(model_path: str, vocab_size: int, eos_token_id: int) -> Tokenizer:
    return HFTokenizer(model_path) if model_path else SimTokenizer(vocab_size, eos_token_id)
