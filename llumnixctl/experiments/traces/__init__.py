"""Traces: generated (gen.py), from files (files.py), the paper's mixes (mix.py), shared content (cache.py),
their options (options.py) and ``llumnixctl trace`` (cli.py)."""
