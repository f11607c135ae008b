"""``llumnixctl trace``: generate, convert and show request traces (llumnixctl/experiments/traces/files.py
reads and writes them; gen.py generates them)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llumnixctl.common import JsonOpt, die, out, print_json
from llumnixctl.experiments.traces import gen as trace
from llumnixctl.experiments.traces.files import FORMATS, TraceFormatError, load, save_jsonl, sniff
from llumnixctl.experiments.traces.mix import (PAPER_BOUNDS, clip, fit_alpha, limit, paper_trace, parse_mix, scale_rate,
                                             stats, window, with_priorities)
from llumnixctl.experiments.traces.gen import DEFAULT, TraceRequest
from llumnixctl.experiments.traces.options import Arrival, Cv, HighFraction, Rate, Seed

app = typer.Typer(no_args_is_help=True, help="Request traces: generate, convert (ShareGPT, BurstGPT, Azure), show.")

FormatOpt = Annotated[Optional[str], typer.Option("--format", "-f", metavar="sharegpt|burstgpt|azure|jsonl", help="the input's format (default: from the file)")]
ModelOpt = Annotated[Optional[Path], typer.Option("--model", metavar="DIR", help="ShareGPT: a model directory whose tokenizer counts the tokens")]
FilterModelOpt = Annotated[Optional[str], typer.Option("--filter-model", help="BurstGPT: keep only this Model (e.g. GPT-4)")]
LogTypeOpt = Annotated[Optional[str], typer.Option("--log-type", help="BurstGPT: keep only Log Types containing this (e.g. conversation)")]


def _write(reqs: list[TraceRequest], output: str, json_: bool, extra: dict) -> None:
    try:
        save_jsonl(reqs, sys.stdout if output == "-" else Path(output))
    except OSError as exc:
        die(f"cannot write {output}: {exc.strerror or exc}")
    if output == "-":
        return  # stdout is the trace
    data = {"path": output, **extra, "summary": stats(reqs)}
    if json_:
        print_json(data)
        return
    s = data["summary"]
    if not reqs:
        out.print(f"wrote 0 requests to {output}", markup=False, highlight=False)
        return
    out.print(f"wrote {s['requests']} requests to {output}: {s['duration_s']:.1f} s"
              + (f", {s['offered_rate']:.2f} req/s" if s["offered_rate"] else "")
              + f", prompts mean {s['prompt_tokens']['mean']:.1f} tokens, outputs mean {s['output_tokens']['mean']:.1f}"
              + (f", {s['high_priority']} high priority" if s["high_priority"] else ""), markup=False, highlight=False)


def _check_arrival(arrival: str) -> None:
    if arrival not in trace.ARRIVALS:
        die(f"unknown --arrival {arrival!r} (known: {', '.join(trace.ARRIVALS)})", 2)


@app.command("generate")
def generate_cmd(
    output: Annotated[str, typer.Argument(metavar="out.jsonl", help="JSONL file to write (- for stdout)")],
    mix: Annotated[Optional[str], typer.Option("--mix", metavar="IN-OUT", help="a paper mix, input-output of S/M/L (means 128/256/512), e.g. M-L")] = None,
    requests: Annotated[int, typer.Option("--requests", "-n", min=0, help="requests in the trace")] = DEFAULT.requests,
    rate: Rate = DEFAULT.rate, arrival: Arrival = DEFAULT.arrival, cv: Cv = DEFAULT.cv,
    prompt_min: Annotated[Optional[int], typer.Option(help=f"shortest prompt (default {PAPER_BOUNDS[0]} with --mix, else {DEFAULT.prompt_min})")] = None,
    prompt_max: Annotated[Optional[int], typer.Option(help=f"longest prompt (default {PAPER_BOUNDS[1]} with --mix, else {DEFAULT.prompt_max})")] = None,
    output_min: Annotated[Optional[int], typer.Option(help=f"shortest output (default {PAPER_BOUNDS[0]} with --mix, else {DEFAULT.output_min})")] = None,
    output_max: Annotated[Optional[int], typer.Option(help=f"longest output (default {PAPER_BOUNDS[1]} with --mix, else {DEFAULT.output_max})")] = None,
    alpha: Annotated[Optional[float], typer.Option(help=f"without --mix: the power-law exponent of both lengths (default {DEFAULT.alpha:g})")] = None,
    high_fraction: HighFraction = DEFAULT.high_fraction,
    shape: Annotated[str, typer.Option("--shape", metavar="plain|shared-prefix|multi-turn|sessions", help="plain: unique prompts; shared-prefix: shared system prompts and a suffix each (--prompt-min/--prompt-max bound the suffix); multi-turn: conversations (--prompt-min/--prompt-max bound a message, --output-min/--output-max a reply); sessions: the same as whole sessions of agents (-n sessions, --rate sessions/s; llumnixctl/experiments/traces/sessions.py)")] = "plain",
    prefixes: Annotated[int, typer.Option(help="shared-prefix: system prompts; multi-turn: system prompts sessions open with (0: none)", min=0)] = 24,
    prefix_tokens: Annotated[int, typer.Option(help="shared-prefix and multi-turn: tokens of a system prompt", min=0)] = 384,
    skew: Annotated[float, typer.Option(help="popularity of the system prompts: prompt k with weight (k+1)^-skew (0: uniform)", min=0.0)] = 1.0,
    hot: Annotated[float, typer.Option(help="shared-prefix: share of the requests that use system prompt 0 (the hotspot case; 0: by --skew)", min=0.0, max=0.99)] = 0.0,
    turns_min: Annotated[int, typer.Option(help="multi-turn: fewest turns of a session", min=1)] = 2,
    turns_max: Annotated[int, typer.Option(help="multi-turn: most turns of a session", min=1)] = 8,
    think: Annotated[float, typer.Option(help="multi-turn: mean seconds between a turn's end and the next turn", min=0.0)] = 5.0,
    max_context: Annotated[int, typer.Option(help="multi-turn: a session ends before its context passes this", min=2)] = 4096,
    seed: Seed = DEFAULT.seed, json_: JsonOpt = False,
) -> None:
    """Write a generated trace: a paper mix (--mix), power-law lengths within explicit bounds, or a trace
    whose requests share content (--shape shared-prefix or multi-turn) for prefix-cache experiments."""
    _check_arrival(arrival)
    if shape not in ("plain", "shared-prefix", "multi-turn", "sessions"):
        die(f"unknown --shape {shape!r} (known: plain, shared-prefix, multi-turn, sessions)", 2)
    if shape != "plain":
        if mix:
            die("--mix is for --shape plain", 2)
        return _generate_shared(output, shape, requests, rate, arrival, cv, prompt_min, prompt_max, output_min,
                                output_max, DEFAULT.alpha if alpha is None else alpha, prefixes, prefix_tokens, skew, hot,
                                (turns_min, turns_max), think, max_context, high_fraction, seed, json_)
    d = ((PAPER_BOUNDS[0], PAPER_BOUNDS[1], PAPER_BOUNDS[0], PAPER_BOUNDS[1]) if mix
         else (DEFAULT.prompt_min, DEFAULT.prompt_max, DEFAULT.output_min, DEFAULT.output_max))
    pb = (d[0] if prompt_min is None else prompt_min, d[1] if prompt_max is None else prompt_max)
    ob = (d[2] if output_min is None else output_min, d[3] if output_max is None else output_max)
    extra: dict = {"requests": requests, "rate": rate, "arrival": arrival, "cv": cv if arrival == "gamma" else 1.0,
                   "prompt": list(pb), "output": list(ob), "high_fraction": high_fraction, "seed": seed}
    try:
        if mix:
            if alpha is not None:
                die("--alpha is for explicit bounds: a --mix fits its own exponents to its means", 2)
            pmean, omean = parse_mix(mix)
            reqs = paper_trace(mix, requests, rate, arrival, cv, high_fraction, seed, pb, ob)
            extra.update(mix=mix.upper(), prompt_mean=pmean, output_mean=omean,
                         prompt_alpha=fit_alpha(pmean, *pb), output_alpha=fit_alpha(omean, *ob))
        else:
            a = DEFAULT.alpha if alpha is None else alpha
            reqs = trace.generate(requests, rate=rate, arrival=arrival, cv=cv, prompt=pb, output=ob, alpha=a,
                                  high_fraction=high_fraction, seed=seed)
            extra["alpha"] = a
    except ValueError as exc:
        die(str(exc), 2)
    _write(reqs, output, json_, extra)


def _generate_shared(output: str, shape: str, n: int, rate: float, arrival: str, cv: float, prompt_min, prompt_max,
                     output_min, output_max, alpha: float, prefixes: int, prefix_tokens: int, skew: float, hot: float,
                     turns: tuple[int, int], think: float, max_context: int, high_fraction: float, seed: int,
                     json_: bool) -> None:
    from llumnixctl.experiments.traces import cache as tracecache

    pb = (prompt_min or 16, prompt_max or 128)
    ob = (output_min or 16, output_max or 256)
    extra: dict = {"shape": shape, "requests": n, "rate": rate, "arrival": arrival, "cv": cv if arrival == "gamma" else 1.0,
                   "prompt": list(pb), "output": list(ob), "alpha": alpha, "prefixes": prefixes,
                   "prefix_tokens": prefix_tokens, "skew": skew, "seed": seed}
    try:
        if shape == "shared-prefix":
            if prefixes < 1 or prefix_tokens < 1:
                die("--shape shared-prefix needs --prefixes and --prefix-tokens >= 1", 2)
            reqs = tracecache.shared_prefix(n, rate=rate, arrival=arrival, cv=cv, prefixes=prefixes,
                                            prefix_tokens=prefix_tokens, skew=skew, hot=hot, suffix=pb, output=ob,
                                            alpha=alpha, seed=seed)
            extra["hot"] = hot
        elif shape == "sessions":
            from llumnixctl.experiments.traces import sessions as tsessions

            if hot:
                die("--hot is for --shape shared-prefix", 2)
            reqs = tsessions.sessions(n, session_rate=rate, arrival=arrival, cv=cv, turns=turns, agents=prefixes,
                                      system_tokens=prefix_tokens, skew=skew, message=pb, reply=ob, think=think,
                                      max_context=max_context, alpha=alpha, seed=seed)
            d = tsessions.describe(reqs)
            extra.update(turns=list(turns), think=think, max_context=max_context, sessions=d["sessions"],
                         working_set_tokens=d["working_set_tokens"])
        else:
            if hot:
                die("--hot is for --shape shared-prefix", 2)
            reqs = tracecache.multi_turn(n, rate=rate, arrival=arrival, cv=cv, turns=turns, system_prompts=prefixes,
                                         system_tokens=prefix_tokens, skew=skew, message=pb, reply=ob, think=think,
                                         max_context=max_context, alpha=alpha, seed=seed)
            extra.update(turns=list(turns), think=think, max_context=max_context,
                         sessions=len({r.session for r in reqs}))
        if high_fraction:
            reqs = with_priorities(reqs, high_fraction, seed)
    except ValueError as exc:
        die(str(exc), 2)
    extra.update(tracecache.sharing(reqs))
    _write(reqs, output, json_, extra)


def _load_cli(input: Path, fmt: str | None, model: Path | None, rate: float, arrival: str, cv: float, seed: int,
              history: bool, filter_model: str | None, log_type: str | None, early_limit: int | None,
              skipped: list) -> tuple[str, list[TraceRequest]]:
    _check_arrival(arrival)
    if fmt is not None and fmt not in FORMATS:
        die(f"unknown --format {fmt!r} (known: {', '.join(FORMATS)})", 2)
    try:
        fmt = fmt or sniff(input)
        if fmt != "sharegpt" and (model is not None or history):
            die(f"--model and --history are for ShareGPT; {input} is {fmt}", 2)
        if fmt != "burstgpt" and (filter_model is not None or log_type is not None):
            die(f"--filter-model and --log-type are for BurstGPT; {input} is {fmt}", 2)
        if fmt == "sharegpt":
            if model is None:
                die(f"{input} is ShareGPT (text, no token counts): give --model DIR, a model whose tokenizer "
                    "counts the tokens (e.g. one from `llumnixctl model tiny DIR`)", 2)
            opts = dict(model_path=model, rate=rate, arrival=arrival, cv=cv, seed=seed, history=history,
                        limit=early_limit)
        elif fmt == "burstgpt":
            opts = dict(model=filter_model, log_type=log_type)
        else:
            opts = {}
        if fmt != "jsonl":
            opts["skipped"] = skipped
        return fmt, load(input, fmt, **opts)
    except FileNotFoundError:
        die(f"no such file: {input}")
    except OSError as exc:
        die(f"cannot read {input}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        die(f"{input}: not UTF-8 text (a gzip file needs the .gz extension)")
    except (TraceFormatError, ValueError) as exc:
        die(str(exc))
    raise AssertionError  # die raised


@app.command("convert")
def convert_cmd(
    input: Annotated[Path, typer.Argument(help="the trace: ShareGPT .json/.jsonl, BurstGPT or Azure .csv, our .jsonl (.gz too)")],
    output: Annotated[str, typer.Argument(metavar="out.jsonl", help="JSONL file to write (- for stdout)")],
    fmt: FormatOpt = None, model: ModelOpt = None,
    rate: Annotated[float, typer.Option("--rate", help="ShareGPT: requests/s of the generated arrivals")] = 1.0,
    arrival: Arrival = DEFAULT.arrival, cv: Cv = DEFAULT.cv, seed: Seed = DEFAULT.seed,
    history: Annotated[bool, typer.Option("--history", help="ShareGPT: prompts count the earlier turns of their conversation")] = False,
    filter_model: FilterModelOpt = None, log_type: LogTypeOpt = None,
    start: Annotated[float, typer.Option("--start", help="keep arrivals from this second on (the new 0)")] = 0.0,
    end: Annotated[Optional[float], typer.Option("--end", help="keep arrivals before this second")] = None,
    rate_scale: Annotated[float, typer.Option("--rate-scale", help="compress arrivals: the rate times this (after --start/--end)")] = 1.0,
    limit_: Annotated[Optional[int], typer.Option("--limit", min=0, help="keep the first N requests (after the window)")] = None,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", min=2, help="clip prompt + output to this context")] = None,
    high_fraction: Annotated[Optional[float], typer.Option(help="assign high priority to this share of requests (seeded by --seed)")] = None,
    json_: JsonOpt = False,
) -> None:
    """Convert a trace to our JSONL: window (--start/--end), then --rate-scale, --limit, --max-model-len, priorities."""
    skipped: list = []
    early = limit_ if start == 0 and end is None else None  # ShareGPT: tokenize no more than needed
    fmt, reqs = _load_cli(input, fmt, model, rate, arrival, cv, seed, history, filter_model, log_type, early, skipped)
    loaded = len(reqs)
    try:
        reqs = window(reqs, start, end)
        reqs = scale_rate(reqs, rate_scale)
        if limit_ is not None:
            reqs = limit(reqs, limit_)
        if max_model_len is not None:
            reqs = clip(reqs, max_model_len)
        if high_fraction is not None:
            reqs = with_priorities(reqs, high_fraction, seed)
    except ValueError as exc:
        die(str(exc), 2)
    reasons: dict[str, int] = {}
    for _, why in skipped:
        reasons[why] = reasons.get(why, 0) + 1
    if skipped and output != "-" and not json_:
        sys.stderr.write(f"llumnixctl: skipped {len(skipped)} row(s) of {input}: "
                         + ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())) + "\n")
    _write(reqs, output, json_, {"input": str(input), "format": fmt, "loaded": loaded, "skipped": reasons})


@app.command("show")
def show_cmd(
    input: Annotated[Path, typer.Argument(help="a trace in any known format")],
    fmt: FormatOpt = None, model: ModelOpt = None,
    rate: Annotated[float, typer.Option("--rate", help="ShareGPT: requests/s of the generated arrivals")] = 1.0,
    arrival: Arrival = DEFAULT.arrival, cv: Cv = DEFAULT.cv, seed: Seed = DEFAULT.seed,
    history: Annotated[bool, typer.Option("--history", help="ShareGPT: prompts count the earlier turns of their conversation")] = False,
    filter_model: FilterModelOpt = None, log_type: LogTypeOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Summarize a trace: requests, duration, rate, prompt and output lengths, priorities."""
    skipped: list = []
    fmt, reqs = _load_cli(input, fmt, model, rate, arrival, cv, seed, history, filter_model, log_type, None, skipped)
    data = {"path": str(input), "format": fmt, "skipped": len(skipped), "summary": stats(reqs)}
    if json_:
        print_json(data)
        return
    s = data["summary"]
    out.print(f"{input} ({fmt}): {s['requests']} requests" + (f", {len(skipped)} rows skipped" if skipped else ""),
              markup=False, highlight=False)
    if not reqs:
        return
    rate_s = f"{s['offered_rate']:.3f} req/s" if s["offered_rate"] else "all at once"
    out.print(f"  arrivals  {s['first_arrival_s']:.3f} .. {s['duration_s']:.3f} s, {rate_s}", markup=False, highlight=False)
    for key in ("prompt_tokens", "output_tokens"):
        x = s[key]
        out.print(f"  {key.split('_')[0]:<8}  mean {x['mean']:.1f}, min {x['min']}, median {x['median']}, p90 {x['p90']}, "
                  f"p99 {x['p99']}, max {x['max']}, total {x['total']}", markup=False, highlight=False)
    out.print(f"  priority  {s['high_priority']} high ({100 * s['high_fraction']:.1f}%)", markup=False, highlight=False)
