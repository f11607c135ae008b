"""The proxy's metrics, and the constants of its dispatch and admission."""

from __future__ import annotations

from daemons import metrics

M_LOCAL = metrics.counter("proxy", "llumnix_proxy_local_dispatches_total",
                          "Requests dispatched from the proxy's own view (proxy.dispatch = local, or the manager "
                          "slow or down)")
M_ASKED = metrics.counter("proxy", "llumnix_proxy_manager_dispatches_total",
                          "Requests whose instance the manager chose (proxy.dispatch = manager, or no view yet)")
M_PEERS = metrics.gauge("proxy", "llumnix_proxy_peers", "Proxies the manager hears from, this one included (with "
                        "proxy.dispatch = local their tie starts are spread over the instances by rank)")
M_RETRIES = metrics.counter("proxy", "llumnix_proxy_redispatches_total",
                            "Requests sent to another instance after one failed before any token")
M_GIVEN_BACK = metrics.counter("proxy", "llumnix_proxy_given_back_total",
                               "Queued requests a draining instance gave back, dispatched again")
M_BAD_FRAMES = metrics.malformed_frames("proxy")
M_DUPLICATES = metrics.counter("proxy", "llumnix_proxy_duplicate_tokens_total",
                               "Token outputs dropped because their index was already emitted")
