"""The access log: one info line per completion or chat request on logger ``llumnix.access`` (daemons/proxy/app.py
describes its fields), written when the request is answered (a stream: when it ends) or refused."""

from __future__ import annotations

import logging
import time

from daemons.proxy.api.render import Job

access_log = logging.getLogger("llumnix.access")


class AccessLog:
    """``enabled``: proxy.access_log. Request durations are measured on ``now``, the clock the proxy reads a
    request's arrival on (its Clock.monotonic)."""

    def __init__(self, enabled: bool, now=time.monotonic):
        self.enabled = enabled
        self.now = now

    def write(self, job: Job | None, chat: bool, arrival: float, status: int, key_name: str = "-") -> None:
        """The request's line (once: a job already logged is not logged again) and its trace's end.
        ``arrival``: ``now()`` on its arrival."""
        if job is not None:
            if job.logged:
                return
            job.logged = True
            if job.trace is not None:
                job.trace.end(status, {"llumnix.model": job.model or None, "llumnix.prompt_tokens": job.prompt_tokens,
                                       "llumnix.completion_tokens": job.completion_tokens,
                                       "llumnix.instances": ",".join(dict.fromkeys(
                                           i for s in job.streams() for i in s.tried)) or None})
        if not self.enabled or not access_log.isEnabledFor(logging.INFO):
            return
        now = self.now()
        streams = job.streams() if job is not None else []
        reasons = [c.reason for c in job.choices if c.reason] if job is not None else []
        rec = {
            "request_id": job.id if job is not None else "-",
            "route": "/v1/chat/completions" if chat else "/v1/completions",
            "model": (job.model if job is not None else "") or "-",
            "instance": ",".join(dict.fromkeys(s.instance_id for s in streams if s.instance_id)) or "-",
            "status": status,
            "n": len(job.choices) if job is not None and job.choices else 1,
            "prompt_tokens": job.prompt_tokens if job is not None else 0,
            "completion_tokens": job.completion_tokens if job is not None else 0,
            "ttft_ms": round((job.first_at - arrival) * 1000, 1) if job is not None and job.first_at else None,
            "total_ms": round((now - arrival) * 1000, 1),
            "finish_reason": ",".join(dict.fromkeys(reasons)) or None,
            "key_name": job.key_name if job is not None else key_name,
        }
        access_log.info("access %s %s model=%s instance=%s status=%d prompt_tokens=%d completion_tokens=%d ttft_ms=%s "
                        "total_ms=%.1f finish_reason=%s key_name=%s", rec["request_id"], rec["route"], rec["model"],
                        rec["instance"], status, rec["prompt_tokens"], rec["completion_tokens"],
                        "-" if rec["ttft_ms"] is None else rec["ttft_ms"], rec["total_ms"], rec["finish_reason"] or "-",
                        rec["key_name"], extra=rec)
