"""What decides a KV block's bytes, as the text every instance sends when it registers and before a migration
(``KvLayout.spec``), and what the migration protocol reads of a KV it cannot touch (``KvShards``). No torch
here: the manager compares specs (tensor-parallel sizes at join and at a role change) without loading it;
daemons/kv/layout.py, which copies the blocks, re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KvLayout:
    """What decides a KV block's bytes. Two engines exchange blocks only when every field agrees."""

    engine: str  # backend and version, device kind and kernel choice (e.g. vllm-0.32-cpu-noamx, sim)
    layout: str  # vLLM's KVCacheLayout name, or "block-major" for tensors that start with the block index
    layers: int  # KV tensors (after de-duplicating shared ones)
    block: str  # shape of one layer's block, e.g. 2x32x128 ([H, N, C])
    dtype: str
    tp: int = 1  # tensor-parallel ranks: each holds its own shard of every block

    # In the order a refusal names them: the first that differs is the cause (a TP size changes the shape).
    _NAMES = {"engine": "engine", "tp": "tensor-parallel size", "layout": "KV cache layout", "layers": "KV layers",
              "dtype": "KV dtype", "block": "block shape"}

    @property
    def spec(self) -> str:
        return ";".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @staticmethod
    def parse(spec: str) -> dict[str, str]:
        out = {}
        for part in spec.split(";"):
            key, sep, value = part.partition("=")
            if sep:
                out[key] = value
        return out

    @classmethod
    def difference(cls, source: str, destination: str) -> str:
        """One line naming what differs between two specs ('' when they agree)."""
        if source == destination:
            return ""
        a, b = cls.parse(source), cls.parse(destination)
        for key, name in cls._NAMES.items():
            if a.get(key) != b.get(key):
                return f"{name} differs: source {a.get(key, '?')}, destination {b.get(key, '?')}"
        return f"source {source!r}, destination {destination!r}"


@dataclass(frozen=True)
class KvShards:
    """What the migration protocol reads of a KV it cannot touch (a tensor-parallel engine's, held by its
    worker processes): the layout and a block's bytes (all ranks)."""

    spec: str
    block_nbytes: int
    ranks: int

    @property
    def layout(self) -> KvLayout:
        fields = KvLayout.parse(self.spec)
        return KvLayout(fields["engine"], fields["layout"], int(fields["layers"]), fields["block"], fields["dtype"],
                        int(fields["tp"]))

    @classmethod
    def of(cls, per_rank: list[tuple[str, int]]) -> KvShards:
        specs = {spec for spec, _ in per_rank}
        if len(specs) != 1:
            raise RuntimeError(f"the tensor-parallel ranks disagree on their KV layout: {sorted(specs)}")
        return cls(per_rank[0][0], sum(n for _, n in per_rank), len(per_rank))
