"""Traces in the formats people have: the paper's generated mixes, ShareGPT, BurstGPT, Azure, our JSONL.

Everything here returns ``list[trace.TraceRequest]`` in arrival order, indexed 0..n-1, ready for
``llumnixctl bench policies`` and friends (llumnixctl/experiments/tracegen.py has the generators this builds on).

The paper's mixes (Llumnix, OSDI'24, §6.1): input and output lengths from power-law distributions of
short (S), medium (M) and long (L) mean, 128, 256 and 512 tokens, named input-output, e.g. "S-L" is short
prompts with long outputs. The means are the paper's as remembered here; the bounds are not stated here
from the paper but chosen: ``PAPER_BOUNDS`` = [1, 6000] tokens per side, which for "L" gives a median of
~37 and a 99th percentile of ~5300 tokens, about the long tail of the paper's Table 1 as remembered (not
checked against the paper). The exponent for a mean is fitted exactly to the integer draws (``fit_alpha``).

File formats (``load`` picks one from the extension and the first line; ``.gz`` files are read too):

- ``sharegpt``: JSON, a list of ``{"id", "conversations": [{"from": "human"|"gpt", "value": text}, ...]}``,
  or JSONL, one such object a line. Each human turn ("human" or "user") directly followed by a model turn
  ("gpt", "chatgpt", "assistant", "bing", "bard", "model") is one request; other turns (e.g. "system")
  only separate. Lengths are token counts of the texts from ``tokenize(text) -> list[int]``, or from the
  tokenizer of ``model_path`` (``AutoTokenizer``, offline, ``add_special_tokens=False``). With
  ``history=True`` a prompt also counts the tokens of every earlier turn of its conversation (the
  context a chat client resends; no template tokens). ShareGPT has no times: arrivals are generated
  (``rate``, ``arrival``, ``cv``, ``seed``; the same arrival stream as ``trace.generate``).
- ``burstgpt``: CSV with ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``;
  timestamps are seconds from the trace's start. Rows with 0 response tokens (failed requests), 0
  request tokens, or a log type naming a failure are skipped; ``model`` and ``log_type`` keep only the
  rows whose Model equals it / whose Log Type contains it (case-insensitive).
- ``azure``: the Azure LLM inference trace CSV (2023 and 2024), ``TIMESTAMP,ContextTokens,GeneratedTokens``,
  TIMESTAMP like ``2023-11-16 18:15:46.6805900`` (any number of fractional digits, kept to the
  nanosecond; an optional ``Z`` or ``+hh:mm`` offset; a plain number is seconds). Rows with 0 tokens on
  either side are skipped.
- ``jsonl``: ours, one ``{"arrival_s", "prompt_tokens", "output_tokens"[, "priority": "high"|"normal"]}``
  a line (other keys are ignored); ``save_jsonl`` writes it (with ``index``), and loading what it wrote
  gives the same trace back exactly.

For the CSV formats, arrivals are re-based so that the first kept request arrives at 0 (``rebase=False``
keeps the file's seconds). Every loader sorts by arrival (stably) and re-indexes. Bad input raises
``TraceFormatError`` naming the file and the line (JSON: the item); skipped rows go to ``skipped`` as
``(line, reason)`` when a list is given.
"""

from __future__ import annotations

import calendar
import csv
import datetime
import functools
import gzip
import io
import json
import math
import os
import random
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Callable, Iterable, Optional, TextIO

import typer

from llumnixctl.common import JsonOpt, die, out, print_json
from llumnixctl.experiments import tracegen as trace
from llumnixctl.experiments.tracegen import TraceRequest

FORMATS = ("sharegpt", "burstgpt", "azure", "jsonl")
PAPER_MEANS = {"S": 128, "M": 256, "L": 512}
PAPER_BOUNDS = (1, 6000)
HUMAN_ROLES = {"human", "user"}
MODEL_ROLES = {"gpt", "chatgpt", "assistant", "bing", "bard", "model"}

Tokenize = Callable[[str], list]


class TraceFormatError(ValueError):
    """Bad input: the message names the file and where in it."""


