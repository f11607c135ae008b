import pytest
from hypothesis import given, settings, strategies as st

from daemons.proxy.api.protocol import ApiError, ChatRequest, CompletionRequest, StopChecker, decode_body, parse_priority


def test_stop_string_split_across_tokens():
    s = StopChecker(["STOP"])
    sent = []
    for piece in ["hello ", "wor", "ld ST", "O", "P and more"]:
        text, stopped = s.feed(piece)
        sent.append(text)
        if stopped:
            break
    assert "".join(sent) == "hello world "
    assert stopped


def test_no_stop_streams_everything_at_once():
    s = StopChecker([])
    assert s.feed("ab") == ("ab", False)
    assert s.feed("c") == ("c", False)


def test_held_text_is_flushed_at_the_end():
    s = StopChecker(["xyz"])
    assert s.feed("abcx") == ("ab", False)
    assert s.flush() == "cx"


def test_earliest_stop_wins():
    s = StopChecker(["b", "a"])
    assert s.feed("zab") == ("z", True)


@pytest.mark.parametrize("body, param", [
    (b'{"model": "m", "prompt": "x", "max_tokens": -1}', "max_tokens"),
    (b'{"model": "m"}', "prompt"),
    (b'{"prompt": "x"}', "model"),
    (b'{"model": "m", "prompt": "x", "temperature": 9}', "temperature"),
    (b'{"model": "m", "prompt": "x", "n": 0}', "n"),
    (b'{"model": "m", "prompt": "x", "n": 33}', "n"),
    (b'{"model": "m", "prompt": "x", "seed": 9223372036854775808}', "seed"),
    (b'{"model": "m", "prompt": {"a": 1}}', "prompt"),
])
def test_bad_completion_bodies_name_the_param(body, param):
    with pytest.raises(ApiError) as exc:
        decode_body(body, CompletionRequest)
    assert exc.value.status == 400 and exc.value.param == param
    assert exc.value.body()["error"]["type"] == "invalid_request_error"


def test_chat_needs_messages():
    with pytest.raises(ApiError) as exc:
        decode_body(b'{"model": "m", "messages": []}', ChatRequest)
    assert exc.value.param == "messages"


def test_not_json_and_empty():
    for body in (b"{nope", b"", b"[1, 2]"):
        with pytest.raises(ApiError) as exc:
            decode_body(body, CompletionRequest)
        assert exc.value.status == 400


def test_vllm_extra_fields_accepted():
    req = decode_body(b'{"model": "m", "prompt": [1, 2], "ignore_eos": true, "top_k": 5, "min_tokens": 2, '
                      b'"repetition_penalty": 1.1, "stop": "x", "seed": 3}', CompletionRequest)
    sp = req.sampling(8, None)
    assert (sp.ignore_eos, sp.top_k, sp.min_tokens, sp.repetition_penalty, sp.seed, sp.max_tokens) == (True, 5, 2, 1.1, 3, 8)
    assert req.stop_strings() == ["x"]


def test_priority():
    assert parse_priority(None, None) == 0
    assert parse_priority("high", None) == 1
    assert parse_priority("normal", "HIGH") == 1
    with pytest.raises(ApiError, match="priority must be one of"):
        parse_priority("urgent", None)


@pytest.mark.parametrize("kind, extra, param", [
    (CompletionRequest, '"logit_bias": {"5": 10}', "logit_bias"),
    (CompletionRequest, '"echo": true', "echo"),
    (CompletionRequest, '"suffix": "end"', "suffix"),
    (CompletionRequest, '"best_of": 3', "best_of"),
    (CompletionRequest, '"guided_json": {"type": "object"}', "guided_json"),
    (CompletionRequest, '"use_beam_search": true', "use_beam_search"),
    (ChatRequest, '"functions": [{"name": "f"}]', "functions"),
    (ChatRequest, '"function_call": "auto"', "function_call"),
    (ChatRequest, '"top_logprobs": 2', "top_logprobs"),
    (ChatRequest, '"modalities": ["audio"]', "modalities"),
])
def test_unsupported_fields_are_refused_by_name(kind, extra, param):
    base = '"prompt": "x"' if kind is CompletionRequest else '"messages": [{"role": "user", "content": "x"}]'
    if extra.startswith('"messages"'):
        base = ""
    body = "{" + ", ".join(p for p in ('"model": "m"', base, extra) if p) + "}"
    req = decode_body(body.encode(), kind)
    with pytest.raises(ApiError) as exc:
        req.unsupported()
        if kind is ChatRequest:
            req.prompt_messages()
    assert exc.value.status == 400 and exc.value.param == param


