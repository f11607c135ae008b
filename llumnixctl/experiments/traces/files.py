"""Traces in the formats people have: ShareGPT, BurstGPT, Azure, our JSONL (the paper's generated mixes are
in mix.py).

Everything here returns ``list[trace.TraceRequest]`` in arrival order, indexed 0..n-1, ready for
``llumnixctl bench policies`` and friends (llumnixctl/experiments/traces/gen.py has the generators this builds on).

File formats (``load`` picks one from the extension and the first line; ``.gz`` files are read too):

- ``sharegpt``: JSON, a list of ``{"id", "conversations": [{"from": "human"|"gpt", "value": text}, ...]}``,
  or JSONL, one such object a line. Each human turn ("human" or "user") directly followed by a model turn
  ("gpt", "chatgpt", "assistant", "bing", "bard", "model") is one request; other turns (e.g. "system")
  only separate. Lengths are token counts of the texts from ``tokenize(text) -> list[int]``, or from the
  tokenizer of ``model_path`` (``AutoTokenizer``, offline, ``add_special_tokens=False``). With
  ``history=True`` a prompt also counts the tokens of every earlier turn of its conversation (the
  context a chat client resends; no template tokens), and the turns of a conversation are a session
  (``TraceRequest.session``, ``turn``; ``segments`` name each earlier turn, so replays share them).
  ShareGPT has no times: arrivals are generated (``rate``, ``arrival``, ``cv``, ``seed``; the same arrival stream as ``trace.generate``).
- ``burstgpt``: CSV with ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``;
  timestamps are seconds from the trace's start. Rows with 0 response tokens (failed requests), 0
  request tokens, or a log type naming a failure are skipped; ``model`` and ``log_type`` keep only the
  rows whose Model equals it / whose Log Type contains it (case-insensitive).
- ``azure``: the Azure LLM inference trace CSV (2023 and 2024), ``TIMESTAMP,ContextTokens,GeneratedTokens``,
  TIMESTAMP like ``2023-11-16 18:15:46.6805900`` (any number of fractional digits, kept to the
  nanosecond; an optional ``Z`` or ``+hh:mm`` offset; a plain number is seconds). Rows with 0 tokens on
  either side are skipped.
- ``jsonl``: ours, one ``{"arrival_s", "prompt_tokens", "output_tokens"[, "priority": "high"|"normal"]}``
  a line, with ``"segments": [[name, tokens], ...]`` where requests share prompt content and ``"session",
  "turn", "think_s"`` for the turns of a conversation (cache.py; other keys are ignored); ``save_jsonl`` writes it (with ``index``), and loading what it wrote
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
import gzip
import io
import json
import math
import os
import random
import re
from pathlib import Path
from typing import Callable, Iterable, TextIO


from llumnixctl.experiments.traces import gen as trace
from llumnixctl.experiments.traces.gen import TraceRequest
from llumnixctl.experiments.traces.mix import by_arrival

FORMATS = ("sharegpt", "burstgpt", "azure", "jsonl")
HUMAN_ROLES = {"human", "user"}
MODEL_ROLES = {"gpt", "chatgpt", "assistant", "bing", "bard", "model"}

Tokenize = Callable[[str], list]


class TraceFormatError(ValueError):
    """Bad input: the message names the file and where in it."""


def _err(path, where, message: str) -> TraceFormatError:
    return TraceFormatError(f"{path}, {where}: {message}" if where else f"{path}: {message}")


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
            extra = _shared(obj, p, path, where)
            reqs.append(TraceRequest(len(reqs), _seconds(obj["arrival_s"], path, where, "arrival_s"), p, o, priority,
                                     **extra))
    return by_arrival(reqs)


def save_jsonl(reqs: Iterable[TraceRequest], path: str | Path | TextIO) -> None:
    """Write ``reqs`` in our JSONL (``index`` included; ``load_jsonl`` gives them back exactly)."""
    def write(f: TextIO) -> None:
        for r in reqs:
            row = {"index": r.index, "arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                   "output_tokens": r.output_tokens, "priority": r.priority}
            if r.segments:
                row["segments"] = [list(s) for s in r.segments]
            if r.session >= 0:
                row.update(session=r.session, turn=r.turn, think_s=r.think_s)
            f.write(json.dumps(row) + "\n")

    if hasattr(path, "write"):
        write(path)
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        write(f)
    os.replace(tmp, path)  # a reader never sees half a trace


def _shared(obj: dict, prompt_tokens: int, path, where: str) -> dict:
    """The optional content keys of a JSONL row: segments (their lengths add up to prompt_tokens) and a
    session's id, turn and think time."""
    extra: dict = {}
    segs = obj.get("segments")
    if segs is not None:
        if (not isinstance(segs, list) or not all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)
                                                  and type(x[1]) is int and x[1] >= 1 for x in segs)):
            raise _err(path, where, "segments must be a list of [name, tokens >= 1] pairs")
        if sum(x[1] for x in segs) != prompt_tokens:
            raise _err(path, where, f"the segments hold {sum(x[1] for x in segs)} tokens, not prompt_tokens "
                                    f"({prompt_tokens})")
        extra["segments"] = tuple((x[0], x[1]) for x in segs)
    if "session" in obj:
        s, t = obj["session"], obj.get("turn", 0)
        if type(s) is not int or type(t) is not int or s < 0 or t < 0:
            raise _err(path, where, "session and turn must be integers >= 0")
        extra.update(session=s, turn=t, think_s=_seconds(obj.get("think_s", 0.0), path, where, "think_s"))
    return extra


# --- ShareGPT


def tokenizer(model_path: str | Path) -> Tokenize:
    """``tokenize(text)`` from a local model directory's tokenizer (no network; no special tokens)."""
    encode = _encoder(model_path)
    return lambda text: encode(text, False)


def special_lead(model_path: str | Path) -> int:
    """How many special tokens (a BOS) the tokenizer of a local model directory puts before a text when it adds
    them, as an engine does for a text prompt."""
    encode = _encoder(model_path)
    return len(encode("the", True)) - len(encode("the", False))


def _encoder(model_path: str | Path) -> Callable[[str, bool], list[int]]:
    """``encode(text, add_special_tokens)`` of a local model directory's tokenizer (no network).

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
        return lambda text, special: fast.encode(text, add_special_tokens=special).ids
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_path))
    except Exception as exc:  # transformers raises OSError, ValueError, ... with long messages
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load a tokenizer from {model_path}: {first}") from None
    return lambda text, special: tok.encode(text, add_special_tokens=special)


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
    pairs: list[tuple] = []
    for conv, (where, item) in enumerate(_sharegpt_items(path)):
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
        turn_no = 0
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
            if lengths:  # a session: the turn resends the conversation so far
                segs = tuple((f"sharegpt-{conv}-{j}", n) for j, n in enumerate(lengths[:t]) if n)
                pairs.append((p + sum(lengths[:t - 1]), o, dict(segments=segs, session=conv, turn=turn_no)))
                turn_no += 1
            else:
                pairs.append((p, o, {}))
    rng = random.Random(f"llumnix-trace:{seed}:arrival")  # trace.generate's arrival stream
    t = 0.0
    reqs = []
    for i, ((p, o, extra), gap) in enumerate(zip(pairs, trace.gaps(rng, len(pairs), rate, arrival, cv))):
        t += gap
        reqs.append(TraceRequest(i, t, p, o, "normal", **extra))
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
