"""Traces in the formats people have (llumnixctl/experiments/traces/files.py): the paper's mixes, the loaders, the transformations, the CLI.

Small files written here in each format; values checked exactly. The ShareGPT counts come from the tiny
model's tokenizer (trained here, nothing downloaded).
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st
from typer.testing import CliRunner

from llumnixctl.experiments.traces import cli as tracecli, files as traces, gen as trace, mix as tracemix
from llumnixctl.experiments.traces.gen import TraceRequest
from llumnixctl.lab import model

runner = CliRunner()


def _cli(*args: str):
    return runner.invoke(tracecli.app, list(args), prog_name="llumnixctl trace")


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """The tokenizer files of `llumnixctl model tiny` (no weights: the test needs only the tokenizer)."""
    d = tmp_path_factory.mktemp("tiny-tok")
    model.train_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(model._tokenizer_config(4096)))
    return d


@pytest.fixture(scope="module")
def tiny_tokenize(tiny_tokenizer_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def R(i, t, p, o, prio="normal"):
    return TraceRequest(i, t, p, o, prio)


# ---------------------------------------------------------------------- the paper's mixes


@pytest.mark.parametrize("mean,bounds", [(128, (1, 6000)), (256, (1, 6000)), (512, (1, 6000)), (100, (16, 512)),
                                         (300, (16, 512)), (10, (4, 12))])
def test_fit_alpha_gives_the_exact_integer_mean(mean, bounds):
    alpha = tracemix.fit_alpha(mean, *bounds)
    assert tracemix.power_law_int_mean(*bounds, alpha) == pytest.approx(mean, rel=1e-7)
    # the exact integer mean is the continuous one less about a half
    assert tracemix.power_law_int_mean(*bounds, alpha) == pytest.approx(trace.power_law_mean(*bounds, alpha) - 0.5, abs=0.1)


def test_int_mean_by_enumeration():
    # P(floor X = k) from the continuous CDF, summed directly, on a small range
    lo, hi, alpha = 3, 40, 1.7
    a, b, e = lo, hi + 1, 1 - alpha
    F = lambda x: (x ** e - a ** e) / (b ** e - a ** e)  # noqa: E731
    assert tracemix.power_law_int_mean(lo, hi, alpha) == pytest.approx(sum(k * (F(k + 1) - F(k)) for k in range(lo, hi + 1)))
    assert tracemix.power_law_int_mean(lo, hi, 1.0) == pytest.approx(
        sum(k * math.log((k + 1) / k) for k in range(lo, hi + 1)) / math.log(b / a))


def test_fit_alpha_refuses_a_mean_outside_the_bounds():
    for m in (16, 512, 600, 3):
        with pytest.raises(ValueError, match="no power law"):
            tracemix.fit_alpha(m, 16, 512)


@pytest.mark.parametrize("mix", ["S-S", "M-M", "L-L", "S-L", "L-S", "m-l"])
def test_paper_mixes_hit_their_means(mix):
    n = 20_000
    reqs = tracemix.paper_trace(mix, n, rate=10.0, seed=5)
    pm, om = tracemix.parse_mix(mix)
    for key, target in (("prompt_tokens", pm), ("output_tokens", om)):
        xs = [getattr(r, key) for r in reqs]
        assert min(xs) >= 1 and max(xs) <= 6000
        se = statistics.pstdev(xs) / math.sqrt(n)  # heavy tail: ~2-3% of the mean at this n
        assert abs(statistics.fmean(xs) - target) < max(5 * se, 0.01 * target), (key, statistics.fmean(xs), target)
        assert abs(statistics.fmean(xs) - target) < 0.12 * target


def test_paper_trace_shares_arrivals_and_priorities_with_generate():
    a = tracemix.paper_trace("S-L", 300, rate=2.0, arrival="gamma", cv=3.0, high_fraction=0.25, seed=9)
    b = trace.generate(300, rate=2.0, arrival="gamma", cv=3.0, high_fraction=0.25, seed=9)
    assert [(r.arrival_s, r.priority) for r in a] == [(r.arrival_s, r.priority) for r in b]
    assert a == tracemix.paper_trace("S-L", 300, rate=2.0, arrival="gamma", cv=3.0, high_fraction=0.25, seed=9)
    # one mean per side: the S-L prompts are the S-S prompts, its outputs the L-L outputs
    ss, ll = (tracemix.paper_trace(m, 300, rate=2.0, arrival="gamma", cv=3.0, seed=9) for m in ("S-S", "L-L"))
    assert [r.prompt_tokens for r in a] == [r.prompt_tokens for r in ss]
    assert [r.output_tokens for r in a] == [r.output_tokens for r in ll]


def test_parse_mix():
    assert tracemix.parse_mix("M-L") == (256, 512)
    assert tracemix.parse_mix(" s-m ") == (128, 256)
    for bad in ("X-L", "M", "M-M-M", ""):
        with pytest.raises(ValueError, match="unknown mix"):
            tracemix.parse_mix(bad)


# ---------------------------------------------------------------------- our JSONL


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e6, allow_nan=False), st.integers(1, 10 ** 6), st.integers(1, 10 ** 6),
                          st.sampled_from(["high", "normal"])), max_size=30))
def test_jsonl_round_trip(tmp_path_factory, rows):
    reqs = tracemix.reindex(sorted((R(0, t, p, o, q) for t, p, o, q in rows), key=lambda r: r.arrival_s))
    path = tmp_path_factory.mktemp("rt") / "t.jsonl"
    traces.save_jsonl(reqs, path)
    assert traces.load_jsonl(path) == reqs
    assert traces.load(path) == reqs


def test_jsonl_sorted_defaults_and_extras(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"arrival_s": 2.5, "prompt_tokens": 10, "output_tokens": 3, "id": "x"}\n\n'
                 '{"arrival_s": 1, "prompt_tokens": 7, "output_tokens": 2.0, "priority": "high"}\n')
    assert traces.load(p) == [R(0, 1.0, 7, 2, "high"), R(1, 2.5, 10, 3)]


@pytest.mark.parametrize("line,message", [
    ('{"arrival_s": 1, "prompt_tokens": 7}', "line 2: missing output_tokens"),
    ('{"arrival_s": 1, "prompt_tokens": 7, "output_tokens": 0}', "line 2: prompt_tokens and output_tokens must be >= 1"),
    ('{"arrival_s": -1, "prompt_tokens": 7, "output_tokens": 1}', "line 2: arrival_s must be a finite"),
    ('{"arrival_s": 1, "prompt_tokens": 7.5, "output_tokens": 1}', "line 2: prompt_tokens must be a whole number"),
    ('{"arrival_s": 1, "prompt_tokens": 7, "output_tokens": 1, "priority": "urgent"}', "line 2: priority must be"),
    ('{"arrival_s": 1, "prompt_tokens": true, "output_tokens": 1}', "line 2: prompt_tokens must be a whole number"),
    ('{"arrival_s": 1,', "line 2: invalid JSON"),
    ('[1, 2]', "line 2: expected an object"),
])
def test_jsonl_errors_name_the_line(tmp_path, line, message):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"arrival_s": 0, "prompt_tokens": 1, "output_tokens": 1}\n' + line + "\n")
    with pytest.raises(traces.TraceFormatError) as exc:
        traces.load_jsonl(p)
    assert str(exc.value).startswith(f"{p}, {message}")


# ---------------------------------------------------------------------- ShareGPT

CONVERSATIONS = [
    {"id": "a", "conversations": [
        {"from": "human", "value": "Hello there, the cat sat."},
        {"from": "gpt", "value": "The dog ran with 12 red balls."},
        {"from": "human", "value": "Why?"},
        {"from": "gpt", "value": "Because the sun was bright (really bright)."}]},
    {"id": "b", "conversations": [  # a system turn, a human turn without an answer, an empty answer
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Step 3: paint the fence."},
        {"from": "gpt", "value": ""},
        {"from": "human", "value": "Again."},
        {"from": "human", "value": "Count to five."},
        {"from": "gpt", "value": "One two three four five."}]},
    {"id": "c", "conversations": []},
]


def _pairs(tokenize, history=False):
    out = []
    for conv in CONVERSATIONS:
        turns, before = conv["conversations"], 0
        for i, t in enumerate(turns):
            n = len(tokenize(t["value"]))
            if i and t["from"] == "gpt" and turns[i - 1]["from"] == "human":
                p, o = len(tokenize(turns[i - 1]["value"])), n
                if p and o:
                    out.append((p + (before - p if history else 0), o))
            before += n
    return out


@pytest.mark.parametrize("layout", ["json", "jsonl", "json.gz"])
def test_sharegpt_counts_the_tokenizers_tokens(tmp_path, tiny_tokenize, layout):
    path = tmp_path / f"sg.{layout}"
    if layout == "jsonl":
        text = "\n".join(json.dumps(c) for c in CONVERSATIONS) + "\n"
    else:
        text = json.dumps(CONVERSATIONS, indent=1)
    path.write_bytes(gzip.compress(text.encode()) if layout.endswith(".gz") else text.encode())
    skipped: list = []
    reqs = traces.load(path, tokenize=tiny_tokenize, rate=4.0, seed=3, skipped=skipped)
    want = _pairs(tiny_tokenize)
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == want and len(want) == 3
    assert want[0] == (len(tiny_tokenize("Hello there, the cat sat.")), len(tiny_tokenize("The dog ran with 12 red balls.")))
    # arrivals are trace.generate's of the same seed and rate
    gen = trace.generate(3, rate=4.0, seed=3)
    assert [r.arrival_s for r in reqs] == [r.arrival_s for r in gen]
    assert [r.index for r in reqs] == [0, 1, 2] and {r.priority for r in reqs} == {"normal"}
    assert skipped == [("line 2" if layout == "jsonl" else "item 1 (id 'b')", "empty response")]
    hist = traces.load(path, tokenize=tiny_tokenize, rate=4.0, seed=3, history=True)
    assert [(r.prompt_tokens, r.output_tokens) for r in hist] == _pairs(tiny_tokenize, history=True)
    assert hist[1].prompt_tokens == sum(len(tiny_tokenize(t["value"])) for t in CONVERSATIONS[0]["conversations"][:3])
    assert traces.load(path, tokenize=tiny_tokenize, limit=2) == traces.load(path, tokenize=tiny_tokenize)[:2]


def test_sharegpt_with_a_model_directory_uses_its_tokenizer(tmp_path, tiny_tokenizer_dir, tiny_tokenize):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(CONVERSATIONS))
    reqs = traces.load_sharegpt(path, model_path=tiny_tokenizer_dir)
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == _pairs(tiny_tokenize)
    # transformers counts the same (the class AutoTokenizer picks for this tokenizer_config.json)
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tiny_tokenizer_dir / "tokenizer.json"))
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == _pairs(lambda t: hf.encode(t, add_special_tokens=False))
    # and the CLI: --model, --limit, --json
    res = _cli("convert", str(path), str(tmp_path / "o.jsonl"), "--model", str(tiny_tokenizer_dir), "--limit", "2", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["summary"]["requests"] == 2
    assert traces.load(tmp_path / "o.jsonl") == reqs[:2]


@pytest.mark.parametrize("content,message", [
    ('{"id": "x"}', "item 0 (id 'x'): expected an object with a \"conversations\" list"),
    ('[{"id": "x", "conversations": []}, 7]', "item 1: expected an object"),
    ('[{"id": 5, "conversations": [{"from": "human"}]}]', "item 0 (id 5), turn 0: expected"),
    ('[{"conversations": []},\n {"conversations": ]', "line 2 column"),
])
def test_sharegpt_json_errors_name_the_item(tmp_path, content, message):
    p = tmp_path / "bad.json"
    p.write_text(content if content.startswith("[") else f"[{content}]")
    with pytest.raises(traces.TraceFormatError) as exc:
        traces.load(p, tokenize=str.split)
    assert str(exc.value).startswith(f"{p}, {message}")


def test_sharegpt_jsonl_errors_name_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(CONVERSATIONS[0]) + "\n" + '{"conversations": [{"from": "gpt", "value": 3}]}\n')
    with pytest.raises(traces.TraceFormatError, match=r"bad\.jsonl, line 2, turn 0: expected"):
        traces.load(p, fmt="sharegpt", tokenize=str.split)
    with pytest.raises(ValueError, match="give a tokenizer"):
        traces.load(p, fmt="sharegpt")


# ---------------------------------------------------------------------- BurstGPT

BURST = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
5.5,GPT-4,1087,0,1087,Conversation log
7,GPT-4,91,230,321,Conversation log
9.25,ChatGPT,320,12,332,API log
12,GPT-4,64,5,69,API log
"""


