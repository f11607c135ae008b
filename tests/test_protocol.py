import pytest

from daemons.proxy.protocol import ApiError, ChatRequest, CompletionRequest, StopChecker, decode_body, parse_priority


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
    (b'{"model": "m", "prompt": "x", "n": 2}', "n"),
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
