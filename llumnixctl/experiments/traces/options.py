"""The options of a generated trace, declared once (flag, help, bounds): ``llumnixctl trace generate``,
``bench policies`` and any command that generates a trace take them from here, and their defaults from a
``gen.TraceOptions`` (the generator's own, ``gen.DEFAULT``, or the command's)."""

from __future__ import annotations

from typing import Annotated

import typer

Requests = Annotated[int, typer.Option("--requests", help="requests in the trace", min=1)]
Rate = Annotated[float, typer.Option("--rate", help="requests/s of the generated arrivals")]
Arrival = Annotated[str, typer.Option("--arrival", metavar="poisson|gamma", help="arrival process: poisson or gamma")]
Cv = Annotated[float, typer.Option("--cv", help="gamma arrivals: coefficient of variation of the gaps (1 = Poisson)")]
PromptMin = Annotated[int, typer.Option("--prompt-min", help="shortest prompt, tokens", min=1)]
PromptMax = Annotated[int, typer.Option("--prompt-max", help="longest prompt, tokens", min=1)]
OutputMin = Annotated[int, typer.Option("--output-min", help="shortest output, tokens", min=1)]
OutputMax = Annotated[int, typer.Option("--output-max", help="longest output, tokens", min=1)]
Alpha = Annotated[float, typer.Option("--alpha", help="power-law exponent of both lengths (density ~ x^-alpha; 0 = uniform)")]
HighFraction = Annotated[float, typer.Option("--high-fraction", help="share of high-priority requests")]
Seed = Annotated[int, typer.Option("--seed", help="seed of the generated arrivals, lengths and priorities")]
