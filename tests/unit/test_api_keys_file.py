"""The proxy's API keys file in process (daemons/proxy/front/apikeys.py): parsing, the errors that name the file and
the key, reloading on change with the last good keys kept, and how often the file is looked at."""

from __future__ import annotations

import hashlib
import logging

import pytest

from daemons.proxy.front.apikeys import ApiKeys, ApiKeysError, Principal, Unauthorized, parse
from tests.support.apikeys import KEYS, render


def test_keys_file_parsing(tmp_path):
    path = str(tmp_path / "keys.toml")
    entries = parse(path, render())
    by_name = {e.principal.name: e for e in entries.values()}
    assert set(by_name) == set(KEYS) | {"limited"}
    assert by_name["boss"].principal == Principal("boss", True) and by_name["alice"].principal.high_priority is False
    assert by_name["limited"].principal == Principal("limited", requests_per_minute=1)
    assert hashlib.sha256(KEYS["hashed"][0].encode()).digest() in entries
    assert parse(path, "") == {}


@pytest.mark.parametrize("text, words", [
    ("[keys.a]\nkey = \"k1\"\nsha256 = \"" + "0" * 64 + "\"\n", ["[keys.a]", "exactly one of"]),
    ("[keys.a]\nhigh_priority = true\n", ["[keys.a]", "exactly one of"]),
    ("[keys.a]\nsha256 = \"abc\"\n", ["[keys.a]", "64 hex digits"]),
    ("[keys.a]\nkey = \"has space\"\n", ["[keys.a]", "visible ASCII"]),
    ("[keys.a]\nkey = \"\"\n", ["[keys.a]", "non-empty"]),
    ("[keys.a]\nkey = \"k1\"\nhigh_priorty = true\n", ["[keys.a]", "unknown field 'high_priorty'"]),
    ("[keys.a]\nkey = \"k1\"\nenabled = \"no\"\n", ["[keys.a]", "enabled must be true or false"]),
    ("[keys.a]\nkey = \"k1\"\n[keys.b]\nkey = \"k1\"\n", ["[keys.b]", "same key as [keys.a]"]),
    ("[keys.\"a b\"]\nkey = \"k1\"\n", ["[keys.a b]", "name"]),
    ("[key.a]\nkey = \"k1\"\n", ["unknown entry 'key'"]),
    ("keys = 3\n", ["[keys.NAME] tables"]),
    ("[keys.a\nkey = 1\n", ["not valid TOML"]),
])
def test_a_bad_keys_file_names_the_file_and_the_key(tmp_path, text, words):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(ApiKeysError) as err:
        ApiKeys.load(str(path))
    assert str(path) in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_check_reloads_on_change_and_keeps_the_last_good_keys(tmp_path, monkeypatch, caplog):
    path = tmp_path / "keys.toml"
    path.write_text('[keys.a]\nkey = "sk-a-1"\n[keys.b]\nkey = "sk-b-1"\n')
    keys = ApiKeys.load(str(path))
    monkeypatch.setattr(ApiKeys, "CHECK_INTERVAL_S", 0.0)
    keys._next_look = 0.0
    assert keys.check("Bearer sk-a-1") == Principal("a")
    assert keys.check("bearer  sk-b-1 ") == Principal("b")
    for header, presented in ((None, False), ("", False), ("Bearer", True), ("Token sk-a-1", True),
                              ("Bearer sk-a-2", True), ("Bearer sk-a-1 x", True)):
        with pytest.raises(Unauthorized) as err:
            keys.check(header)
        assert err.value.status == 401 and err.value.body()["error"]["code"] == "invalid_api_key"
        assert err.value.headers["WWW-Authenticate"].startswith("Bearer")
        assert ("error=" in err.value.headers["WWW-Authenticate"]) is presented
    path.write_text('[keys.a]\nkey = "sk-a-1"\nenabled = false\n[keys.b]\nkey = "sk-b-1"\n[keys.c]\nkey = "sk-c-1"\n')
    with pytest.raises(Unauthorized):
        keys.check("Bearer sk-a-1")
    assert keys.check("Bearer sk-c-1").name == "c"
    with caplog.at_level(logging.ERROR, logger="llumnix.proxy"):
        path.write_text('[keys.b]\nkey = "sk-b-1"\nbogus = 1\n')  # broken: the keys before stay in force
        assert keys.check("Bearer sk-c-1").name == "c"
        assert keys.check("Bearer sk-c-1").name == "c"
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "bogus" in errors[0].getMessage() and str(path) in errors[0].getMessage()
        path.unlink()  # gone: every key is refused (deleting the file revokes them), said once
        for _ in range(2):
            with pytest.raises(Unauthorized):
                keys.check("Bearer sk-c-1")
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2 and "is gone: every key is refused" in errors[1], errors
    path.write_text('[keys.b]\nkey = "sk-b-1"\n')
    with pytest.raises(Unauthorized):
        keys.check("Bearer sk-c-1")
    assert keys.names() == ["b"]


def test_reload_is_checked_at_most_once_a_second(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text('[keys.a]\nkey = "sk-a-1"\n')
    keys = ApiKeys.load(str(path))
    looks = []
    keys.reload = lambda force=True: looks.append(force) or False
    for _ in range(50):
        keys.check("Bearer sk-a-1")
    assert len(looks) <= 1
    keys._next_look = 0.0
    keys.check("Bearer sk-a-1")
    assert looks[-1] is False and len(looks) <= 2
