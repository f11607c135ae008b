"""The proxy's /openapi.json: FastAPI's document of its decorated routes plus the msgspec-decoded POST routes,
described from the same structs that decode them (daemons/proxy/api/protocol.py)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from daemons.cli import package_version
from daemons.proxy.api.protocol import (
    ChatRequest, CompletionRequest, DetokenizeRequest, ErrorResponse, LoadLoraAdapterRequest, TokenizeRequest,
    UnloadLoraAdapterRequest, document_schemas, openapi_components,
)

_BODY_ROUTES = [  # (path, struct, summary, streams)
    ("/v1/completions", CompletionRequest, "Create a completion", True),
    ("/v1/chat/completions", ChatRequest, "Create a chat completion", True),
    ("/tokenize", TokenizeRequest, "Tokenize a prompt or chat messages (vLLM's route)", False),
    ("/detokenize", DetokenizeRequest, "Turn token ids into text (vLLM's route)", False),
    ("/v1/load_lora_adapter", LoadLoraAdapterRequest, "Load a LoRA adapter on the instances (vLLM's route)", False),
    ("/v1/unload_lora_adapter", UnloadLoraAdapterRequest, "Unload a LoRA adapter (vLLM's route)", False),
]
_ERRORS = {"400": "Bad request (the body names the parameter)", "404": "Unknown model", "409": "Request id in flight",
           "413": "Request body larger than proxy.max_body_bytes", "499": "The client went away",
           "503": "No instance can take the request", "504": "Request timed out"}


def needs_key(path: str) -> bool:
    """The routes that need an API key when proxy.api_keys_file is set."""
    return path.startswith("/v1/") or path in ("/v1", "/tokenize", "/detokenize")


def openapi_document(app: FastAPI, model: str, max_model_len: int, api_keys: bool = False,
                     metrics_token: bool = False) -> dict:
    """FastAPI's document of the decorated routes, plus the msgspec-decoded POST routes with their request
    schemas (from the same structs that decode them, narrowed to what this proxy serves) and the OpenAI
    error body; with ``api_keys`` (``metrics_token``), the bearer scheme on the routes that need it."""
    doc = get_openapi(title="llumnix-proxy", version=package_version(), routes=app.routes,
                      description="OpenAI-compatible API of a Llumnix cluster")
    refs, components = openapi_components([kind for _, kind, _, _ in _BODY_ROUTES] + [ErrorResponse])
    document_schemas(components, model, max_model_len)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)  # FastAPI's 422 body: never sent here
    schemas.pop("ValidationError", None)
    schemas.update(components)
    error = {"content": {"application/json": {"schema": refs[-1]}}}
    header = {"name": "x-request-id", "in": "header", "required": False,
              "description": "the request id (echoed back); 1 to 128 visible ASCII characters",
              "schema": {"type": "string", "pattern": "^[!-~]{1,128}$"}}
    priority = {"name": "x-llumnix-priority", "in": "header", "required": False,
                "schema": {"type": "string", "enum": ["normal", "high"]}}
    examples = {
        "/v1/completions": {"model": model, "prompt": "Hello", "max_tokens": 8},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
        "/tokenize": {"model": model, "prompt": "Hello"},
        "/detokenize": {"model": model, "tokens": [5, 6, 7]},
        "/v1/load_lora_adapter": {"lora_name": "sql", "lora_path": "/models/sql-lora"},
        "/v1/unload_lora_adapter": {"lora_name": "sql"},
    }
    for (path, _, summary, streams), ref in zip(_BODY_ROUTES, refs):
        ok = {"application/json": {"schema": {"type": "object"}}}
        if path.endswith("_lora_adapter"):  # vLLM answers these with a line of text
            ok = {"text/plain": {"schema": {"type": "string"}}}
        if streams:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        op = {"summary": summary, "operationId": path.strip("/").replace("/", "_"),
              "requestBody": {"required": True,
                              "content": {"application/json": {"schema": ref, "example": examples[path]}}},
              "responses": {"200": {"description": "OK", "content": ok},
                            **{code: {"description": text, **error} for code, text in _ERRORS.items()
                               if streams or code in ("400", "404", "413")}}}
        if streams:
            op["parameters"] = [header, priority]
        doc["paths"][path] = {"post": op}
    for path, item in doc["paths"].items():  # the decorated routes answer errors with the same body
        for op in item.values():
            op.setdefault("responses", {}).pop("422", None)
            if path == "/v1/models/{model_id}":
                op["responses"]["404"] = {"description": "Unknown model", **error}
                for param in op.get("parameters", []):
                    param["example"] = model
            if (api_keys and needs_key(path)) or (metrics_token and path == "/metrics"):
                op["security"] = [{"bearer": []}]
                op["responses"]["401"] = {"description": "No API key, or an unknown or revoked one"
                                          if path != "/metrics" else "No token, or the wrong one", **error}
                if api_keys and path in ("/v1/completions", "/v1/chat/completions"):
                    op["responses"]["403"] = {"description": "Priority high from a key without high_priority", **error}
    if api_keys or metrics_token:
        doc["components"]["securitySchemes"] = {"bearer": {
            "type": "http", "scheme": "bearer",
            "description": "an API key of proxy.api_keys_file" if api_keys else "the metrics token"}}
    return doc