def _err(path, where, message: str) -> TraceFormatError:
    return TraceFormatError(f"{path}, {where}: {message}" if where else f"{path}: {message}")


# ---------------------------------------------------------------------- the paper's mixes


def power_law_int_mean(lo: int, hi: int, alpha: float) -> float:
    """The exact mean of ``trace.power_law``'s integer draws: E[floor X] = lo + sum_{k>lo} P(X >= k)."""
    import numpy as np

    if lo < 1 or hi < lo:
        raise ValueError(f"power-law bounds must satisfy 1 <= lo <= hi; got [{lo}, {hi}]")
    a, b = float(lo), float(hi + 1)
    k = np.arange(lo + 1, hi + 1, dtype=np.float64)
    if abs(alpha - 1.0) < 1e-12:
        below = np.log(k / a) / math.log(b / a)  # P(X < k)
    else:
        e = 1.0 - alpha
        below = (k ** e - a ** e) / (b ** e - a ** e)
    return lo + float(np.sum(1.0 - below))


@functools.lru_cache(maxsize=256)
def fit_alpha(mean: float, lo: int, hi: int) -> float:
    """The exponent whose bounded power law on [lo, hi] has integer draws of mean ``mean`` (bisection)."""
    lo_a, hi_a = -30.0, 30.0  # the mean falls as alpha rises; these ends are near hi and near lo
    if not power_law_int_mean(lo, hi, hi_a) < mean < power_law_int_mean(lo, hi, lo_a):
        raise ValueError(f"no power law on [{lo}, {hi}] has mean {mean}: it must lie strictly between the bounds")
    for _ in range(100):
        mid = (lo_a + hi_a) / 2
        if power_law_int_mean(lo, hi, mid) > mean:
            lo_a = mid
        else:
            hi_a = mid
        if hi_a - lo_a < 1e-10:
            break
    return (lo_a + hi_a) / 2


def parse_mix(mix: str) -> tuple[int, int]:
    """"M-L" -> (256, 512): the mean prompt and output lengths of a paper mix (input-output)."""
    parts = mix.strip().upper().split("-")
    if len(parts) != 2 or any(p not in PAPER_MEANS for p in parts):
        names = ", ".join(f"{a}-{b}" for a in PAPER_MEANS for b in PAPER_MEANS)
        raise ValueError(f"unknown mix {mix!r}: give input-output lengths of S, M or L ({names})")
    return PAPER_MEANS[parts[0]], PAPER_MEANS[parts[1]]


def paper_trace(mix: str = "M-M", n: int = 1000, rate: float = 1.0, arrival: str = "gamma", cv: float = 2.0,
                high_fraction: float = 0.0, seed: int = 0, prompt_bounds: tuple[int, int] = PAPER_BOUNDS,
                output_bounds: tuple[int, int] = PAPER_BOUNDS) -> list[TraceRequest]:
    """A paper mix: power-law prompts and outputs of the mix's means within the bounds.

    Same seed, same streams as ``trace.generate``: only the exponents differ per side."""
    pmean, omean = parse_mix(mix)
    pa, oa = fit_alpha(pmean, *prompt_bounds), fit_alpha(omean, *output_bounds)
    kw = dict(rate=rate, arrival=arrival, cv=cv, prompt=prompt_bounds, output=output_bounds,
              high_fraction=high_fraction, seed=seed)
    prompts = trace.generate(n, alpha=pa, **kw)  # the streams are separate: a second call with the
    outputs = prompts if oa == pa else trace.generate(n, alpha=oa, **kw)  # output exponent gives the outputs
    return [replace(p, output_tokens=o.output_tokens) for p, o in zip(prompts, outputs)]


# ---------------------------------------------------------------------- transformations


def reindex(reqs: Iterable[TraceRequest]) -> list[TraceRequest]:
    return [r if r.index == i else replace(r, index=i) for i, r in enumerate(reqs)]


def _sorted(reqs: list[TraceRequest]) -> list[TraceRequest]:
    return reindex(sorted(reqs, key=lambda r: r.arrival_s))


