"""KV bytes between instances: the KV's description and the transport that moves it.

- The description, shared by the engines (which build it) and the transports (which read it): spec.py (what
  decides a block's bytes, compared in the handshake; no torch) and layout.py (``KvBlocks``, ``KvShards``:
  block-granular copies between an engine's KV tensors and staging buffers).
- The transport (the ``KvTransport`` protocol of daemons/migration/transport.py): transfer.py (Gloo pair
  groups, formed on demand, rendezvous over the authenticated ZeroMQ channel), ranks.py (a tensor-parallel
  instance: every rank moves its own shard; ``gloo_transport``, the instance's factory) and rankctl.py (the
  llumlet's control line to each rank).
- tpworker.py: the class vLLM mixes into each TP worker, the one place where a rank's engine verbs
  (daemons/engine/vllm_worker.py) and its transport meet.

May import: daemons/migration/transport.py (the protocol and its errors) and daemons/ipcdirs.py. The transport
imports no engine module, and no engine imports the transport (tests/unit/test_structure.py).
"""
