"""The man pages' option tables, synopses and setting headers, made from the code so that they cannot drift.

``python -m llumnixctl.lab.manpages`` rewrites the pages in man/ in place; with ``--check`` it changes nothing,
prints a unified diff of every page that is not what it makes and exits 1 (tests/unit/test_docs_drift.py checks too).

Generated from the Typer apps (llumnixctl's ``app``, each daemon's ``app``; read through click's own
introspection, ``list_commands`` and ``get_command``; hidden commands left out):
the body of every block between ``.\\" generated: ID (...)`` and ``.\\" end generated``:
  - ``synopsis`` (SYNOPSIS of llumnixctl(1) and the daemons' pages): every command, in the app's order, with
    its arguments and options; llumnixctl's own options (actions that exit) as alternatives;
  - ``options: COMMAND`` (the end of each ``.SS "COMMAND"`` subsection of COMMANDS in llumnixctl(1)) and
    ``options`` (OPTIONS of a daemon's page): a ``.TP`` entry per argument and option with its names, its
    Typer help, default, bounds, repetition and environment variable.  A command without a subsection gets
    one at the end of COMMANDS; a subsection whose block names a command that is gone is dropped whole.
From the config declaration (daemons/config.py), in SETTINGS of llumnix.toml(5): in each ``.SS [table]``
subsection, the line after a ``.TP`` that starts ``.BR key " (``, rewritten as ``key (type, default X,
minimum A, maximum B, one of C)``.  A declared setting without an entry gets one (that line and the
setting's help) after the last entry of its table (a new ``.SS [table]`` at the end of SETTINGS if need be);
the entry of a setting no longer declared (its line and the text under it, up to the next ``.TP``, ``.PP``,
``.SS`` or ``.SH``) is dropped, and so is the subsection of a table no longer declared.

Hand-written, and kept byte for byte: everything else, the text under each setting's line included.  Help
strings are plain text; flags, declared settings, ``$VARIABLES`` and `quoted` words are set in bold here.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import re
import sys
import typing
from pathlib import Path
from typing import Callable

import typer.main

from daemons import config

MAN = Path(__file__).resolve().parents[2] / "man"
PAGES = ("llumnixctl.1", "llumnix-manager.8", "llumnix-instance.8", "llumnix-proxy.8", "llumnix.toml.5")
DAEMONS = {"llumnix-manager.8": ("llumnix-manager", "daemons.manager"),
           "llumnix-instance.8": ("llumnix-instance", "daemons.instance"),
           "llumnix-proxy.8": ("llumnix-proxy", "daemons.proxy.app")}
END = '.\\" end generated'
BEGIN = re.compile(r'^\.\\" generated: (.+?) \(')

# The word an option's value is shown with when the option declares no metavar: the daemons' options declare
# none (and llumnixctl's shared ones read the same), else the type says it.
WORDS = {"--config": "file", "--set": "section.key=value", "--manager": "addr", "--address": "addr",
         "--bind": "addr", "--host": "addr", "--request-address": "addr", "--port": "port",
         "--metrics-port": "port", "--run-dir": "dir", "--timeout": "seconds", "--log-level": "level",
         "--dispatch-policy": "policy", "--id": "id", "--backend": "backend"}
TYPE_WORDS = {int: "n", float: "x", Path: "path", str: "text"}
SETTING_TYPES = {"str": "string", "int": "integer", "float": "float", "bool": "boolean"}


def begin(block_id: str) -> str:
    return f'.\\" generated: {block_id} (python -m llumnixctl.lab.manpages rewrites this block from the code; edit the code)'


# ---------------------------------------------------------------------------------------------- roff text


def word(text: str) -> str:
    """Literal text to type (a flag, a value): every hyphen a minus, as the pages write them."""
    return text.replace("\\", "\\e").replace("-", "\\-")


@functools.cache
def _settings() -> set[str]:
    return {f"{table}.{f.name}" for table, cls in config.sections() for f in dataclasses.fields(cls)}


_TOKEN = re.compile(r"`([^`]+)`|(?<![\w/.-])(--[a-z][\w-]*|-[A-Za-z]\b)|(\$[A-Z_][A-Z0-9_]*)"
                    r"|(?<![\w.-])(-)(?=\d)|\b([a-z]+\.[a-z_]+)\b")


def prose(text: str) -> str:
    """A help string as a roff text line: flags, declared settings, $VARIABLES and `quoted` words in bold."""
    text, known, out, at = " ".join(text.split()), _settings(), [], 0
    for m in _TOKEN.finditer(text):
        code, flag, var, minus, setting = m.groups()
        out.append(text[at:m.start()].replace("\\", "\\e"))
        if minus:
            out.append("\\-")
        elif setting and setting not in known:
            out.append(setting)
        else:
            out.append(f"\\fB{word(code or flag or var or setting)}\\fR")
        at = m.end()
    line = "".join(out) + text[at:].replace("\\", "\\e")
    return "\\&" + line if line[:1] in (".", "'") else line


def _num(value: float) -> str:
    """3, 0.5: a bound as a person writes it."""
    return word(str(int(value)) if isinstance(value, int) or value.is_integer() else repr(value))


# ---------------------------------------------------------------------------------------- Typer commands


def commands(cli, path: tuple[str, ...] = ()) -> list[tuple[str, object]]:
    """(``"bench proxy"``, command) for every visible command, in the order the app lists them."""
    if not hasattr(cli, "list_commands"):  # Typer has its own click: a group is told by what it has
        return [(" ".join(path), cli)]
    out = []
    for name in cli.list_commands(None):  # no context: the groups list and look up without one
        sub = cli.get_command(None, name)
        if sub is not None and not sub.hidden:
            out += commands(sub, path + (name,))
    return out


def _params(cmd) -> list:
    return [p for p in cmd.params if not p.hidden]


def _is_option(p) -> bool:
    return p.param_type_name == "option"


def _is_flag(p) -> bool:
    return _is_option(p) and p.is_flag


def _names(p) -> list[str]:
    """Short names first, then long ones, then the --no-x of a boolean pair."""
    return sorted(p.opts, key=lambda o: o.startswith("--")) + list(p.secondary_opts)


def _metavar(p) -> str:
    """``file``; ``sim|vllm`` for a choice (a metavar with ``|``, or a click Choice)."""
    if p.metavar:
        return p.metavar.lower()
    desc = p.type_descriptor
    if desc.is_choice and desc.choices:
        return "|".join(str(getattr(c, "value", c)) for c in desc.choices)  # an Enum's members, or Literal's
    if not _is_option(p):
        return p.name
    long = next((o for o in p.opts if o.startswith("--")), "")
    kind = (typing.get_args(desc.annotation) or [desc.annotation])[0] if desc.is_list else desc.annotation
    return WORDS.get(long) or TYPE_WORDS.get(kind, "value")


def _synopsis_param(p) -> list[str]:
    if not _is_option(p):
        name, more = word(_metavar(p)), "..." if p.nargs == -1 else ""
        return [f".I {name}{more}" if p.required else f".RI [ {name} ]{more}"]
    if _is_flag(p):
        return [".RB [ " + " | ".join(word(n) for n in [_names(p)[0], *p.secondary_opts]) + " ]"]
    name, value = word(_names(p)[0]), _metavar(p)
    close = "" if p.required else " ]" + ("..." if p.multiple else "")
    value_line = (f".BR {' | '.join(map(word, value.split('|')))}{close}" if "|" in value
                  else f".IR {word(value)}{close}" if close else f".I {word(value)}")
    return [f".B {name}" if p.required else f".RB [ {name}", value_line]


def synopsis(prog: str, cmd) -> list[str]:
    lines = [f".B {word(prog)}"]
    for p in _params(cmd):
        lines += _synopsis_param(p)
    return lines


def _default(p) -> str | None:
    value = p.default
    if callable(value) or value is None or value is False or value in ("", (), []):
        return None
    if value is True:
        return word(_names(p)[0]) if _is_flag(p) else "true"
    if isinstance(value, (list, tuple)):
        return ", ".join(word(str(v)) for v in value)
    return _num(value) if isinstance(value, (int, float)) else word(str(value))


def _facts(p) -> str:
    """Default, bounds, repetition, environment: what the code knows about an option besides its help."""
    facts = ["Required."] if p.required and _is_option(p) else []
    if (default := _default(p)) is not None:
        facts.append(f"Default: \\fB{default}\\fR.")
    low, high = getattr(p, "min", None), getattr(p, "max", None)
    if low is not None or high is not None:
        facts.append(f"From {_num(low)} to {_num(high)}." if low is not None and high is not None
                     else f"At least {_num(low)}." if low is not None else f"At most {_num(high)}.")
    if getattr(p, "multiple", False) or p.nargs == -1:
        facts.append("May be given more than once.")
    envvars = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar or [])
    if envvars:
        facts.append("Environment: " + ", ".join(f"\\fB${word(v)}\\fR" for v in envvars) + ".")
    return " ".join(facts)


def _entry_head(p) -> str:
    if not _is_option(p):
        return f".I {word(_metavar(p))}"
    pieces = []
    for i, name in enumerate(_names(p)):
        pieces += ['", "'] * bool(i) + [word(name)]
    if not _is_flag(p):
        value = _metavar(p)
        shown = "|".join(f"\\fB{word(v)}\\fR" for v in value.split("|")) if "|" in value else f"\\fI{word(value)}\\fR"
        pieces.append(f'" {shown}"')
    return f".B {pieces[0]}" if len(pieces) == 1 else ".BR " + " ".join(pieces)


def option_table(cmd) -> list[str]:
    lines = []
    for p in _params(cmd):
        facts = _facts(p)
        lines += [".TP", _entry_head(p)] + ([prose(p.help)] + [".br"] * bool(facts) if p.help else [])
        lines += [facts] if facts else []
    return lines


# -------------------------------------------------------------------------------------------- blocks


def _split(lines: list[str], heading: str) -> list[list[str]]:
    """The lines cut before every line that starts with ``heading``: [before the first, first, second, ...]."""
    chunks: list[list[str]] = [[]]
    for line in lines:
        if line.startswith(heading):
            chunks.append([])
        chunks[-1].append(line)
    return chunks


def _section(lines: list[str], title: str) -> tuple[int, int]:
    """[start, end) of ``.SH title``'s body."""
    start = lines.index(f".SH {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(".SH ")), len(lines))
    return start, end


def _block_ids(lines: list[str]) -> list[str]:
    return [m.group(1) for line in lines if (m := BEGIN.match(line))]


def fill_blocks(lines: list[str], make: Callable[[str], list[str]]) -> list[str]:
    """Every block's body replaced by ``make(block_id)``."""
    out, i = [], 0
    while i < len(lines):
        if m := BEGIN.match(lines[i]):
            out += [begin(m.group(1)), *make(m.group(1)), END]
            i = lines.index(END, i) + 1  # ValueError: a block left open
        else:
            out.append(lines[i])
            i += 1
    return out


def _need(lines: list[str], page: str, *ids: str) -> None:
    missing = set(ids) - set(_block_ids(lines))
    if missing:
        raise ValueError(f"man/{page} has no generated block {sorted(missing)}: add the lines {begin('ID')!r} "
                         f"and {END!r} where it belongs, then run python -m llumnixctl.lab.manpages")


def _render_llumnixctl(lines: list[str]) -> list[str]:
    from llumnixctl.main import app  # imported on use: its lab commands pull in the engines and benchmarks

    cli = typer.main.get_command(app)
    cmds = dict(commands(cli))
    _need(lines, "llumnixctl.1", "synopsis")
    start, end = _section(lines, "COMMANDS")
    head, *subsections = _split(lines[start:end], ".SS ")
    body, seen = head, set()
    for sub in subsections:
        title = m.group(1) if (m := re.match(r'\.SS "(.+)"$', sub[0])) else None
        ids = [i.removeprefix("options: ") for i in _block_ids(sub) if i.startswith("options: ")]
        if title in cmds:
            seen.add(title)
            if f"options: {title}" not in _block_ids(sub):
                sub = sub + [begin(f"options: {title}"), END]
        elif any(i not in cmds for i in ids):
            continue  # the command is gone: so is what the page said of it
        body += sub
    for name in [n for n in cmds if n not in seen]:
        about = (cmds[name].help or "").split("\n\n")[0]  # the docstring's first paragraph
        body += [f'.SS "{name}"', *([prose(about)] if about else []), begin(f"options: {name}"), END]
    lines = lines[:start] + body + lines[end:]

    def make(block_id: str) -> list[str]:
        if block_id == "synopsis":
            out = []
            for name, cmd in cmds.items():
                out += synopsis(f"llumnixctl {name}", cmd) + [".PP"]
            actions = [word(n) for p in _params(cli) for n in _names(p)]
            return out + [".B llumnixctl", '.BR ' + ' " | " '.join(actions)]
        if block_id.removeprefix("options: ") not in cmds:
            raise ValueError(f"man/llumnixctl.1: a generated block {block_id!r} outside its command's subsection")
        return option_table(cmds[block_id.removeprefix("options: ")])

    return fill_blocks(lines, make)


def _render_daemon(page: str, lines: list[str]) -> list[str]:
    cmd = typer.main.get_command(importlib.import_module(DAEMONS[page][1]).app)
    _need(lines, page, "synopsis", "options")
    made = {"synopsis": synopsis(DAEMONS[page][0], cmd), "options": option_table(cmd)}

    def make(block_id: str) -> list[str]:
        if block_id not in made:
            raise ValueError(f"man/{page}: unknown generated block {block_id!r} (known: {', '.join(made)})")
        return made[block_id]

    return fill_blocks(lines, make)


# -------------------------------------------------------------------------------------- llumnix.toml(5)

_HEADER = re.compile(r'\.BR (\w+) " \(')
_ENDS_ENTRY = (".TP", ".PP", ".SS ", ".SH ")


def setting_header(f: dataclasses.Field) -> str:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    value = f.default
    shown = ("true" if value else "false") if isinstance(value, bool) else (
        "\\(dq" + word(value).replace('"', "\\(dq") + "\\(dq" if isinstance(value, str) else word(repr(value)))
    shown = f'"{shown}"' if " " in shown else shown  # one roff argument
    extra = [f"{bound} {_num(f.metadata[bound])}" for bound in ("minimum", "maximum") if f.metadata.get(bound) is not None]
    if f.metadata.get("choices"):
        extra.append("one of " + ", ".join(word(c) for c in f.metadata["choices"]))
    tail = f'", {", ".join(extra)})"' if extra else ")"
    return f'.BR {f.name} " ({SETTING_TYPES[kind]}, default " {shown} {tail}'


def _render_table(lines: list[str], fields: dict[str, dataclasses.Field]) -> list[str]:
    out, i, last, seen = [], 0, None, set()
    while i < len(lines):
        m = _HEADER.match(lines[i + 1]) if lines[i] == ".TP" and i + 1 < len(lines) else None
        if not m:
            out.append(lines[i])
            i += 1
            continue
        key, end = m.group(1), next((j for j in range(i + 2, len(lines)) if lines[j].startswith(_ENDS_ENTRY)), len(lines))
        if key in fields:
            seen.add(key)
            out += [".TP", setting_header(fields[key]), *lines[i + 2:end]]
            last = len(out)
        i = end
    new = []
    for key, f in fields.items():
        if key not in seen:
            new += [".TP", setting_header(f), prose(f.metadata["help"])]
    at = last if last is not None else len(out)
    return out[:at] + new + out[at:]


def _render_settings(lines: list[str]) -> list[str]:
    tables = {table: {f.name: f for f in dataclasses.fields(cls)} for table, cls in config.sections()}
    start, end = _section(lines, "SETTINGS")
    head, *subsections = _split(lines[start:end], ".SS ")
    body, seen = head, set()
    for sub in subsections:
        m = re.match(r"\.SS \[(\w+)\]$", sub[0])
        if m and m.group(1) not in tables:
            continue  # a table that is no longer declared
        if m:
            seen.add(m.group(1))
            sub = [sub[0], *_render_table(sub[1:], tables[m.group(1)])]
        body += sub
    for table in tables:
        if table not in seen:
            body += [f".SS [{table}]", *_render_table([], tables[table])]
    return lines[:start] + body + lines[end:]


# ------------------------------------------------------------------------------------------------ pages


def render(name: str, text: str) -> str:
    """The page ``name`` (one of PAGES) with its generated parts made from the code; the rest as ``text`` has it."""
    lines = text.split("\n")
    if name == "llumnix.toml.5":
        lines = _render_settings(lines)
    elif name == "llumnixctl.1":
        lines = _render_llumnixctl(lines)
    elif name in DAEMONS:
        lines = _render_daemon(name, lines)
    else:
        raise ValueError(f"{name}: not a generated page (pages: {', '.join(PAGES)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llumnixctl.lab.manpages",
                                     description="Rewrite the man pages' generated parts from the code.")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; print a diff of every page the generator would change and exit 1")
    args = parser.parse_args(argv)
    stale = []
    for name in PAGES:
        path = MAN / name
        text = path.read_text()
        new = render(name, text)
        if new == text:
            continue
        stale.append(name)
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                       f"man/{name}", f"man/{name} (generated)"))
        else:
            path.write_text(new)
            print(f"rewrote {path}")
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run python -m llumnixctl.lab.manpages", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