def scale_rate(reqs: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """Arrivals compressed by ``factor``: the rate times ``factor`` (2 = twice as fast)."""
    if not factor > 0 or math.isinf(factor):
        raise ValueError(f"the rate scale must be positive and finite; got {factor}")
    return reindex(replace(r, arrival_s=r.arrival_s / factor) for r in reqs)


def window(reqs: list[TraceRequest], start_s: float = 0.0, end_s: float | None = None) -> list[TraceRequest]:
    """The requests arriving in [start_s, end_s), with ``start_s`` as the new 0."""
    if end_s is not None and end_s < start_s:
        raise ValueError(f"the window ends ({end_s}) before it starts ({start_s})")
    return reindex(replace(r, arrival_s=r.arrival_s - start_s) for r in reqs
                   if r.arrival_s >= start_s and (end_s is None or r.arrival_s < end_s))


def limit(reqs: list[TraceRequest], n: int) -> list[TraceRequest]:
    """The first ``n`` requests."""
    if n < 0:
        raise ValueError(f"the limit must be >= 0; got {n}")
    return reindex(reqs[:n])


def clip(reqs: list[TraceRequest], max_model_len: int, drop: bool = False) -> list[TraceRequest]:
    """Fit every request in a context of ``max_model_len`` tokens (prompt + output, at least 1 output token).

    Prompts are cut to ``max_model_len - 1`` and then outputs to what is left; with ``drop``, requests
    that do not fit are left out instead."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2; got {max_model_len}")
    out = []
    for r in reqs:
        if r.prompt_tokens + r.output_tokens <= max_model_len:
            out.append(r)
        elif not drop:
            p = min(r.prompt_tokens, max_model_len - 1)
            out.append(replace(r, prompt_tokens=p, output_tokens=min(r.output_tokens, max_model_len - p)))
    return reindex(out)


def with_priorities(reqs: list[TraceRequest], high_fraction: float, seed: int = 0) -> list[TraceRequest]:
    """Each request high priority with probability ``high_fraction``, else normal; the stream is
    ``trace.generate``'s, so a generated trace gets the priorities it would have had."""
    if not 0.0 <= high_fraction <= 1.0:
        raise ValueError(f"the high-priority fraction must be in [0, 1]; got {high_fraction}")
    rng = random.Random(f"llumnix-trace:{seed}:priority")
    return reindex(replace(r, priority="high" if rng.random() < high_fraction else "normal") for r in reqs)


def _pct(xs: list[int], q: float) -> int:
    return xs[max(0, min(len(xs) - 1, math.ceil(q * len(xs)) - 1))]  # nearest rank


def stats(reqs: list[TraceRequest]) -> dict:
    """``trace.summary`` plus min, percentiles and totals of the lengths and the high-priority share."""
    data = trace.summary(reqs)
    if not reqs:
        return data
    for key in ("prompt_tokens", "output_tokens"):
        xs = sorted(getattr(r, key) for r in reqs)
        data[key].update({"min": xs[0], "p90": _pct(xs, 0.9), "p99": _pct(xs, 0.99), "total": sum(xs)})
    data["first_arrival_s"] = reqs[0].arrival_s
    data["high_fraction"] = data["high_priority"] / len(reqs)
    return data


# ---------------------------------------------------------------------- files


def _open(path: str | Path) -> TextIO:
    path = Path(path)
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", newline="")
    return open(path, encoding="utf-8", newline="")


def _ext(path: str | Path) -> str:
    name = Path(path).name.lower()
    name = name[:-3] if name.endswith(".gz") else name
    return name.rsplit(".", 1)[-1] if "." in name else ""


def _int(value, path, where, name: str) -> int:
    """A non-negative token count: 12, "12", "12.0" (not 1.5, not -1, not True)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        x = value if isinstance(value, (int, float)) else float(str(value).strip())
        if isinstance(x, float) and not x.is_integer():
            raise ValueError
        x = int(x)
    except (ValueError, OverflowError, TypeError):
        raise _err(path, where, f"{name} must be a whole number of tokens; got {value!r}") from None
    if x < 0:
        raise _err(path, where, f"{name} must be >= 0; got {x}")
    return x


def _seconds(value, path, where, name: str) -> float:
    try:
        if isinstance(value, bool):
            raise ValueError
        x = float(value if isinstance(value, (int, float)) else str(value).strip())
    except (ValueError, TypeError):
        raise _err(path, where, f"{name} must be a number of seconds; got {value!r}") from None
    if not math.isfinite(x) or x < 0:
        raise _err(path, where, f"{name} must be a finite number of seconds >= 0; got {value!r}")
    return x


# --- our JSONL


def load_jsonl(path: str | Path) -> list[TraceRequest]:
    """Our format (see the module docstring); blank lines are allowed."""
    reqs = []
    with _open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _err(path, where, f"invalid JSON: {exc.msg}") from None
            if not isinstance(obj, dict):
                raise _err(path, where, "expected an object with arrival_s, prompt_tokens, output_tokens")
            missing = [k for k in ("arrival_s", "prompt_tokens", "output_tokens") if k not in obj]
            if missing:
                raise _err(path, where, f"missing {', '.join(missing)}")
            priority = obj.get("priority", "normal")
            if priority not in ("high", "normal"):
                raise _err(path, where, f"priority must be \"high\" or \"normal\"; got {priority!r}")
            p = _int(obj["prompt_tokens"], path, where, "prompt_tokens")
            o = _int(obj["output_tokens"], path, where, "output_tokens")
            if p < 1 or o < 1:
                raise _err(path, where, "prompt_tokens and output_tokens must be >= 1")
            reqs.append(TraceRequest(len(reqs), _seconds(obj["arrival_s"], path, where, "arrival_s"), p, o, priority))
    return _sorted(reqs)


def save_jsonl(reqs: Iterable[TraceRequest], path: str | Path | TextIO) -> None:
    """Write ``reqs`` in our JSONL (``index`` included; ``load_jsonl`` gives them back exactly)."""
    def write(f: TextIO) -> None:
        for r in reqs:
            f.write(json.dumps({"index": r.index, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                                "output_tokens": r.output_tokens, "priority": r.priority}) + "\n")

    if hasattr(path, "write"):
        write(path)
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        write(f)
    os.replace(tmp, path)  # a reader never sees half a trace


# --- ShareGPT


def tokenizer(model_path: str | Path) -> Tokenize:
    """``tokenize(text)`` from a local model directory's tokenizer (no network; no special tokens).

    ``transformers.AutoTokenizer``; a generic fast tokenizer (tokenizer_class PreTrainedTokenizerFast,
    as `llumnixctl model tiny` writes) is read with ``tokenizers`` directly: the same ids, without the
    seconds transformers takes to import."""
    d = Path(model_path)
    try:
        cls = json.loads((d / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        cls = None
    if cls in ("PreTrainedTokenizerFast", "TokenizersBackend") and (d / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(d / "tokenizer.json"))
        return lambda text: fast.encode(text, add_special_tokens=False).ids
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_path))
    except Exception as exc:  # transformers raises OSError, ValueError, ... with long messages
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load a tokenizer from {model_path}: {first}") from None
    return lambda text: tok.encode(text, add_special_tokens=False)


def _sharegpt_items(path) -> Iterable[tuple[str, object]]:
    """(where, item) for each conversation: a JSON list, or JSONL."""
    with _open(path) as f:
        head = f.read(4096).lstrip()
    with _open(path) as f:
        if head.startswith("["):
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise _err(path, f"line {exc.lineno} column {exc.colno}", f"invalid JSON: {exc.msg}") from None
            for i, item in enumerate(data):
                ident = item.get("id") if isinstance(item, dict) else None
                yield f"item {i}" + (f" (id {ident!r})" if ident is not None else ""), item
            return
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _err(path, f"line {lineno}", f"invalid JSON: {exc.msg}") from None
            yield f"line {lineno}", item


def load_sharegpt(path: str | Path, *, tokenize: Tokenize | None = None, model_path: str | Path | None = None,
                  rate: float = 1.0, arrival: str = "poisson", cv: float = 1.0, seed: int = 0,
                  history: bool = False, limit: int | None = None,
                  skipped: list | None = None) -> list[TraceRequest]:
    """ShareGPT conversations as requests (see the module docstring); ``limit`` stops reading early."""
    if (tokenize is None) == (model_path is None):
        raise ValueError("ShareGPT has text, not token counts: give a tokenizer (tokenize=... or model_path=...)")
    if tokenize is None:
        tokenize = tokenizer(model_path)
    pairs: list[tuple[int, int]] = []
    for where, item in _sharegpt_items(path):
        if limit is not None and len(pairs) >= limit:
            break
        if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
            raise _err(path, where, "expected an object with a \"conversations\" list")
        turns = item["conversations"]
        for t, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
                raise _err(path, f"{where}, turn {t}", "expected {\"from\": role, \"value\": text}")
        roles = [turn["from"].lower() for turn in turns]
        lengths = [len(tokenize(turn["value"])) for turn in turns] if history else None
        for t in range(1, len(turns)):
            if not (roles[t] in MODEL_ROLES and roles[t - 1] in HUMAN_ROLES):
                continue
            if limit is not None and len(pairs) >= limit:
                break
            p = lengths[t - 1] if lengths else len(tokenize(turns[t - 1]["value"]))
            o = lengths[t] if lengths else len(tokenize(turns[t]["value"]))
            if p == 0 or o == 0:
                if skipped is not None:
                    skipped.append((where, f"empty {'prompt' if p == 0 else 'response'}"))
                continue
            pairs.append((p + (sum(lengths[:t - 1]) if lengths else 0), o))
    rng = random.Random(f"llumnix-trace:{seed}:arrival")  # trace.generate's arrival stream
    t = 0.0
    reqs = []
    for i, ((p, o), gap) in enumerate(zip(pairs, trace.gaps(rng, len(pairs), rate, arrival, cv))):
        t += gap
        reqs.append(TraceRequest(i, t, p, o, "normal"))
    return reqs


# --- the CSV formats


def _csv_rows(path, required: tuple[str, ...], name: str):
    """(line, row) with the header's names stripped; the header must have ``required``."""
    f = _open(path)
    try:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise _err(path, "", f"empty file (expected a {name} CSV header: {','.join(required)})") from None
        missing = [c for c in required if c not in header]
        if missing:
            raise _err(path, "line 1", f"not a {name} CSV header: missing {', '.join(missing)} "
                                        f"(expected {','.join(required)})")
        cols = {c: header.index(c) for c in required}
        for row in reader:
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) < len(header):
                raise _err(path, f"line {reader.line_num}", f"{len(row)} fields, the header has {len(header)}")
            yield reader.line_num, {c: row[i] for c, i in cols.items()}
    except csv.Error as exc:
        raise _err(path, f"line {reader.line_num}", f"bad CSV: {exc}") from None
    finally:
        f.close()


