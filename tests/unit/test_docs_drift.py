"""The man pages cannot drift from the code: their synopses, option tables and setting headers are what
llumnixctl/lab/manpages.py makes from the Typer apps and the config declaration; every setting of the
declaration is documented in llumnix.toml(5) under its table with its type, default and bounds, and nothing
else is; every command and flag of llumnixctl and of each daemon is in its page, and no page names a flag that
does not exist."""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path

import pytest
import typer.main

from daemons import config
from llumnixctl.lab import manpages

ROOT = Path(__file__).resolve().parents[2]
MAN = ROOT / "man"
TYPES = {str: "string", int: "integer", float: "float", bool: "boolean"}


def _unroff(text: str) -> str:
    return text.replace("\\(dq", '"').replace("\\-", "-").replace("\\(mu", "x").replace("\\e", "\\")


def _documented_settings() -> dict[tuple[str, str], str]:
    """(table, key) -> the text in parentheses after the key, as llumnix.toml(5) has it."""
    out: dict[tuple[str, str], str] = {}
    section = None
    lines = (MAN / "llumnix.toml.5").read_text().splitlines()
    for prev, line in zip([""] + lines, lines):
        if m := re.match(r"\.SS \[(\w+)\]$", line):
            section = m.group(1)
        elif line.startswith(".SH "):
            section = None
        elif section and prev == ".TP" and (m := re.match(r'\.BR (\w+) " \((.*)$', line)):
            assert (section, m.group(1)) not in out, f"[{section}] {m.group(1)} is documented twice"
            out[(section, m.group(1))] = _unroff(m.group(2).replace('" ', "").replace(' "', "")).rstrip(')"').strip()
    return out


