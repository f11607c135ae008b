"""The instance's metrics, and the constants that tune its request listings and prefix queries."""

from __future__ import annotations

from daemons import metrics

MOVED_LATELY_S = 30.0  # a request listing names the requests that migrated out this recently
# After a request listing, the engine's request rows are kept current (after every step and boundary) for this
# long, so that the next listings are answered at once instead of after the step in progress; a step this
# long keeps them too (the rows cost well under 1% of it).
LISTING_WINDOW_S = 30.0
LONG_STEP_S = 0.1
ROWS_EVERY_S = 0.2  # during a run of steps the rows are refreshed at most this often
PREFIX_QUERY_TOKENS = 1 << 16  # at most this many prompt tokens go in one prefix query to a destination
M_REQUESTS = metrics.counter("instance", "llumnix_instance_requests_total", "Requests received from proxies")
M_FINISHED = metrics.counter("instance", "llumnix_instance_requests_finished_total",
                             "Requests finished here, by finished_reason (stop, length, abort)", ["finished_reason"],
                             preset=[("stop",), ("length",), ("abort",)])
M_REJECTED = metrics.counter("instance", "llumnix_instance_requests_rejected_total", "Requests refused as invalid")
M_TOKENS = metrics.counter("instance", "llumnix_instance_generation_tokens_total", "Output tokens generated")
M_STEP = metrics.histogram("instance", "llumnix_instance_step_seconds",
                           "Wall time of one engine step, model time included",
                           buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
M_BLOCKS_USED = metrics.gauge("instance", "llumnix_instance_kv_blocks_used", "KV blocks in use")
M_BLOCKS_TOTAL = metrics.gauge("instance", "llumnix_instance_kv_blocks_total", "KV blocks in all")
M_KV_USAGE = metrics.gauge("instance", "llumnix_instance_kv_cache_usage_perc",
                           "KV cache usage, blocks used / blocks in all: 1 means full (as vllm:kv_cache_usage_perc)")
M_PREFIX_BLOCKS = metrics.gauge("instance", "llumnix_instance_prefix_cache_blocks",
                                "Blocks whose content the prefix cache holds (in use or free until taken)")
M_PREFIX_QUERIED = metrics.counter("instance", "llumnix_instance_prefix_cache_queried_tokens_total",
                                   "Prompt tokens looked up in the prefix cache at admission")
M_PREFIX_HIT = metrics.counter("instance", "llumnix_instance_prefix_cache_hit_tokens_total",
                               "Of those, tokens found cached (their prefill skipped): hit rate = hit / queried")
M_RUNNING = metrics.gauge("instance", "llumnix_instance_running_requests", "Requests running")
M_WAITING = metrics.gauge("instance", "llumnix_instance_waiting_requests", "Requests waiting")
M_PREEMPTIONS = metrics.counter("instance", "llumnix_instance_preemptions_total",
                                "Preemptions (recompute) by the engine (as vllm:num_preemptions)")
M_BAD_FRAMES = metrics.malformed_frames("instance")
M_REDISPATCHED = metrics.counter("instance", "llumnix_instance_requests_redispatched_total",
                                 "Queued requests given back to their proxy for re-dispatch (draining)")
M_ORPHANED = metrics.counter("instance", "llumnix_instance_requests_orphaned_total",
                             "Requests aborted because their proxy was gone")
M_FAILOVERS_IN = metrics.counter("instance", "llumnix_instance_failovers_in_total",
                                 "Requests taken over from another instance by re-prefill")
M_HANDOVERS = metrics.counter("instance", "llumnix_instance_handovers_total",
                              "Handovers out of this (prefill) instance that ended, by reason (handover: at the first "
                              "token; role: decoding when the role changed) and outcome (committed, aborted)",
                              ["reason", "outcome"])
M_HANDOVER_S = metrics.histogram("instance", "llumnix_instance_handover_seconds",
                                 "A handover from the order to the destination's commit (the request decodes here "
                                 "meanwhile; the client's gap is the last stage: llumnix_proxy_migration_gap_seconds)",
                                 buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
M_HANDOVER_BYTES = metrics.histogram("instance", "llumnix_instance_handover_bytes",
                                     "KV bytes a committed handover sent (cached prefix blocks on the destination are not sent)",
                                     buckets=(1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10))
M_BEAT_LATE = metrics.histogram("instance", "llumnix_instance_heartbeat_lateness_seconds",
                                "How late each heartbeat tick of the llumlet ran (0: on time): what a busy engine or "
                                "host costs the liveness and load signals",
                                buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0))
M_QUERY = metrics.histogram("instance", "llumnix_instance_query_seconds",
                            "From a request-list query's arrival to its answer (answered at once from the request table)",
                            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
M_HEALTHY = metrics.gauge("instance", "llumnix_instance_healthy",
                          "1 while engine steps make progress, 0 while stalled (instance.step_timeout_s)")
M_PREDICTED_TTFT = metrics.gauge("instance", "llumnix_instance_predicted_ttft_seconds",
                                 "Time to first token predicted for a new request of a 512-token prompt, by the "
                                 "instance's step-time model (daemons/policy/slo.py)")
M_PREDICTED_TPOT = metrics.gauge("instance", "llumnix_instance_predicted_tpot_seconds",
                                 "Time per output token predicted for a new request of a 512-token prompt joining "
                                 "the batch")
M_SLO_JUDGED = metrics.gauge("instance", "llumnix_instance_slo_judged_requests",
                             "Requests with an SLO that finished here in the last slo.window_s")
M_SLO_MET = metrics.gauge("instance", "llumnix_instance_slo_met_requests",
                          "Of those, the requests that met both their TTFT and TPOT targets")
M_SLO_ATTAINMENT = metrics.gauge("instance", "llumnix_instance_slo_attainment",
                                 "slo_met / slo_judged over the last slo.window_s (NaN while none was judged)")
M_ADAPTER_LOADS = metrics.counter("instance", "llumnix_instance_adapter_loads_total",
                                  "LoRA adapters loaded here (an order, a request or a migration for one not held)")
M_ADAPTER_EVICTIONS = metrics.counter("instance", "llumnix_instance_adapter_evictions_total",
                                      "LoRA adapters unloaded to make room for another (the least recently used idle one)")
M_ADAPTERS_HELD = metrics.gauge("instance", "llumnix_instance_adapters_held", "LoRA adapters held now")
M_ADAPTER_TOKENS = metrics.counter("instance", "llumnix_instance_adapter_generation_tokens_total",
                                   "Output tokens of requests that run with a LoRA adapter, by adapter", ["adapter"])
M_ADAPTER_REQUESTS = metrics.counter("instance", "llumnix_instance_adapter_requests_total",
                                     "Requests taken in that run with a LoRA adapter, by adapter", ["adapter"])
M_PREFIX_TOKENS = metrics.counter("instance", "llumnix_prefix_tokens_total",
                                  "Prompt tokens of new requests by where their KV came from: engine (its prefix cache), "
                                  "host (restored from the host KV tier), pulled (from another instance), recomputed "
                                  "(prefilled)", ["source"],
                                  preset=[("engine",), ("host",), ("pulled",), ("recomputed",)])
M_TIER_BLOCKS = metrics.gauge("instance", "llumnix_kv_tier_blocks", "KV blocks in the host-memory tier (kv_tier.host_mb)")
M_TIER_CAPACITY = metrics.gauge("instance", "llumnix_kv_tier_capacity_blocks", "The host-memory tier's size in KV blocks")
M_RESTORED_BYTES = metrics.counter("instance", "llumnix_kv_restored_bytes_total",
                                   "KV bytes restored from the host tier into the engine")
M_RESTORE_S = metrics.histogram("instance", "llumnix_kv_restore_seconds",
                                "One restore from the host tier into the engine (a new request's blocks found there)",
                                buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
M_RETAINED = metrics.gauge("instance", "llumnix_kv_retained_blocks",
                           "KV blocks retained for sessions within their TTL (engine and host tier; free, reclaimable)")


def tier_gauges(load) -> None:
    """The host tier's and retention's gauges from a load report (wire.InstanceLoad)."""
    M_TIER_BLOCKS.set(load.tier_blocks)
    M_TIER_CAPACITY.set(load.tier_capacity)
    M_RETAINED.set(load.retained_blocks)
