"""The API keys the key tests use (tests/e2e/test_api_keys.py on a cluster, tests/unit/test_api_keys_file.py on the
file alone), here so that the unit tests need not import the e2e module (and the openai client it imports)."""

from __future__ import annotations

import hashlib

KEYS = {  # name: (key, high_priority, stored as sha256)
    "alice": ("sk-alice-5f1c0e2a9b7d4c3e8a6f", False, False),
    "boss": ("sk-boss-0a9b8c7d6e5f4a3b2c1d", True, False),
    "hashed": ("sk-hashed-77c1d2e3f4a5b6c7d8e9", False, True),
    "victim": ("sk-victim-3c4d5e6f7a8b9c0d1e2f", False, False),
    "hup": ("sk-hup-9e8d7c6b5a4f3e2d1c0b", False, False),
}
LIMITED = "sk-limited-6a7b8c9d0e1f2a3b4c5d"
METRICS_TOKEN = "metrics-token-4b5c6d7e8f9a"


def render(disabled: set[str] = frozenset()) -> str:
    """The keys file; every entry is as long whatever its state, so disabling one keeps the file's size."""
    out = []
    for name, (key, high, hashed) in KEYS.items():
        out.append(f"[keys.{name}]")
        out.append(f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"' if hashed else f'key = "{key}"')
        if high:
            out.append("high_priority = true")
        out.append("enabled = false" if name in disabled else "enabled = true ")
        out.append("")
    out.append(f'[keys.limited]\nkey = "{LIMITED}"\nrequests_per_minute = 1\n')  # tenants: one request a minute
    return "\n".join(out)
