"""The proxy's other routes: models, tokenize, detokenize, health, and vLLM's LoRA routes (load and unload an
adapter, through the manager: daemons/manager/adapters.py)."""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from daemons.proxy.front.checks import Checks
from daemons import wire
from daemons.proxy.api.protocol import (ApiError, DetokenizeRequest, LoadLoraAdapterRequest, TokenizeRequest,
                                        UnloadLoraAdapterRequest, decode_body)


class Routes:
    """Receives the request checks (with the tokenizer, the model and the adapters served), and the cluster's
    ``alive`` (the instances that take requests), ``manager_ok`` and ``lora`` (a load or unload, asked of the
    manager: its reply, None without one; None: lora.api_updates is off, the LoRA routes answer 404)."""

    def __init__(self, checks: Checks, alive: Callable[[], list], manager_ok: Callable[[], bool],
                 lora: Callable[[str, str, str], Awaitable[wire.Message | None]] | None = None):
        self.checks = checks
        self.lora = lora
        self.tokenizer = checks.tokenizer
        self.model = checks.model
        self.max_model_len = checks.max_model_len
        self.alive = alive
        self.manager_ok = manager_ok

    def model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": "llumnix", "root": self.model,
                "max_model_len": self.max_model_len}

    def adapter_card(self, name: str, path: str) -> dict:
        """As vLLM lists an adapter: its directory as ``root``, the base model as ``parent``."""
        return {"id": name, "object": "model", "created": 0, "owned_by": "llumnix", "root": path,
                "parent": self.model, "max_model_len": self.max_model_len}

    def models(self) -> dict:
        adapters = self.checks.adapters()
        return {"object": "list", "data": [self.model_card(), *(self.adapter_card(n, adapters[n]) for n in sorted(adapters))]}

    def model_info(self, model_id: str) -> dict:
        if self.checks.check_model(model_id):
            return self.adapter_card(model_id, self.checks.adapters()[model_id])
        return self.model_card()

    async def load_lora_adapter(self, request: Request) -> Response:
        self._lora_updates()
        req = decode_body(await request.body(), LoadLoraAdapterRequest)
        name, path = req.lora_name, req.lora_path
        if not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not name else "lora_path")
        if name == self.model:
            raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.", "lora_name")
        known = self.checks.adapters().get(name)
        if known is not None and not (req.load_inplace and known == path):
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded (from {known}). If you want to "
                                f"load the adapter in place, set 'load_inplace' to True.", "lora_name")
        self._answered(await self._ask("load", name, path))
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        self._lora_updates()
        req = decode_body(await request.body(), UnloadLoraAdapterRequest)
        name = req.lora_name
        if not name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "lora_name")
        if name not in self.checks.adapters():
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", code="model_not_found")
        self._answered(await self._ask("unload", name, ""))
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    def _lora_updates(self) -> None:
        if self.lora is None:
            raise ApiError(404, "LoRA adapters are not loaded through this API here (lora.api_updates = false): "
                                "an operator loads them with `llumnixctl lora load`")

    async def _ask(self, op: str, name: str, path: str) -> wire.Message | None:
        return await self.lora(op, name, path)

    @staticmethod
    def _answered(reply: wire.Message | None) -> None:
        if reply is None:
            raise ApiError(503, "the manager did not answer; try again (LoRA adapters are loaded through it)")
        if isinstance(reply, wire.ErrorReply):
            raise ApiError(400, reply.message, "lora_path")

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

