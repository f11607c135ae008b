"""What an instance's requests will still claim: the output lengths it observes (``OutputLengths``) and, from them,
the KV its running and waiting requests will hold at their expected final lengths and when the running ones are
expected to finish (``outlook``, carried in the load report as wire.Outlook; the SLO's slot and KV waits read it:
daemons/policy/slo.py).

Nobody knows how long an answer will be. What the instance does know: each request's max_tokens (the most it can
grow), how far it got, and how long the answers that finished here recently were. A request's expected output is
the mean over those recent finishes that got at least as far as it has, each capped at its max_tokens. A finish cut
by its own max_tokens only says "at least that long": it counts as reaching the cap of the request it is compared
with (so a warm-up of short answers cut at 16 tokens does not make a 300-token request look short). With no
finish observed yet, every request is expected to use its whole max_tokens: the conservative answer.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque

from daemons import wire
from daemons.policy.lengths import expected_output, prefix_sums, quantiles_of
from daemons.policy.usage import blocks_for

WINDOW = 512  # recent finishes the distribution is taken over
DRAIN_POINTS = 8


class OutputLengths:
    """Owns the recent finishes' output lengths (a sliding window, kept sorted). Verbs: ``finished``,
    ``expected`` (a request's expected output tokens), ``quantiles`` (for the load report)."""

    def __init__(self, window: int = WINDOW):
        self.window = window
        self._lock = threading.Lock()  # finishes come on the event loop; reports may read on the engine thread
        self._order: deque[int] = deque()  # lengths in arrival order (UNBOUNDED: cut by max_tokens)
        self._sorted: list[int] = []
        self._snapshot: tuple[list[int], list[int]] | None = None  # (sorted copy, prefix sums), built when read
        self.observed = 0

    def finished(self, tokens: int, natural: bool) -> None:
        """A request finished after ``tokens`` output tokens: on its own (``natural``: EOS or a stop) or cut by
        its max_tokens or the context limit."""
        length = max(int(tokens), 1) if natural else wire.UNBOUNDED
        with self._lock:
            self._order.append(length)
            bisect.insort(self._sorted, length)
            if len(self._order) > self.window:
                old = self._order.popleft()
                del self._sorted[bisect.bisect_left(self._sorted, old)]
            self._snapshot = None
            self.observed += 1

    def snapshot(self) -> tuple[list[int], list[int]]:
        """The sorted sample and its prefix sums, as of now (a copy: the reader may be another thread)."""
        with self._lock:
            if self._snapshot is None:
                self._snapshot = (list(self._sorted), prefix_sums(self._sorted))
            return self._snapshot

    def expected(self, generated: int, max_tokens: int) -> int:
        """Expected output tokens in all of a request that has ``generated`` so far and may reach ``max_tokens``."""
        lengths, prefix = self.snapshot()
        return expected_output(lengths, generated, max_tokens, prefix)

    def quantiles(self) -> list[int]:
        return quantiles_of(self.snapshot()[0])


def outlook(rows: list[wire.RequestLoad], lengths: OutputLengths, block_size: int,
            hands_over: bool = False) -> wire.Outlook:
    """From the engine's request rows: the KV the running and waiting requests will hold at their expected final
    lengths, and the running ones' expected finishes (``wire.Outlook``). ``hands_over``: a prefill instance, whose
    requests leave at their first token (handed over to a decode instance), not at their last."""
    sample, prefix = lengths.snapshot()
    committed = waiting = waiting_output = 0
    finishing: list[tuple[int, int]] = []  # (remaining tokens, final blocks) of each running request
    for r in rows:
        m = r.max_tokens or r.output_tokens + 1
        final = r.output_tokens + 1 if hands_over else expected_output(sample, r.output_tokens, m, prefix)
        blocks = blocks_for(r.prompt_tokens + final, block_size)
        committed += blocks
        if r.state == "running":
            finishing.append((max(final - r.output_tokens, 0), blocks))
        else:
            waiting += 1
            waiting_output += max(final - r.output_tokens, 1)
    finishing.sort()
    drain = []
    n = len(finishing)
    if n:
        ranks = sorted({max(1, round((i + 1) * n / DRAIN_POINTS)) for i in range(DRAIN_POINTS)})
        done = freed = 0
        for rank in ranks:
            while done < rank:
                freed += finishing[done][1]
                done += 1
            drain.append((finishing[rank - 1][0], done, freed))
    return wire.Outlook(committed, drain, quantiles_of(sample), round(waiting_output / waiting) if waiting else 0)
