"""Room for a benchmark's request: does a streaming request still have enough tokens left for the moves it is
to make, judged from its measured step time (``bench migration`` checks before each move, so that a request
cannot finish before what it measures, and otherwise stops with the ``--decode-tokens`` that would do)."""

from __future__ import annotations

import statistics


def moves_need(move_ms: float, step_ms: float, moves: int, gap_tokens: int) -> int:
    """Tokens a request must still have for ``moves`` more moves that take ``move_ms`` each (twice that: a
    loaded machine's speed varies) at ``step_ms`` a token, with ``gap_tokens`` of steady decoding after each."""
    return moves * (int(2 * move_ms / max(step_ms, 0.1)) + 1 + gap_tokens)


def step_ms(times: list[float]) -> float:
    """A stream's decode step time so far, in ms: the median gap between its chunks, each divided by the tokens
    the later chunk brought (a proxy that batches tokens into one chunk gives them one arrival time; their
    gaps of 0 made the median 0, and a fast engine's room hint asked for tens of thousands of tokens)."""
    arrivals: list[tuple[float, int]] = []  # (arrival time, tokens that came then)
    for t in times:
        if arrivals and arrivals[-1][0] == t:
            arrivals[-1] = (t, arrivals[-1][1] + 1)
        else:
            arrivals.append((t, 1))
    gaps = [(b - a) * 1e3 / n for (a, _), (b, n) in zip(arrivals, arrivals[1:])]
    return statistics.median(gaps) if gaps else 1.0


def hint(n: int, left: int, move_ms: float, step_ms: float, repeat: int, gap_tokens: int) -> str:
    need = moves_need(move_ms, step_ms, repeat, gap_tokens)
    return (f"the {n}-token request has {left} tokens left; {repeat} moves of {move_ms:.0f} ms at {step_ms:.1f} ms a "
            f"token need about {need}: run with --decode-tokens {-(-need // 256) * 256 + 256} or more, or fewer --repeat")