def _rebased(rows: list[tuple[float, int, int]], rebase: bool) -> list[TraceRequest]:
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0] if rows and rebase else 0
    return [TraceRequest(i, float(t - t0), p, o, "normal") for i, (t, p, o) in enumerate(rows)]


BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


def load_burstgpt(path: str | Path, *, model: str | None = None, log_type: str | None = None,
                  rebase: bool = True, skipped: list | None = None) -> list[TraceRequest]:
    """BurstGPT (see the module docstring)."""
    rows = []
    for lineno, row in _csv_rows(path, BURSTGPT_COLUMNS, "BurstGPT"):
        where = f"line {lineno}"
        ts = _seconds(row["Timestamp"], path, where, "Timestamp")
        p = _int(row["Request tokens"], path, where, "Request tokens")
        o = _int(row["Response tokens"], path, where, "Response tokens")
        kind = row["Log Type"].strip()
        reason = ("another model" if model is not None and row["Model"].strip().lower() != model.lower() else
                  "another log type" if log_type is not None and log_type.lower() not in kind.lower() else
                  "failed" if "fail" in kind.lower() else
                  "no response tokens (failed)" if o == 0 else "no request tokens" if p == 0 else None)
        if reason:
            if skipped is not None:
                skipped.append((lineno, reason))
            continue
        rows.append((ts, p, o))
    return _rebased(rows, rebase)


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_STAMP = re.compile(r"(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:[.,](\d+))?"
                    r"\s*(Z|[+-]\d{2}(?::?\d{2})?)?")


