"""The proxy's other routes: models, tokenize, detokenize, health."""

from __future__ import annotations

from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from daemons.proxy.front.checks import Checks
from daemons.proxy.api.protocol import ApiError, DetokenizeRequest, TokenizeRequest, decode_body


class Routes:
    """Receives the request checks (with the tokenizer and the model), and the cluster's ``alive`` (the
    instances that take requests) and ``manager_ok``."""

    def __init__(self, checks: Checks, alive: Callable[[], list], manager_ok: Callable[[], bool]):
        self.checks = checks
        self.tokenizer = checks.tokenizer
        self.model = checks.model
        self.max_model_len = checks.max_model_len
        self.alive = alive
        self.manager_ok = manager_ok

    def model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "llumnix", "root": self.model,
                "max_model_len": self.max_model_len}

    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_info(self, model_id: str) -> dict:
        if model_id != self.model:
            raise ApiError(404, f"The model `{model_id}` does not exist. This proxy serves `{self.model}`.", "model",
                           code="model_not_found")
        return self.model_card()

    async def tokenize(self, request: Request) -> Response:
        req = decode_body(await request.body(), TokenizeRequest)
        self.checks.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give either `prompt` or `messages`", "prompt" if req.prompt is None else "messages")
        if req.messages is not None:
            text = self.checks.chat_prompt(req, req.add_generation_prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
        body = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": [self.tokenizer.token_str(t) for t in ids] if req.return_token_strs else None}
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        req = decode_body(await request.body(), DetokenizeRequest)
        self.checks.check_model(req.model)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is out of range for this model's vocabulary (0..{vocab - 1})", "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode_all(req.tokens)})

    def health(self) -> Response:
        alive = len(self.alive())
        body = {"status": "ok" if alive else "unavailable", "instances_alive": alive,
                "manager": "ok" if self.manager_ok() else "unreachable"}
        return JSONResponse(body, status_code=200 if alive else 503)

