"""Prompts as text whose every word is one token of the model (a prompt of k words is k tokens, plus the BOS an
engine puts before a text): for clients and routers that take text only (smg takes no token ids), with prompts of
a trace's exact lengths and its shared segments as shared text (traces/cache.py ``prompt_ids``)."""

from __future__ import annotations

from pathlib import Path

from llumnixctl.experiments.traces import cache as tracecache

WORDS = ("the of and to in is was for on are with as by at from this that have not they which one you were her "
         "all she there would their we him been has when who will more no if out so said what up its about into "
         "than them can only other new some could time these two may then do first any my now such like our over "
         "man me even most made after also did many before must through back years where much your way well down")


class Words:
    """Prompt text whose every word is one token of the model: a prompt of k words is k tokens (plus BOS)."""

    def __init__(self, model: Path):
        from llumnixctl.experiments.traces.files import tokenizer

        tok = tokenizer(model)
        self.pool = [w for w in dict.fromkeys(WORDS.split()) if len(tok(" " + w)) == 1]
        if len(self.pool) < 16:
            raise RuntimeError(f"the tokenizer of {model} has too few single-token words ({len(self.pool)})")

    def text(self, req, drop: int = 0) -> str:
        """The request's prompt as words; ``drop``: that many fewer at the end (at least one is left), for a
        prompt of exactly the trace's length once the engine has put its special tokens (a BOS) before it."""
        ids = tracecache.prompt_ids(req, len(self.pool))
        return "".join(" " + self.pool[i] for i in ids[:max(1, len(ids) - drop)])
