"""Test support: in-process daemon cores on virtual time (virtual.py, manager.py)."""