def _render_default(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def test_every_setting_is_documented_with_its_type_default_and_bounds():
    documented = _documented_settings()
    declared = {}
    for table, cls in config.sections():
        for f in dataclasses.fields(cls):
            declared[(table, f.name)] = f
    missing = sorted(set(declared) - set(documented))
    extra = sorted(set(documented) - set(declared))
    assert not missing, f"settings without an entry in man/llumnix.toml.5: {missing}"
    assert not extra, f"man/llumnix.toml.5 documents settings that do not exist: {extra}"
    wrong = []
    for key, f in declared.items():
        text = documented[key]
        kind = TYPES.get(config._field_type(f) if hasattr(config, "_field_type") else type(f.default))
        if kind and not text.startswith(kind):
            wrong.append(f"[{key[0]}] {key[1]}: type {kind!r}, page says {text!r}")
        if f"default {_render_default(f.default)}" not in text:
            wrong.append(f"[{key[0]}] {key[1]}: default {_render_default(f.default)}, page says {text!r}")
        low, high = f.metadata.get("minimum"), f.metadata.get("maximum")
        said = {"minimum": low, "maximum": high}
        if low is not None and high is not None and re.search(rf"\b{low:g} to {high:g}$", text):
            said = {}
        for bound, value in said.items():
            if value is not None and not re.search(rf"{bound} ({re.escape(repr(value))}|{value:g})\b", text):
                wrong.append(f"[{key[0]}] {key[1]}: {bound} {value!r}, page says {text!r}")
    assert not wrong, "man/llumnix.toml.5 disagrees with daemons/config.py:\n" + "\n".join(wrong)


# Typer carries its own copy of click (typer._click): commands and options are told apart by what they have.
def _is_group(cmd) -> bool:
    return hasattr(cmd, "list_commands")


def _commands(cmd, path: tuple[str, ...] = ()) -> dict:
    """Every command under ``cmd``, as click lists them (llumnixctl adds its lab commands when listed)."""
    out = {path: cmd}
    if _is_group(cmd):
        for name in cmd.list_commands(None):
            out.update(_commands(cmd.get_command(None, name), path + (name,)))
    return out


def _flags(cmd) -> set[str]:
    return {o for p in cmd.params if p.param_type_name == "option" for o in p.opts + p.secondary_opts
            if o.startswith("--") and o != "--help"}


def _page_flags(page: str) -> set[str]:
    return set(re.findall(r"(--[a-z][a-z0-9-]*)", _unroff(page)))


def _cli_pages():
    from llumnixctl.main import app

    yield "llumnixctl.1", typer.main.get_command(app), True
    for daemon, module in (("llumnix-manager", "daemons.manager"), ("llumnix-instance", "daemons.instance"),
                           ("llumnix-proxy", "daemons.proxy.app")):
        mod = __import__(module, fromlist=["app"])
        yield f"{daemon}.8", typer.main.get_command(mod.app), False


@pytest.mark.parametrize("page_name", ["llumnixctl.1", "llumnix-manager.8", "llumnix-instance.8", "llumnix-proxy.8"])
def test_every_command_and_flag_is_in_its_page_and_the_page_names_no_other(page_name):
    cli, has_commands = next((c, h) for p, c, h in _cli_pages() if p == page_name)
    page = (MAN / page_name).read_text()
    text = _unroff(page)
    commands = _commands(cli)
    flags: set[str] = set()
    missing = []
    for path, cmd in commands.items():
        if has_commands and path and not _is_group(cmd) and f"llumnixctl {' '.join(path)}" not in text:
            missing.append(f"command `llumnixctl {' '.join(path)}`")
        for p in cmd.params:
            if p.param_type_name != "option":
                continue
            names = [o for o in p.opts + p.secondary_opts if o.startswith("--") and o != "--help"]
            flags.update(names)
            # A boolean pair (--x/--no-x) is documented by either of its names.
            if names and not any(re.search(rf"{re.escape(n)}(?![a-z0-9-])", text) for n in names):
                flag = names[0]
                missing.append(f"{flag} of `{' '.join(('llumnixctl',) + path) if has_commands else page_name}`")
    assert not missing, f"man/{page_name} lacks: {missing}"
    # A flag in the page that no command has: renamed or removed, and the page not updated. A daemon's page
    # may quote llumnixctl's commands too.
    known = flags | {"--help"} | QUOTED | (set() if has_commands else _all_flags(next(_cli_pages())[1]))
    foreign = {f for f in _page_flags(page) if f not in known}
    assert not foreign, f"man/{page_name} names flags that no command has: {sorted(foreign)}"


# Other programs' flags that the pages quote: `systemctl enable --now`.
QUOTED = {"--now"}


def _all_flags(cli) -> set[str]:
    return {f for cmd in _commands(cli).values() for f in _flags(cmd)}


# ------------------------------------------------------------------ generated parts


@pytest.mark.parametrize("page_name", manpages.PAGES)
def test_the_man_pages_are_what_the_generator_makes(page_name):
    text = (MAN / page_name).read_text()
    made = manpages.render(page_name, text)
    diff = "".join(difflib.unified_diff(text.splitlines(True), made.splitlines(True), f"man/{page_name}",
                                        f"man/{page_name} (generated)"))
    assert made == text, (f"man/{page_name} is not what the generator makes of the code: run "
                          f"`.venv/bin/python -m llumnixctl.lab.manpages` and commit the pages\n{diff}")


def _cut(text: str, first: str, last: str, keep_ends: bool = False) -> str:
    """``text`` without the lines from the one equal to ``first`` to the next one equal to ``last``."""
    lines = text.split("\n")
    i = lines.index(first)
    j = lines.index(last, i + 1)
    return "\n".join(lines[:i + keep_ends] + lines[j + 1 - keep_ends:])


def test_the_generator_rewrites_the_setting_lines_and_entries():
    text = (MAN / "llumnix.toml.5").read_text()
    line = '.BR heartbeat_interval_s " (float, default " 0.5 ", minimum 0.01)"'
    assert line in text
    wrong = text.replace(line, '.BR heartbeat_interval_s " (integer, default " 9 ", maximum 2)"')
    bind = '.TP\n.BR bind " ('
    gone = wrong.replace(bind, '.TP\n.BR no_such_key " (integer, default " 1 )\nGone.\n' + bind)
    assert gone.count("no_such_key") == 1
    assert manpages.render("llumnix.toml.5", gone) == text

    entry = '.BR retry_after_s " (integer, default " 1 ", minimum 0)"'
    lines = text.split("\n")
    at = lines.index(entry)
    end = next(i for i in range(at + 1, len(lines)) if lines[i].startswith((".TP", ".PP", ".SS")))
    missing = "\n".join(lines[:at - 1] + lines[end:])  # without its .TP, its line and its text
    made = manpages.render("llumnix.toml.5", missing).split("\n")
    back = made.index(entry)  # added again, with the declaration's help
    declared = next(f for f in dataclasses.fields(config.AdmissionConfig) if f.name == "retry_after_s")
    assert made[back - 1] == ".TP" and made[back + 1] == manpages.prose(declared.metadata["help"])
    assert "\n".join(made).count("retry_after_s \"") == 1


def test_the_generator_rewrites_the_synopsis_and_the_option_tables():
    text = (MAN / "llumnixctl.1").read_text()
    lines = text.split("\n")
    proxies = lines.index(".RB [ \\-\\-proxies", lines.index(".B llumnixctl up"))
    assert lines[proxies + 1].startswith(".IR ")
    del lines[proxies:proxies + 2]  # --proxies left out of the synopsis
    table = lines.index(manpages.begin("options: up"))
    assert lines[table + 1] == ".TP" and lines[table + 3] != "old words"
    lines[table + 3] = "old words"  # the first option's help
    broken = _cut("\n".join(lines), manpages.begin("options: down"), manpages.END)  # the whole table of `down`
    assert manpages.render("llumnixctl.1", broken) == text

    page = (MAN / "llumnix-proxy.8").read_text()
    emptied = _cut(page, manpages.begin("options"), manpages.END, keep_ends=True)
    assert "\\-\\-port" not in emptied.split(".SH OPTIONS")[1].split(".SH SIGNALS")[0]
    assert manpages.render("llumnix-proxy.8", emptied) == page