def test_burstgpt(tmp_path):
    p = tmp_path / "BurstGPT_1.csv"
    p.write_text(BURST)
    skipped: list = []
    assert traces.load(p, skipped=skipped) == [R(0, 0.0, 472, 18), R(1, 2.0, 91, 230), R(2, 4.25, 320, 12),
                                               R(3, 7.0, 64, 5)]
    assert skipped == [(3, "no response tokens (failed)")]
    assert traces.load_burstgpt(p, model="gpt-4") == [R(0, 0.0, 91, 230), R(1, 5.0, 64, 5)]
    assert traces.load_burstgpt(p, model="GPT-4", log_type="conversation") == [R(0, 0.0, 91, 230)]
    assert traces.load_burstgpt(p, rebase=False)[0].arrival_s == 5.0


@pytest.mark.parametrize("row,message", [
    ("x,GPT-4,1,1,2,API log", "line 3: Timestamp must be a number"),
    ("8,GPT-4,-1,1,0,API log", "line 3: Request tokens must be >= 0"),
    ("8,GPT-4,1.5,1,2,API log", "line 3: Request tokens must be a whole number"),
    ("8,GPT-4,1", "line 3: 3 fields, the header has 6"),
])
def test_burstgpt_errors_name_the_line(tmp_path, row, message):
    p = tmp_path / "b.csv"
    p.write_text(BURST.splitlines()[0] + "\n" + BURST.splitlines()[1] + "\n" + row + "\n")
    with pytest.raises(traces.TraceFormatError) as exc:
        traces.load(p)
    assert str(exc.value).startswith(f"{p}, {message}")


