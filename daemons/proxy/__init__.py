"""llumnix-proxy: the OpenAI-compatible HTTP front end."""