def parse_timestamp(text: str) -> int:
    """Nanoseconds since the epoch (UTC unless an offset is given) of ``2023-11-16 18:15:46.6805900``;
    a plain number is seconds."""
    s = text.strip()
    m = _STAMP.fullmatch(s)
    if not m:
        try:
            x = float(s)
        except ValueError:
            raise ValueError(f"not a timestamp: {text!r} (expected YYYY-MM-DD HH:MM:SS[.fraction])") from None
        if not math.isfinite(x):
            raise ValueError(f"not a timestamp: {text!r}")
        return round(x * 1e9)
    y, mo, d, hh, mm, ss = (int(g) for g in m.groups()[:6])
    frac, tz = m.group(7) or "", m.group(8)
    try:
        secs = calendar.timegm((y, mo, d, hh, mm, ss, 0, 0, 0))
        datetime.datetime(y, mo, d, hh, mm, ss)  # rejects month 13, Feb 30, 25:00
    except ValueError as exc:
        raise ValueError(f"not a timestamp: {text!r} ({exc})") from None
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        secs -= sign * (int(digits[:2]) * 3600 + int(digits[2:4] or 0) * 60)
    return secs * 10 ** 9 + int((frac + "000000000")[:9])


def load_azure(path: str | Path, *, rebase: bool = True, skipped: list | None = None) -> list[TraceRequest]:
    """The Azure LLM inference trace (see the module docstring)."""
    rows = []
    for lineno, row in _csv_rows(path, AZURE_COLUMNS, "Azure"):
        where = f"line {lineno}"
        try:
            ns = parse_timestamp(row["TIMESTAMP"])
        except ValueError as exc:
            raise _err(path, where, f"TIMESTAMP: {exc}") from None
        p = _int(row["ContextTokens"], path, where, "ContextTokens")
        o = _int(row["GeneratedTokens"], path, where, "GeneratedTokens")
        if p == 0 or o == 0:
            if skipped is not None:
                skipped.append((lineno, "no context tokens" if p == 0 else "no generated tokens"))
            continue
        rows.append((ns, p, o))
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0] if rows and rebase else 0
    return [TraceRequest(i, (ns - t0) / 1e9, p, o, "normal") for i, (ns, p, o) in enumerate(rows)]


