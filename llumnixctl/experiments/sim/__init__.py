"""The virtual-time simulator's parts; profile.py measures the latency profiles its sim engine uses."""
