"""Experiments: benchmarks, checks, the virtual-time simulator, sim-to-real, traces (generated and from
files), latency profiles and the paper's figures."""
