"""The proxy's tokenizers: a real model's tokenizer.json with incremental detokenization, and the sim's."""

import pytest
from hypothesis import given, settings, strategies as st

from daemons.proxy.api.tokenizer import HFTokenizer, SimTokenizer, TokenizerError, load_tokenizer
from llumnixctl.lab.model import write_tiny_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return HFTokenizer(write_tiny_model(tmp_path_factory.mktemp("m") / "tiny"))


def _stream(tok, ids):
    d = tok.detokenizer()
    return "".join(d.add(i) for i in ids) + d.flush()


def test_streamed_text_equals_whole_decode(hf):
    text = "Live migration moves KV caches — ünïcödé, 你好, emoji 🚀 and numbers 12345."
    ids = hf.encode(text, add_special_tokens=False)
    assert _stream(hf, ids) == hf.decode(ids) == text


def _decode_stream(hf, ids):
    """What vLLM's server sends for these output ids: its detokenizer is tokenizers' DecodeStream, which never
    releases a trailing incomplete UTF-8 sequence."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=True)
    return "".join(stream.step(hf._tok, i) or "" for i in ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2517), max_size=40))
def test_streamed_text_equals_vllms_for_any_ids(hf, ids):
    # Random ids split UTF-8 characters anywhere: held-back bytes come out exactly once, and an incomplete
    # character at the end is dropped, as vLLM drops it.
    out = _stream(hf, ids)
    assert out == _decode_stream(hf, ids)
    full = hf.decode(ids)
    assert full.startswith(out) and (out == full or full.endswith("\ufffd"))


def test_trailing_partial_character_is_dropped_like_vllm(hf):
    ids = hf.encode("ab 🚀", add_special_tokens=False)
    assert hf.decode(ids[:-1]).endswith("\ufffd")  # the rocket's last byte is missing
    for cut in (1, 2, 3):  # 3, 2 or 1 of the rocket's 4 bytes
        assert _stream(hf, ids[:-cut]) == _decode_stream(hf, ids[:-cut]) == "ab "
    assert _stream(hf, ids) == "ab 🚀"


def test_no_partial_characters_are_emitted(hf):
    ids = hf.encode("🚀🚀 你好", add_special_tokens=False)
    d = hf.detokenizer()
    for i in ids:
        assert "\ufffd" not in d.add(i)


def test_bos_and_chat_template(hf):
    ids = hf.encode("hello")
    assert ids[0] == hf.bos_id
    assert hf.encode("hello", add_special_tokens=False)[0] != hf.bos_id
    prompt = hf.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert "be brief" in prompt and "hi" in prompt and prompt.startswith(hf.bos_token)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        HFTokenizer(tmp_path)


def test_sim_tokenizer_is_context_free():
    tok = load_tokenizer("", 32000, 2)
    assert isinstance(tok, SimTokenizer)
    ids = tok.encode("hello, world")
    assert len(ids) == 3 and all(3 <= i < 32000 for i in ids)
    assert _stream(tok, [100, 2, 200]) == tok.decode_token(100) + tok.decode_token(200)
    assert tok.decode_token(2) == ""


class _Counting:
    """A decode function that counts the ids it is given (the detokenizer's work)."""

    def __init__(self, hf):
        self.hf, self.work = hf, 0

    def __call__(self, ids):
        self.work += len(ids)
        return self.hf.decode(ids)


def test_tokens_that_decode_to_nothing_cost_linear_time(hf):
    # Special tokens are skipped when decoding: a stream of them adds no text. The window must still move on
    # (it used to grow with every such token: each token decoded all of them again, quadratic).
    from daemons.proxy.api.tokenizer import _IncrementalDetokenizer

    eos = hf._tok.token_to_id(hf.eos_token)
    assert hf.decode([eos]) == ""
    counting = _Counting(hf)
    d = _IncrementalDetokenizer(counting)
    n = 4000
    out = "".join(d.add(eos) for _ in range(n))
    text = hf.encode(" and then words", add_special_tokens=False)
    out += "".join(d.add(i) for i in text) + d.flush()
    assert out == hf.decode([eos] * n + text) == " and then words"
    assert counting.work < 40 * (n + len(text))  # bounded window: linear (quadratic would be ~n*n = 16M)


def test_a_text_longer_than_the_limit_times_the_longest_token_is_refused_before_encoding(hf, monkeypatch):
    from daemons.proxy.front.checks import Checks
    from daemons.proxy.api.protocol import ApiError, ChatRequest, CompletionRequest, decode_body

    per = hf.max_token_chars
    assert per == max(len(t) for t in hf._tok.get_vocab(with_added_tokens=True))
    some = "".join(chr(c) for c in range(32, 0x3000, 7))  # no text encodes to fewer tokens than chars / per
    assert len(hf.encode(some * 3, add_special_tokens=False)) * per >= len(some * 3)

    encoded = []
    monkeypatch.setattr(hf, "encode", lambda text, add_special_tokens=True: encoded.append(text) or [1])
    c = Checks(hf, "m", 4096, max_prompt_tokens=10)
    long = "x" * (10 * per + 1)
    with pytest.raises(ApiError) as exc:
        c.prompt_ids(decode_body(f'{{"model": "m", "prompt": "{long}"}}'.encode(), CompletionRequest))
    assert exc.value.status == 400 and exc.value.body()["error"]["code"] == "prompt_too_long"
    chat = decode_body(f'{{"model": "m", "messages": [{{"role": "user", "content": "{long}"}}]}}'.encode(), ChatRequest)
    with pytest.raises(ApiError) as exc:
        c.chat_prompt(chat, True)
    assert exc.value.body()["error"]["param"] == "messages" and encoded == []  # neither was encoded
    assert c.prompt_ids(decode_body(f'{{"model": "m", "prompt": "{long[:-1]}"}}'.encode(), CompletionRequest)) == [1]


def test_sim_tokens_stand_for_bounded_text_so_a_huge_prompt_is_refused_before_encoding(monkeypatch):
    """A word longer than a sim token's bound is several tokens (so the character bound holds), and an 8 MiB
    prompt of one repeated letter is refused by its length alone, without the work of encoding it."""
    from daemons.proxy.front.checks import Checks
    from daemons.proxy.api.protocol import ApiError, CompletionRequest, decode_body

    tok = SimTokenizer(32000, 2)
    per = tok.max_token_chars
    assert len(tok.encode("a" * (3 * per + 1))) == 4 and len(tok.encode("a" * per)) == 1
    assert len(tok.encode("hello, world")) == 3

    encoded = []
    monkeypatch.setattr(tok, "encode", lambda text, add_special_tokens=True: encoded.append(len(text)) or [1])
    body = b'{"model": "llumnix-sim", "prompt": "' + b"a" * (8 << 20) + b'"}'
    with pytest.raises(ApiError) as exc:
        Checks(tok, "llumnix-sim", 4096).prompt_ids(decode_body(body, CompletionRequest))
    assert exc.value.status == 400 and exc.value.body()["error"]["code"] == "prompt_too_long" and encoded == []


def test_chat_template_beside_the_config_is_found_and_wins(tmp_path):
    """Current transformers writes the template to chat_template.jinja, not into tokenizer_config.json (as
    `llumnixctl model smollm2` does); transformers and vLLM take that file over the config's template."""
    import json
    import shutil

    src = write_tiny_model(tmp_path / "tiny")
    conf = json.loads((src / "tokenizer_config.json").read_text())
    del conf["chat_template"]
    (src / "tokenizer_config.json").write_text(json.dumps(conf))
    with pytest.raises(TokenizerError, match="no chat template"):
        HFTokenizer(src).apply_chat_template([{"role": "user", "content": "hi"}])
    (src / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                                            "{% if add_generation_prompt %}[assistant] {% endif %}")
    assert HFTokenizer(src).apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant] "
    both = tmp_path / "both"
    shutil.copytree(src, both)
    conf["chat_template"] = "config's template"
    (both / "tokenizer_config.json").write_text(json.dumps(conf))
    assert HFTokenizer(both).apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant] "