M_MIGRATION_GAP = metrics.histogram("proxy", "llumnix_proxy_migration_gap_seconds",
                                    "The client's gap between the last token from a request's source and the first "
                                    "from its destination after a live migration (its downtime as the client sees "
                                    "it), by kind: handover (the first move of a request prefilled remotely) or "
                                    "migration (any other)", ["kind"],
                                    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
M_FAILOVERS = metrics.counter("proxy", "llumnix_proxy_failovers_total",
                              "Streams continued on another instance by re-prefill, by cause", ["cause"],
                              preset=[(c,) for c in ("dead", "silent", "unhealthy", "stalled", "refused", "full", "failed")])
M_FENCED = metrics.counter("proxy", "llumnix_proxy_fenced_total", "Token outputs or ownership claims refused because "
                           "they came from a copy that is not the request's current owner")
M_RESENT = metrics.counter("proxy", "llumnix_proxy_resubmits_total",
                           "Requests sent again, same epoch, because their instance's heartbeats showed it had not "
                           "taken in every Submit sent proxy.stall_timeout_s before (lost on the way, or it restarted)")
M_DISAGG = metrics.disagg_decisions("proxy", "Dispatches from the proxy's own view")
M_CACHE_DISPATCHES = metrics.cache_dispatches("proxy")
M_PREFIX_INDEX = metrics.prefix_index_blocks("proxy", "this proxy's")
M_FORGED = metrics.counter("proxy", "llumnix_proxy_forged_messages_total",
                           "Messages on the token path dropped because their sender's CURVE key is not the key the "
                           "instance they speak for registered with")
M_TIMEOUTS = metrics.counter("proxy", "llumnix_proxy_request_timeouts_total",
                             "Requests ended because they passed proxy.request_timeout_s")
REJECT_REASONS = ("queued_requests", "queued_tokens", "no_instance", "wait_timeout", "ttft", "higher_class", "tpot",
                  "unknown")
M_REJECTED = metrics.counter("proxy", "llumnix_proxy_admission_rejections_total",
                             "Requests refused by admission control, by reason: queued_requests and queued_tokens "
                             "(429: the cluster's queue is past [admission]'s bounds), no_instance (503: no live "
                             "instance), wait_timeout (503: none could take it within admission.queue_timeout_s), "
                             "ttft (429: no instance is predicted to meet its class's TTFT target, [slo]), "
                             "higher_class (429: a higher-priority class is refused now), tpot (429: the instances "
                             "predicted to meet its TTFT target would all pass its TPOT target with it), unknown (429: no "
                             "instance has a step-time model yet and none is idle: a starting cluster)",
                             ["reason"], preset=[(r,) for r in REJECT_REASONS])
M_REFUSAL = metrics.histogram("proxy", "llumnix_proxy_refusal_seconds",
                               "How long a request refused at admission (429) took to be answered, from its "
                               "arrival at the proxy (the client's wait for a no; network and queueing before the "
                               "proxy read it not included)",
                               buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
SLO_CLASSES = ("normal", "high")
SLO_OUTCOMES = ("met", "missed_ttft", "missed_tpot", "missed_both", "refused", "gave_up")
M_SLO = metrics.counter("proxy", "llumnix_proxy_slo_requests_total",
                        "Requests with an SLO ([slo] targets), by priority class and outcome: met (both targets), "
                        "missed_ttft, missed_tpot, missed_both, refused (429 at admission), gave_up (429 after "
                        "waiting past slo.give_up_factor times its TTFT target). Goodput: the rate of met",
                        ["class", "outcome"], preset=[(c, o) for c in SLO_CLASSES for o in SLO_OUTCOMES])
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.11, 1.25, 1.5, 2.0, 4.0)
M_TTFT_RATIO = metrics.histogram("proxy", "llumnix_proxy_ttft_actual_over_predicted",
                                 "A request's time to first token over what was predicted when it was placed (1: exact)",
                                 buckets=_RATIO_BUCKETS)
M_TPOT_RATIO = metrics.histogram("proxy", "llumnix_proxy_tpot_actual_over_predicted",
                                 "A request's mean time per output token over what was predicted when it was placed",
                                 buckets=_RATIO_BUCKETS)
M_GAVE_UP = metrics.counter("proxy", "llumnix_proxy_slo_gave_up_total",
                            "Requests answered 429 because they waited past slo.give_up_factor times their TTFT "
                            "target without a token (displaced by higher-priority work, or the queue grew)")
M_WAITED = metrics.counter("proxy", "llumnix_proxy_dispatch_waits_total",
                           "Requests that found no instance able to take them at once and waited for one")
M_LINKS_DOWN = metrics.counter("proxy", "llumnix_proxy_instance_links_lost_total",
                               "Connections to instances lost (process gone, or no keepalive answered within "
                               "proxy.instance_timeout_s)")
M_LINKS_HEALED = metrics.links_healed("proxy", "proxy.instance_timeout_s", "nothing failed over")


TIE_TURN_S = 60.0
# Admission's defaults (-1), per instance: this many batches of requests and KV caches of prompt tokens may wait.
# Enough that a bursty trace that saturates the cluster for minutes is served whole (bench steady); sustained
# overload fills them and is refused at once.
AUTO_BATCHES = 4
AUTO_KV_CACHES = 8
M_TENANT_REJECTED = metrics.counter("proxy", "llumnix_proxy_tenant_rejections_total",
                                    "Requests refused for their API key's own limits (429), by key name and reason: "
                                    "requests_per_minute, tokens_per_minute, concurrent_requests", ["key", "reason"])
M_TENANT_WAITED = metrics.counter("proxy", "llumnix_proxy_fair_queue_waits_total",
                                  "Requests that waited in the fair queue (the cluster had no room and other keys "
                                  "were active), by key name", ["key"])
M_TENANT_QUEUED = metrics.gauge("proxy", "llumnix_proxy_fair_queue_requests",
                                "Requests waiting in the fair queue now, all keys")
M_TENANT_TOKENS = metrics.counter("proxy", "llumnix_proxy_tenant_tokens_total",
                                  "Tokens served per API key (prompt and generated), as the fair queue counts them",
                                  ["key"])
SESSION_HOW = ("affinity", "spilled", "new", "pull")  # daemons/policy/sessions.py HOW
M_SESSION_DISPATCHES = metrics.counter("proxy", "llumnix_proxy_session_dispatches_total",
                                       "Turns of named sessions (prompt_cache_key or sessions.header) placed, by how: "
                                       "affinity (where the session's KV is), spilled (its holder was past "
                                       "sessions.bound or its TTFT target: another instance), new (no instance held "
                                       "any of it), pull (placed with a prefix pull from the holder)", ["how"],
                                       preset=[(h,) for h in SESSION_HOW])
M_SESSIONS = metrics.gauge("proxy", "llumnix_proxy_sessions", "Sessions this proxy knows (sessions.max_sessions at most)")
