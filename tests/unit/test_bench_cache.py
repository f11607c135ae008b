"""``llumnixctl bench cache``'s parts that need no engine: prompts as text of exactly the trace's length
(every word one token of the model), and the summary over rounds."""

from __future__ import annotations

import pytest

from llumnixctl.experiments.bench import cache as bench_cache
from llumnixctl.experiments.traces.files import tokenizer
from llumnixctl.experiments.traces.words import Words
from llumnixctl.lab.model import write_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


def test_a_prompt_is_exactly_its_trace_length_and_shared_segments_are_shared_text(model):
    words, tok = Words(model), tokenizer(model)
    for kind in bench_cache.TRACES:
        reqs = bench_cache.make_trace(kind, 30, 4.0, 0)
        for r in reqs:
            assert len(tok(words.text(r))) == r.prompt_tokens
    a, b = [r for r in bench_cache.make_trace("hotspot", 30, 4.0, 0) if r.segments[0][0].endswith("-p0")][:2]
    n = a.segments[0][1]
    assert tok(words.text(a))[:n] == tok(words.text(b))[:n] and words.text(a) != words.text(b)


def test_the_summary_gives_medians_and_ranges_over_rounds():
    rows = [{"trace": "t", "system": "s", "p99_ttft_ms": x, "mean_ttft_ms": x / 2, "failed": f,
             "prefix_cache": {"hit_rate": h}, "max_running_share": 0.3} for x, f, h in ((300, 0, .5), (100, 1, .7), (200, 0, .6))]
    s = bench_cache.summarize(rows)["t"]["s"]
    assert s["p99_ttft_ms"] == {"median": 200, "min": 100, "max": 300}
    assert s["hit_rate"]["median"] == .6 and s["failed"] == 1 and s["rounds"] == 3


def test_a_text_prompt_less_the_tokenizers_bos_is_the_trace_length_once_the_engine_adds_it(model):
    """``bench serve --text-prompts`` (smg takes no token ids): the words less the special tokens the engine puts
    before a text prompt, so that what the engine counts is the trace's length."""
    from tokenizers import Tokenizer

    from llumnixctl.experiments.traces import gen
    from llumnixctl.experiments.traces.files import special_lead

    fast = Tokenizer.from_file(str(model / "tokenizer.json"))
    lead = special_lead(model)
    assert lead == len(fast.encode("the").ids) - len(fast.encode("the", add_special_tokens=False).ids)
    words = Words(model)
    for r in gen.generate(20, rate=4.0, prompt=(1, 300), output=(1, 8), seed=3):
        assert len(fast.encode(words.text(r, drop=lead)).ids) == max(r.prompt_tokens, 1 + lead)
