"""Command-line plumbing shared by the daemons: the config, --version, the console entry points."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import sys
from typing import Annotated, Any, Callable, Optional

import typer

from daemons import runtime
from daemons.config import Config, ConfigError, load_config

DISTRIBUTION = "llumnix-toolkit"  # pyproject.toml's [project] name


def package_version() -> str:
    """The installed distribution's version, as `--version` prints it."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


# The options every daemon has, declared once (their help is what each daemon's --help and man page show).
ConfigFile = Annotated[Optional[str], typer.Option(
    "--config", "-c", help="read settings from this file (default: $LLUMNIX_CONFIG, else /etc/llumnix/llumnix.toml "
                           "if it exists, else none: the defaults)")]


def LogLevel(section: str) -> Any:  # noqa: N802 (a type, as the daemons' signatures use it)
    return Annotated[Optional[str], typer.Option(help=f"debug, info, warning or error ({section}.log_level)")]


def Overrides(more_help: str = "") -> Any:  # noqa: N802
    """``--set section.key=value``, repeatable; ``more_help`` follows the common help."""
    return Annotated[Optional[list[str]], typer.Option("--set", help="override any setting: section.key=value" + more_help)]


def load_or_exit(prog: str, path: str | None, overrides: list[str] | None, flags: dict[str, Any]) -> Config:
    """Load the config or exit 2 with one line that names the key and the file.

    Also hands the daemon's ``log_format`` (``[manager]``, ``[instance]`` or ``[proxy]`` by ``prog``) to
    ``runtime.setup_logging``, which the daemon calls next."""
    try:
        cfg = load_config(path, overrides, flags)
    except ConfigError as exc:
        typer.echo(f"{prog}: error: {exc}", err=True)
        raise typer.Exit(2) from None
    section = getattr(cfg, prog.removeprefix("llumnix-"), None)
    runtime.set_log_format(getattr(section, "log_format", "text"))
    return cfg


def daemon_main(prog: str, path: str | None, overrides: list[str] | None, flags: dict[str, Any],
                start: Callable[[Config], Any]) -> None:
    """The three daemons' ``main``: the config (file, flags, ``--set``; exit 2 naming the key on a bad one), the
    daemon's logging, then ``start(cfg)`` (a coroutine, or a function making one) until SIGTERM. A
    ``runtime.StartupError`` raised by ``start`` or by what it runs is one log line and exit status 1."""
    cfg = load_or_exit(prog, path, overrides, flags)
    runtime.setup_logging(getattr(cfg, prog.removeprefix("llumnix-")).log_level, prog)
    runtime.exit_on_startup_error(prog, lambda: start(cfg))


def version_callback(prog: str):
    """The callback of an eager ``--version`` flag: print ``PROG VERSION`` and exit 0."""

    def show(value: bool) -> None:
        if value:
            typer.echo(f"{prog} {package_version()}")
            raise typer.Exit(0)

    return show


def with_version(main: Callable, prog: str) -> Callable:
    """``main`` (a typer command function) with one more option, ``--version``."""
    sig = inspect.signature(main, eval_str=True)
    version = inspect.Parameter("version", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
        bool, typer.Option("--version", is_eager=True, callback=version_callback(prog), help="Print the version and exit.")])

    @functools.wraps(main)
    def command(*args, version: bool = False, **kwargs):
        return main(*args, **kwargs)

    params = [*sig.parameters.values(), version]
    command.__signature__ = sig.replace(parameters=params)
    command.__annotations__ = {p.name: p.annotation for p in params} | {"return": sig.return_annotation}
    del command.__wrapped__  # typer reads the signature above, not main's
    return command


def run_app(app: typer.Typer, prog: str) -> None:
    """Run a daemon's single-command typer app as ``prog``, with ``--version`` added to its options."""
    info = app.registered_commands[0]
    info.callback = with_version(info.callback, prog)
    app(prog_name=prog)


def run_daemon(module: str, prog: str) -> None:
    if sys.argv[1:] == ["--version"]:  # answered before the daemon's modules (torch, the engines) are imported
        typer.echo(f"{prog} {package_version()}")
        return
    run_app(importlib.import_module(module).app, prog)


# Console entry points (pyproject.toml [project.scripts]): each daemon's app with --version.
def manager() -> None:
    run_daemon("daemons.manager", "llumnix-manager")


def instance() -> None:
    run_daemon("daemons.instance", "llumnix-instance")


def proxy() -> None:
    run_daemon("daemons.proxy.app", "llumnix-proxy")
