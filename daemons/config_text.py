"""The settings as text: ``llumnix.toml.example`` (every setting at its default, with its meaning, rendered from the
declaration in daemons/config.py; ``llumnixctl config example``) and a loaded config as plain data (``llumnixctl
config show``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from daemons.config import SYSTEM_CONFIG, Config, sections


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def render_example() -> str:
    """The text of llumnix.toml.example: every setting at its default, with its meaning."""
    lines = [
        "# llumnix.toml: every setting, at its default, with one line of meaning.",
        "# Used by llumnix-manager, llumnix-instance, llumnix-proxy and llumnixctl (--config FILE, else $LLUMNIX_CONFIG,",
        f"# else {SYSTEM_CONFIG} if it exists).",
        "# Command-line flags and --set section.key=value override the file. Regenerate: llumnixctl config example",
    ]
    for name, cls in sections():
        lines += ["", f"[{name}]"]
        for f in dataclasses.fields(cls):
            lines.append(f"# {f.metadata['help']}")
            lines.append(f"{f.name} = {_toml_value(f.default)}")
    return "\n".join(lines) + "\n"


def as_dict(cfg: Config) -> dict:
    return {name: dataclasses.asdict(getattr(cfg, name)) for name, _ in sections()}
