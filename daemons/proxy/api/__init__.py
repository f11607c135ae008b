"""The proxy's OpenAI surface: the request and response schema (protocol.py, errors.py, openapi.py),
structured output and forced tool calls (structured.py, toolcalls.py), the tokenizer (tokenizer.py), and how one
request's token outputs become OpenAI text, whole or as server-sent events (render.py, output.py).

May import: ``Stream`` from daemons/proxy/cluster/stream.py (the token outputs it renders); nothing of the
HTTP front (daemons/proxy/front/), the facade or the app.
"""