@pytest.mark.parametrize("kind, extra", [
    (CompletionRequest, '"logit_bias": {}, "best_of": 2, "n": 2, "echo": false, "suffix": null'),
    (CompletionRequest, '"response_format": {"type": "text"}'),
    (ChatRequest, '"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "modalities": ["text"]'),
    (ChatRequest, '"logprobs": true, "top_logprobs": 3, "parallel_tool_calls": false'),
])
def test_off_values_of_unsupported_fields_are_fine(kind, extra):
    base = '"prompt": "x"' if kind is CompletionRequest else '"messages": [{"role": "user", "content": "x"}]'
    decode_body(("{" + f'"model": "m", {base}, {extra}' + "}").encode(), kind).unsupported()


def test_derived_seeds():
    from daemons.proxy.api.protocol import derive_seed

    assert derive_seed(None, 3) is None
    assert [derive_seed(7, k) for k in range(3)] == [7, 8, 9]
    assert derive_seed(2**63 - 1, 1) == -(2**63)


@pytest.mark.parametrize("kind, field", [
    (CompletionRequest, "min_tokens"), (CompletionRequest, "max_tokens"), (CompletionRequest, "top_k"),
    (CompletionRequest, "best_of"), (ChatRequest, "max_completion_tokens"), (ChatRequest, "min_tokens"),
])
def test_counts_past_the_wire_limit_are_a_400_naming_the_field(kind, field):
    # Found by the schema fuzzer: min_tokens = 20019767709656006656 reached the wire and msgpack raised (a 500).
    base = '"prompt": "x"' if kind is CompletionRequest else '"messages": [{"role": "user", "content": "x"}]'
    for value in (2**31, 20019767709656006656):
        with pytest.raises(ApiError) as exc:
            decode_body(f'{{"model": "m", {base}, "{field}": {value}}}'.encode(), kind)
        assert exc.value.status == 400 and field in exc.value.message


class KeepAll:
    """The stop checker as it was, keeping the whole output's text: the reference for the windowed one."""

    def __init__(self, stops):
        self.stops, self.hold, self.text, self.sent = stops, max((len(s) for s in stops), default=1) - 1, "", 0

    def feed(self, piece):
        if not self.stops:
            return piece, False
        self.text += piece
        start = max(0, self.sent - self.hold)
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.text, self.sent = self.text[self.sent:cut], self.text[:cut], cut
            return out, True
        safe = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def flush(self):
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


@settings(max_examples=300)
@given(st.lists(st.text("abc", min_size=1, max_size=4), max_size=4),
       st.lists(st.text("abc", max_size=5), max_size=30))
def test_stop_checking_keeps_a_window_and_says_what_keeping_everything_says(stops, pieces):
    stops = [s for s in stops if s]
    new, old = StopChecker(stops), KeepAll(stops)
    for piece in pieces:
        got = new.feed(piece)
        assert got == old.feed(piece)
        assert len(new.text) <= new.hold + len(piece) + new.hold  # the window, not the output
        if got[1]:
            return
    assert new.flush() == old.flush()


def test_stop_checking_work_per_token_does_not_grow_with_the_output():
    s = StopChecker(["never appears"])
    for _ in range(100_000):
        s.feed("tok ")
    assert len(s.text) <= 2 * s.hold + len("tok ")  # what is held back, and as much sent before it
