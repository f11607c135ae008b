"""What a completion or chat request must be before it is dispatched: the model named, the prompt's token ids
(text, ids or chat messages through the tokenizer), the length limits, the client's request id."""

from __future__ import annotations

import re
from typing import Callable, Mapping

from daemons.proxy.front.call import Call
from daemons.proxy.api.protocol import ApiError, ChatRequest, CompletionRequest, TokenizeRequest
from daemons.proxy.api.structured import ToolChoice
from daemons.proxy.api.tokenizer import Tokenizer, TokenizerError

_REQUEST_ID = re.compile(r"[!-~]{1,128}")  # visible ASCII: safe in logs, tables and headers


class Checks:
    """Raises ApiError (a 4xx body) for what is wrong. Receives the tokenizer, the served model's name and
    context length, proxy.max_prompt_tokens, ``stop_limits`` (the [proxy] settings that bound stop strings) and
    ``adapters`` (the LoRA adapters the cluster serves now: name -> path)."""

    def __init__(self, tokenizer: Tokenizer, model: str, max_model_len: int, max_prompt_tokens: int = 0,
                 stop_limits=None, adapters: Callable[[], Mapping[str, str]] = dict):
        self.tokenizer = tokenizer
        self.adapters = adapters
        self.model = model
        self.max_model_len = max_model_len
        self.max_prompt_tokens = max_prompt_tokens  # 0: only the context limit
        self.stop_limits = stop_limits

    def check_model(self, model: str | None) -> str:
        """The LoRA adapter ``model`` names ("": the base model); ApiError 404 for a model not served here."""
        if model is None or model == self.model:
            return ""
        if model in self.adapters():
            return model
        served = ", ".join(f"`{m}`" for m in (self.model, *sorted(self.adapters())))
        raise ApiError(404, f"The model `{model}` does not exist. This proxy serves {served}.", "model",
                       code="model_not_found")

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and any(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise ApiError(400, "prompt must be a string, a list of one string, or a list of token ids; "
                                    "send one request per prompt", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            self._check_text_length(len(prompt), "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if any(t < 0 for t in ids):
                raise ApiError(400, "token ids in prompt must be >= 0", "prompt")
        if not ids:
            raise ApiError(400, "prompt is empty", "prompt")
        return ids

    def check_stops(self, req: CompletionRequest | ChatRequest) -> None:
        """Stop strings and stop token ids within the proxy's limits: each stop string is looked for in every
        token's text, so their number and length bound the work a request makes per token."""
        pc = self.stop_limits
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > pc.max_stop_strings:
            raise ApiError(400, f"stop has {len(stops)} strings; this server accepts at most {pc.max_stop_strings} "
                                f"(proxy.max_stop_strings)", "stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > pc.max_stop_length:
            raise ApiError(400, f"a stop string has {longest} characters; this server accepts at most "
                                f"{pc.max_stop_length} (proxy.max_stop_length)", "stop")
        if len(req.stop_token_ids) > pc.max_stop_token_ids:
            raise ApiError(400, f"stop_token_ids has {len(req.stop_token_ids)} ids; this server accepts at most "
                                f"{pc.max_stop_token_ids} (proxy.max_stop_token_ids)", "stop_token_ids")

    def _check_text_length(self, chars: int, param: str) -> None:
        """A text of more characters than the token limit times the most characters a token stands for has
        more tokens than the limit: 400 before the work of templating and encoding it."""
        per_token = getattr(self.tokenizer, "max_token_chars", None)
        limit = self.max_prompt_tokens or self.max_model_len
        if per_token and chars > limit * per_token:
            raise ApiError(400, f"This proxy accepts prompts of at most {limit} tokens. However, your prompt has "
                                f"{chars} characters, which is more than {limit} tokens of this model's tokenizer "
                                f"(at most {per_token} characters each).", param, code="prompt_too_long")

    def chat_prompt(self, req: ChatRequest | TokenizeRequest, add_generation_prompt: bool) -> str:
        messages = req.prompt_messages()
        self._check_text_length(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)),
                                "messages")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt,
                                                      req.chat_template_kwargs, getattr(req, "tools", None))
        except TokenizerError as exc:
            raise ApiError(400, str(exc), "messages") from None

    @staticmethod
    def tool_choice(req: ChatRequest) -> ToolChoice:
        """What the request's tools ask for; "auto" needs a parser of the model's own tool-call format, which
        this server does not have: it is refused, naming what works instead."""
        choice = req.tool_choice_of()
        if choice.kind == "auto":
            raise ApiError(400, '"auto" tool choice needs a tool-call parser for this model\'s output format, and '
                                'this server has none; send tool_choice "required" or a named function (the output '
                                'is then constrained to the tools\' JSON schemas), or "none"', "tool_choice",
                           code="unsupported_parameter")
        return choice

    def max_tokens(self, prompt_len: int, max_tokens: int | None, default: int | None, prompt_param: str) -> int:
        if self.max_prompt_tokens and prompt_len > self.max_prompt_tokens:
            raise ApiError(400, f"This proxy accepts prompts of at most {self.max_prompt_tokens} tokens "
                                f"(proxy.max_prompt_tokens). However, your prompt has {prompt_len} tokens.",
                           prompt_param, code="prompt_too_long")
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                                f"prompt has {prompt_len} tokens, leaving no room for output.", prompt_param)
        if max_tokens is None:
            max_tokens = room if default is None else min(default, room)
        if prompt_len + max_tokens > self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                                f"for the completion). Please reduce the prompt or max_tokens.", "max_tokens")
        return max_tokens

    def request_id(self, call: Call) -> str | None:
        """The client's x-request-id, validated (None when there is none)."""
        value = call.headers.get("x-request-id")
        if value is None:
            return None
        if not _REQUEST_ID.fullmatch(value):
            raise ApiError(400, "x-request-id must be 1 to 128 visible ASCII characters (no spaces)", "x-request-id",
                           code="invalid_request_id")
        call.echo_id = value
        return value
