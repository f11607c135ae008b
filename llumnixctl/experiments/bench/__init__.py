"""Benchmarks and checks on real daemons: ``llumnixctl bench`` (cli.py) and ``llumnixctl check`` (check.py)."""