# --- by format


def sniff(path: str | Path) -> str:
    """The format of ``path``: from its extension, then its first line."""
    ext = _ext(path)
    try:
        with _open(path) as f:
            first = next((line for line in f if line.strip()), "")
    except UnicodeDecodeError:
        raise _err(path, "", "not UTF-8 text (a .gz file needs the .gz extension)") from None
    head = first.strip()
    if not head and ext in ("jsonl", "ndjson"):
        return "jsonl"  # an empty trace
    if not head:
        raise _err(path, "", f"empty file: cannot tell the format (give one of {', '.join(FORMATS)})")
    if ext == "csv" or (head and head[0] not in "[{"):
        cols = {c.strip() for c in head.split(",")}
        if set(AZURE_COLUMNS) <= cols:
            return "azure"
        if "Request tokens" in cols and "Response tokens" in cols:
            return "burstgpt"
        raise _err(path, "line 1", f"unknown CSV header (known: BurstGPT {','.join(BURSTGPT_COLUMNS)}; "
                                    f"Azure {','.join(AZURE_COLUMNS)})")
    if ext == "json" or head.startswith("["):
        return "sharegpt"
    if head.startswith("{"):
        return "sharegpt" if '"conversations"' in head else "jsonl"
    raise _err(path, "", f"cannot tell the format (give one of {', '.join(FORMATS)})")


