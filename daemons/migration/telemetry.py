"""Migration metrics (exported by the instance)."""

from __future__ import annotations

from daemons import metrics

M_MIGRATIONS = metrics.counter("instance", "llumnix_migrations_total", "Migrations out of this instance, by outcome",
                               ["outcome"], preset=[("committed",), ("aborted",)])
M_DOWNTIME = metrics.histogram("instance", "llumnix_migration_downtime_seconds",
                               "Time a committed migration kept its request suspended",
                               buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
M_DURATION = metrics.histogram("instance", "llumnix_migration_seconds", "Duration of migrations out, start to outcome",
                               buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0))
M_BYTES = metrics.counter("instance", "llumnix_migration_bytes_total", "KV bytes moved, by direction", ["direction"],
                          preset=[("out",), ("in",)])
M_IN_FLIGHT = metrics.gauge("instance", "llumnix_migrations_in_flight", "Migrations in progress, by role", ["role"],
                            preset=[("source",), ("destination",)])
M_RELEASED = metrics.counter("instance", "llumnix_instance_migration_released_total",
                             "Migrations given up without the peer's word, by role and cause: as destination, a "
                             "reservation released because its source was declared dead (peer_dead), its copy "
                             "failed (transfer_failed: a dead source's connection closes) or it fell silent for "
                             "migration.dest_idle_timeout_s (lease_expired); as source, a move aborted (its request "
                             "decoding here again) because its destination was declared dead (peer_dead)",
                             ["role", "cause"], preset=[("destination", "peer_dead"), ("destination", "transfer_failed"),
                                                        ("destination", "lease_expired"), ("source", "peer_dead")])
M_LINKS = metrics.counter("instance", "llumnix_instance_links_made_ahead_total",
                          "Links to a handover destination made ahead of its moves (wire.PeerLink: socket, KV pair, "
                          "layout check), by outcome", ["outcome"], preset=[("ready",), ("refused",), ("failed",)])
M_LINK_SECONDS = metrics.histogram("instance", "llumnix_instance_link_setup_seconds",
                                   "Time to make the links to a handover destination ahead of its moves",
                                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0))
OUTCOMES = ("pulled", "held", "none_held", "unreachable", "holder_dead", "timeout", "failed")
M_PULLS = metrics.counter("instance", "llumnix_kv_pulls_total",
                          "Prefix pulls asked for by requests placed here, by outcome: pulled (blocks came), held (this "
                          "instance already held them), none_held (the holder had none of them any more), "
                          "unreachable, holder_dead, timeout (kv_tier.pull_timeout_s), failed (the transfer or the "
                          "engine failed); whatever the outcome the request goes on, prefilling what it lacks",
                          ["outcome"], preset=[(o,) for o in OUTCOMES])
M_PULL_BYTES = metrics.counter("instance", "llumnix_kv_pulled_bytes_total", "KV bytes pulled in from other instances")
M_PULL_SECONDS = metrics.histogram("instance", "llumnix_kv_pull_seconds",
                                   "Time from a pull's start to its blocks in the host tier, pulls that brought blocks",
                                   buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
M_REHOMED = metrics.counter("instance", "llumnix_sessions_rehomed_total",
                            "Idle sessions whose KV this instance pulled in from a hot instance (ordered there by the "
                            "manager, wire.Rehome): in its host tier and retained here now")
