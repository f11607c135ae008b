"""The stage arithmetic of a live migration (multi-stage pre-copy), as plain numbers.

A source sends a request's KV in stages: each pre-copy stage sends the full blocks written since the last
one while the request keeps decoding; the last stage, once few blocks are left (``last_stage_max_blocks``)
or after ``max_stages``, suspends the request and sends the rest, its partial last block included. Before
the last stage the destination holds a few blocks more than written so far, so the last stage, which the
request spends suspended, needs no new reservation there.

The source (daemons/migration/) and the virtual-time simulator (llumnixctl/experiments/sim/simulate.py) both plan their
stages here. No clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_LIMIT = 1 << 30  # a request without a token limit (max_total 0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StagePlan:
    """One stage: the blocks ``[first_block, upto)`` of the request's block list, the tokens the destination's
    reservation must cover, and (last stage only) how many token slots of the partial last block to send."""

    last: bool
    first_block: int
    upto: int
    tokens: int
    tail_tokens: int = 0

    @property
    def n_blocks(self) -> int:
        return self.upto - self.first_block


def is_last(computed_tokens: int, sent_blocks: int, stage: int, block_size: int, last_stage_max_blocks: int,
            max_stages: int, blocking: bool = False) -> bool:
    """Whether the stage about to start is the last: few blocks left, enough stages run, or no pre-copy."""
    remaining = cdiv(computed_tokens, block_size) - sent_blocks
    return blocking or remaining <= last_stage_max_blocks or stage >= max_stages


def plan(computed_tokens: int, sent_blocks: int, last: bool, block_size: int, last_stage_max_blocks: int,
         max_total: int = 0, token_slots: bool = False) -> StagePlan:
    """The stage that starts with ``sent_blocks`` sent and ``computed_tokens`` written (for the last stage:
    as of the suspension). A pre-copy stage sends full blocks only (they never change again) and reserves
    ``last_stage_max_blocks + 2`` blocks of headroom, within the request's ``max_total``; the last stage sends
    everything, and only the written slots of the partial block where the KV's layout says which
    (``token_slots``)."""
    if last:
        upto, tokens = cdiv(computed_tokens, block_size), computed_tokens
        tail = computed_tokens % block_size if token_slots else 0
    else:
        headroom = (last_stage_max_blocks + 2) * block_size
        upto, tokens, tail = computed_tokens // block_size, min(computed_tokens + headroom, max_total or NO_LIMIT), 0
    return StagePlan(last, sent_blocks, max(upto, sent_blocks), max(tokens, computed_tokens), tail)