LOADERS = {"sharegpt": load_sharegpt, "burstgpt": load_burstgpt, "azure": load_azure, "jsonl": load_jsonl}


def load(path: str | Path, fmt: str | None = None, **options) -> list[TraceRequest]:
    """Load ``path`` as ``fmt`` (default: ``sniff``); ``options`` go to that format's loader."""
    if fmt is None:
        fmt = sniff(path)
    if fmt not in LOADERS:
        raise ValueError(f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    return LOADERS[fmt](path, **options)


# ---------------------------------------------------------------------- CLI

app = typer.Typer(no_args_is_help=True, help="Request traces: generate, convert (ShareGPT, BurstGPT, Azure), show.")

RateOpt = Annotated[float, typer.Option("--rate", help="requests/s of the generated arrivals")]
ArrivalOpt = Annotated[str, typer.Option("--arrival", help="arrival process: poisson or gamma")]
CvOpt = Annotated[float, typer.Option("--cv", help="gamma arrivals: coefficient of variation (1 = Poisson)")]
SeedOpt = Annotated[int, typer.Option("--seed", help="seed of the generated arrivals, lengths and priorities")]
FormatOpt = Annotated[Optional[str], typer.Option("--format", "-f", help="sharegpt, burstgpt, azure or jsonl (default: from the file)")]
ModelOpt = Annotated[Optional[Path], typer.Option("--model", help="ShareGPT: a model directory whose tokenizer counts the tokens")]
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
    output: Annotated[str, typer.Argument(help="JSONL file to write (- for stdout)")],
    mix: Annotated[Optional[str], typer.Option("--mix", help="a paper mix, input-output of S/M/L (means 128/256/512), e.g. M-L")] = None,
    requests: Annotated[int, typer.Option("--requests", "-n", min=0, help="requests in the trace")] = 1000,
    rate: RateOpt = 1.0, arrival: ArrivalOpt = "poisson", cv: CvOpt = 1.0,
    prompt_min: Annotated[Optional[int], typer.Option(help="shortest prompt (default 1 with --mix, else 16)")] = None,
    prompt_max: Annotated[Optional[int], typer.Option(help="longest prompt (default 6000 with --mix, else 512)")] = None,
    output_min: Annotated[Optional[int], typer.Option(help="shortest output (default 1 with --mix, else 16)")] = None,
    output_max: Annotated[Optional[int], typer.Option(help="longest output (default 6000 with --mix, else 1024)")] = None,
    alpha: Annotated[Optional[float], typer.Option(help="without --mix: the power-law exponent of both lengths (default 1)")] = None,
    high_fraction: Annotated[float, typer.Option(help="share of high-priority requests")] = 0.0,
    seed: SeedOpt = 0, json_: JsonOpt = False,
) -> None:
    """Write a generated trace: a paper mix (--mix) or power-law lengths within explicit bounds."""
    _check_arrival(arrival)
    d = (PAPER_BOUNDS[0], PAPER_BOUNDS[1], PAPER_BOUNDS[0], PAPER_BOUNDS[1]) if mix else (16, 512, 16, 1024)
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
            a = 1.0 if alpha is None else alpha
            reqs = trace.generate(requests, rate=rate, arrival=arrival, cv=cv, prompt=pb, output=ob, alpha=a,
                                  high_fraction=high_fraction, seed=seed)
            extra["alpha"] = a
    except ValueError as exc:
        die(str(exc), 2)
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
    output: Annotated[str, typer.Argument(help="JSONL file to write (- for stdout)")],
    fmt: FormatOpt = None, model: ModelOpt = None,
    rate: Annotated[float, typer.Option("--rate", help="ShareGPT: requests/s of the generated arrivals")] = 1.0,
    arrival: ArrivalOpt = "poisson", cv: CvOpt = 1.0, seed: SeedOpt = 0,
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
    arrival: ArrivalOpt = "poisson", cv: CvOpt = 1.0, seed: SeedOpt = 0,
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
