"""llumnixctl's command group: the operator's commands (llumnixctl/main.py, operate.py) are built with the
app; those of the lab and the experiments are imported only when one of them, or the whole list (help,
completion, the man pages), is asked for, so that an operator command loads none of them."""

from __future__ import annotations

import signal

import typer
import typer.core
import typer.main


def lab_commands() -> typer.Typer:
    """The commands of the lab and the experiments (benchmarks, checks, keys, models, traces, the
    simulator): imported only when one of them, or the whole list (help, completion), is asked for."""
    from llumnixctl import keys
    from llumnixctl.experiments.sim import simulate
    from llumnixctl.experiments.bench import check, cli as bench
    from llumnixctl.experiments.sim import profile
    from llumnixctl.experiments.traces import cli as tracecli
    from llumnixctl.lab import model

    lab = typer.Typer()
    lab.add_typer(bench.app, name="bench")
    lab.add_typer(check.app, name="check")
    lab.add_typer(keys.app, name="keys")
    lab.add_typer(model.app, name="model")
    lab.add_typer(tracecli.app, name="trace")
    lab.command("simulate")(simulate.command)
    lab.command("profile")(profile.command)
    return lab


class Commands(typer.core.TyperGroup):
    """llumnixctl's command group: its own commands (the operator's), then those of ``lab_commands()``,
    added the first time a command not its own, or the whole list, is asked for."""

    lab_added = False

    def _add_lab(self) -> None:
        if self.lab_added:
            return
        self.lab_added = True
        # The lab's commands (benchmarks, checks) start clusters and stop them on the way out, in finally
        # blocks: SIGTERM (timeout(1), a CI job cancelled) leaves as Ctrl-C does, through them. With the default
        # action a `timeout 900 llumnixctl bench migration` left its four daemons running, one at half a core.
        try:
            if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, signal.default_int_handler)
        except ValueError:  # not the main thread (a test's runner): the caller owns the signals
            pass
        lab = typer.main.get_group(lab_commands()).commands
        both = {**self.commands, **{n: c for n, c in lab.items() if n not in self.commands}}
        # Typer's order: every command, then every group (as if all were declared on one app)
        order = sorted(both, key=lambda n: isinstance(both[n], typer.core.TyperGroup))
        self.commands.clear()
        self.commands.update((n, both[n]) for n in order)

    def list_commands(self, ctx) -> list[str]:
        self._add_lab()
        return super().list_commands(ctx)

    def get_command(self, ctx, cmd_name: str):
        if cmd_name not in self.commands:
            self._add_lab()
        return super().get_command(ctx, cmd_name)
