"""The simulated instance that stands in for the paper's (Llumnix, OSDI'24: LLaMA-7B on A10 GPUs of 24 GB), for the
figures (llumnixctl/experiments/figs/) and ``llumnixctl simulate --paper-like``.

``PAPER_LIKE`` is a sim instance of that shape: 512 KiB of KV per token (32 layers, 32 KV heads of 128, fp16), about
18k tokens of KV cache (1,150 blocks of 16) and step times of that order (prefill 0.2 ms per token + 10 ms, decode
20 ms + 0.3 ms per request + 1 us per context token). These are estimates, not measurements of an A10; pass your own
profile with ``sim.profile`` (``llumnixctl profile`` on the GPU node) to replace them.
"""

PAPER_LIKE = [
    "sim.block_size=16", "sim.num_blocks=1150", "sim.max_num_seqs=256", "sim.max_num_batched_tokens=4096",
    "sim.kv_layers=32", "sim.kv_heads=32", "sim.head_dim=128", "sim.kv_dtype=float16",
    "sim.prefill_ms_per_token=0.2", "sim.prefill_ms=10", "sim.decode_ms=20", "sim.decode_ms_per_seq=0.3",
    "sim.decode_ms_per_token=0.001", "model.max_model_len=16384",
    "instance.log_level=warning", "manager.log_level=warning",
    "proxy.dispatch=manager",  # the paper's Llumnix dispatches at its global scheduler (Fig 16 times it there)
]
PAPER_NET = {"kv_gbps": 16.0}  # what one migration's copy gets between the paper's nodes (an estimate)