def test_csv_with_an_unknown_header(tmp_path):
    p = tmp_path / "b.csv"
    p.write_text("Timestamp,Model,Tokens\n1,a,2\n")
    with pytest.raises(traces.TraceFormatError, match=r"b\.csv, line 1: unknown CSV header"):
        traces.load(p)
    with pytest.raises(traces.TraceFormatError, match=r"b\.csv, line 1: not a BurstGPT CSV header: missing Request tokens"):
        traces.load(p, fmt="burstgpt")


# ---------------------------------------------------------------------- Azure

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.3302040,879,0
2023-11-16 18:16:00,1,2
2023-11-16 18:15:46.6805901,12,3
"""


def test_azure(tmp_path):
    p = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    p.write_text(AZURE)
    skipped: list = []
    reqs = traces.load(p, skipped=skipped)
    assert reqs == [R(0, 0.0, 374, 44), R(1, 1e-7, 12, 3), R(2, 4.314579, 396, 109), R(3, 13.31941, 1, 2)]
    assert skipped == [(4, "no generated tokens")]


def test_parse_timestamp():
    base = traces.parse_timestamp("2023-11-16 18:15:46")
    assert base == 1700158546 * 10 ** 9
    assert traces.parse_timestamp("2023-11-16 18:15:46.6805900") - base == 680_590_000
    assert traces.parse_timestamp("2023-11-16T18:15:46.123456789123") - base == 123_456_789
    assert traces.parse_timestamp("2023-11-16 18:15:46.5Z") - base == 500_000_000
    assert traces.parse_timestamp("2023-11-16 20:15:46+02:00") == base
    assert traces.parse_timestamp("  12.5 ") == 12_500_000_000
    for bad in ("2023-13-01 00:00:00", "2023-02-30 00:00:00", "yesterday", "2023-11-16", "nan"):
        with pytest.raises(ValueError, match="not a timestamp"):
            traces.parse_timestamp(bad)


def test_azure_errors_name_the_line(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text(AZURE + "2023-11-16 18:1x:00,5,5\n")
    with pytest.raises(traces.TraceFormatError, match=r"a\.csv, line 7: TIMESTAMP: not a timestamp"):
        traces.load(p)


# ---------------------------------------------------------------------- sniffing


def test_sniff(tmp_path):
    cases = {"a.csv": AZURE, "b.csv": BURST, "s.json": json.dumps(CONVERSATIONS), "t.jsonl": '{"arrival_s": 1}\n',
             "s.jsonl": json.dumps(CONVERSATIONS[0]) + "\n", "noext": "\n" + AZURE, "list": "[]"}
    want = {"a.csv": "azure", "b.csv": "burstgpt", "s.json": "sharegpt", "t.jsonl": "jsonl", "s.jsonl": "sharegpt",
            "noext": "azure", "list": "sharegpt"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        assert traces.sniff(tmp_path / name) == want[name], name
    (tmp_path / "b.csv.gz").write_bytes(gzip.compress(BURST.encode()))
    assert traces.sniff(tmp_path / "b.csv.gz") == "burstgpt"
    assert len(traces.load(tmp_path / "b.csv.gz")) == 4
    with pytest.raises(ValueError, match="unknown trace format"):
        traces.load(tmp_path / "b.csv", fmt="parquet")


# ---------------------------------------------------------------------- transformations

reqs_st = st.lists(st.tuples(st.floats(0, 1000, allow_nan=False), st.integers(1, 5000), st.integers(1, 5000)),
                   max_size=40).map(lambda rows: tracemix.reindex(sorted((R(0, t, p, o) for t, p, o in rows),
                                                                        key=lambda r: r.arrival_s)))


@settings(max_examples=40, deadline=None)
@given(reqs_st, st.floats(0.01, 100), st.floats(0, 1000), st.floats(0, 1000), st.integers(0, 50), st.integers(2, 6000))
def test_transformations(reqs, factor, a, b, n, max_len):
    start, end = min(a, b), max(a, b)
    scaled = tracemix.scale_rate(reqs, factor)
    assert [r.arrival_s for r in scaled] == [r.arrival_s / factor for r in reqs]
    assert [(r.prompt_tokens, r.output_tokens) for r in scaled] == [(r.prompt_tokens, r.output_tokens) for r in reqs]
    w = tracemix.window(reqs, start, end)
    assert [r.arrival_s for r in w] == [r.arrival_s - start for r in reqs if start <= r.arrival_s < end]
    assert all(0 <= r.arrival_s <= end - start for r in w)
    assert tracemix.window(reqs) == reqs
    lim = tracemix.limit(reqs, n)
    assert lim == reqs[:n]
    c = tracemix.clip(reqs, max_len)
    assert len(c) == len(reqs)
    for before, after in zip(reqs, c):
        assert after.prompt_tokens + after.output_tokens <= max_len and after.output_tokens >= 1
        if before.prompt_tokens + before.output_tokens <= max_len:
            assert after == before
        else:
            assert after.prompt_tokens == min(before.prompt_tokens, max_len - 1)
    assert tracemix.clip(reqs, max_len, drop=True) == tracemix.reindex(
        r for r in reqs if r.prompt_tokens + r.output_tokens <= max_len)
    for out in (scaled, w, lim, c):
        assert [r.index for r in out] == list(range(len(out)))


def test_transformations_refuse_nonsense():
    reqs = [R(0, 1.0, 5, 5)]
    for call in (lambda: tracemix.scale_rate(reqs, 0), lambda: tracemix.scale_rate(reqs, -1),
                 lambda: tracemix.window(reqs, 5, 1), lambda: tracemix.limit(reqs, -1), lambda: tracemix.clip(reqs, 1),
                 lambda: tracemix.with_priorities(reqs, 1.5)):
        with pytest.raises(ValueError):
            call()


def test_with_priorities_matches_generate():
    plain = trace.generate(200, rate=3.0, seed=4)
    assert tracemix.with_priorities(plain, 0.3, seed=4) == trace.generate(200, rate=3.0, seed=4, high_fraction=0.3)
    assert {r.priority for r in tracemix.with_priorities(plain, 1.0)} == {"high"}


def test_stats():
    s = tracemix.stats([R(0, 0.5, 10, 1), R(1, 2.0, 30, 3, "high"), R(2, 4.0, 20, 2)])
    assert s["requests"] == 3 and s["duration_s"] == 4.0 and s["offered_rate"] == 0.75
    assert s["prompt_tokens"] == {"mean": 20, "median": 20, "max": 30, "min": 10, "p90": 30, "p99": 30, "total": 60}
    assert s["high_priority"] == 1 and s["first_arrival_s"] == 0.5
    assert tracemix.stats([]) == {"requests": 0}


# ---------------------------------------------------------------------- CLI


def test_cli_generate_convert_show(tmp_path):
    out = tmp_path / "m.jsonl"
    res = _cli("generate", str(out), "--mix", "M-L", "-n", "500", "--rate", "5", "--arrival", "gamma", "--cv", "2",
               "--high-fraction", "0.2", "--seed", "1", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["mix"] == "M-L" and data["prompt_mean"] == 256 and data["summary"]["requests"] == 500
    assert traces.load(out) == tracemix.paper_trace("M-L", 500, 5.0, "gamma", 2.0, 0.2, 1)

    res = _cli("generate", "-", "-n", "50", "--prompt-min", "8", "--prompt-max", "64", "--alpha", "0.5")
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert len(lines) == 50 and all(8 <= x["prompt_tokens"] <= 64 for x in lines)

    burst = tmp_path / "b.csv"
    burst.write_text(BURST)
    res = _cli("convert", str(burst), str(tmp_path / "c.jsonl"), "--start", "1", "--end", "8", "--rate-scale", "2",
               "--max-model-len", "300", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["skipped"] == {"no response tokens (failed)": 1}
    assert traces.load(tmp_path / "c.jsonl") == [R(0, 0.5, 91, 209), R(1, 1.625, 299, 1), R(2, 3.0, 64, 5)]

    res = _cli("show", str(tmp_path / "c.jsonl"), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["summary"]["output_tokens"]["total"] == 215
    res = _cli("show", str(burst))
    assert res.exit_code == 0 and "4 requests, 1 rows skipped" in res.stdout


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "a.csv"
    bad.write_text(AZURE + "2023-11-16 18:16:01,five,3\n")
    sg = tmp_path / "s.json"
    sg.write_text(json.dumps(CONVERSATIONS))
    for args, code, text in [
        (("show", str(bad)), 1, f"{bad}, line 7: ContextTokens must be a whole number"),
        (("show", str(tmp_path / "none.csv")), 1, "no such file"),
        (("convert", str(sg), "-"), 2, "give --model DIR"),
        (("show", str(bad), "--format", "parquet"), 2, "unknown --format"),
        (("show", str(bad), "--filter-model", "x"), 2, "for BurstGPT"),
        (("generate", "-", "--mix", "X-Y"), 2, "unknown mix"),
        (("generate", "-", "--mix", "S-S", "--alpha", "1"), 2, "--alpha is for explicit bounds"),
        (("generate", "-", "--arrival", "uniform"), 2, "unknown --arrival"),
    ]:
        res = _cli(*args)
        assert res.exit_code == code, (args, res.output)
        assert text in res.stderr and len(res.stderr.strip().splitlines()) == 1, (args, res.stderr)
