"""KV blocks as bytes: block-granular copies between an engine's KV tensors and flat staging buffers.

What the engines (daemons/engine/) and the KV transports (daemons/migration/transport.py) share: an engine
describes its KV here (``KvBlocks``, or ``KvShards`` for a KV spread over tensor-parallel ranks), a transport
moves the blocks it describes. Neither imports the other.

An engine hands over one tensor per layer whose first dimension is the block index (vLLM's manager views
``[B, H, N, C]``, the sim's ``[B, 2, N, heads, head_dim]``); what lies inside a block (K and V, heads,
tokens, the attention kernel's own order) is opaque bytes here, which only has to match between the two
ends of a migration. ``KvLayout`` names everything that decides those bytes and the handshake compares it
field by field, so a refusal says what differs.

How the tensors sit in memory varies. vLLM 0.32 allocates one backing buffer and views it per layer with
the stride order of a ``KVCacheLayout``: layer-outermost layouts (``LBHNC``, ``LBNHC``) give each layer a
contiguous region; ``LHBNC`` spreads a block over the heads; block-outermost ones (``BLHNC``, ``BLNHC``,
``BHLNC``) interleave the layers block by block. ``KvBlocks`` picks the cheapest copy for what it finds:

- ``fused``: all layers' pages of a block are one contiguous run (block-outermost, block-compact): one
  ``index_select`` over ``[num_blocks, layers * page]`` moves all layers of n blocks at once;
- ``rows``: each layer's block is one contiguous run (its order inside does not matter): one
  ``index_select`` per layer over ``[num_blocks, page]``;
- ``strided``: anything else: an ``index_select`` per layer over its strided view (it gathers correctly
  from any strides, at the cost of a strided read).

A chunk's bytes are layer-major (rows, strided) or block-major (fused); both ends use the same path because
they have the same layout. Layers that share one tensor (cross-layer KV sharing) are copied once.

A request's last block is usually partly written: ``gather_tail``/``scatter_tail`` copy only its first t
token slots of every layer (the token dimension is dim 2 of a block view, ``[B, H, N, C]`` or
``[B, 2, N, heads, dim]``), layer-major; the slots past t on the destination keep what they held. Only
where the engine says dim 2 is its token slots (``token_slots``: the sim); a migration from vLLM, whose
attention kernels read a block's bytes in their own order, sends the partial block whole.

KV on a GPU (``Staging``): blocks are gathered on the device into a device buffer, copied to a pinned host
buffer on a CUDA stream of the transfer's own (the model's stream keeps running), and sent from there; the
receiver does the reverse. On CPU the gather writes the host buffer directly, as before.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from daemons.kv.spec import KvLayout, KvShards  # noqa: F401  (the spec is torch-free: the manager reads it)


MAX_RUNS = 8  # a chunk in at most this many runs of consecutive blocks is copied run by run


def _unique(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Drop tensors that view the same bytes as an earlier one (layers sharing a KV cache)."""
    seen, out = set(), []
    for c in caches:
        key = (c.untyped_storage().data_ptr(), c.storage_offset(), tuple(c.shape), tuple(c.stride()), c.dtype)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


class KvBlocks:
    """Block copies between per-layer KV tensors (block index first) and one flat uint8 buffer."""

    def __init__(self, caches: list[torch.Tensor], describe: str, layout: str = "", tp: int = 1,
                 token_slots: bool = False, batched: bool | None = None):
        """``token_slots``: dim 2 of a block view indexes the token slots the engine writes, so a partial
        block's first t tokens are ``[:, :t]`` (the sim). vLLM's attention kernels may keep a block's bytes
        in their own order: off, and the last stage sends its partial block whole. ``batched``: copy every
        layer's blocks of a chunk in one ``index_select`` / ``index_copy_`` over a view that spans the layers,
        where the layers are evenly spaced in one storage (None: on a GPU, where each copy is a kernel
        launch and a chunk of 4 blocks of 32 layers at 4 runs took 128 of them)."""
        self.token_slots = token_slots
        caches = _unique(list(caches))
        if not caches:
            raise ValueError("no KV tensors")
        first = caches[0]
        self.dtype = first.dtype
        self.device = first.device
        self.num_blocks = first.shape[0]
        inner = tuple(first.shape[1:])
        if any(c.dtype != self.dtype or tuple(c.shape) != (self.num_blocks, *inner) or c.device != self.device
               for c in caches):
            raise ValueError("KV layers differ in dtype, shape or device")
        self.caches = caches
        self.inner = inner
        self.block_elems = 1
        for d in inner:
            self.block_elems *= d
        self.layer_block_nbytes = self.block_elems * self.dtype.itemsize
        self.block_nbytes = self.layer_block_nbytes * len(caches)  # one block of every layer
        # Bytes are bytes: copy through an integer type of the element's size (exact for any float, and
        # index_select/index_copy_ exist for it on every device; not for float8 on CPU, for one).
        self._word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[self.dtype.itemsize]
        words = [c.view(self._word) for c in caches]
        self.path, self._fused, self.rows = self._choose(words)
        self.block_tokens = inner[1] if len(inner) > 1 else 1  # N: token slots per block
        self._words = words
        self._layer_step = self._even_layers(words)
        if batched is None:
            batched = self.device.type != "cpu"
        self._stacked = self._stack(self._sources()) if batched and self.path != "fused" else None
        self.layout = KvLayout(engine=describe, layout=layout or "block-major", layers=len(caches),
                               block="x".join(str(d) for d in inner), dtype=str(self.dtype).removeprefix("torch."),
                               tp=tp)
        self.spec = self.layout.spec

    @staticmethod
    def _block_is_one_run(c: torch.Tensor) -> bool:
        """True when each block's elements of ``c`` fill one contiguous run (in whatever order inside)."""
        expect = 1
        for stride, size in sorted((c.stride(d), c.shape[d]) for d in range(1, c.dim()) if c.shape[d] != 1):
            if stride != expect:
                return False
            expect *= size
        return True

    def _choose(self, caches: list[torch.Tensor]):
        page, n = self.block_elems, len(caches)
        if not all(self._block_is_one_run(c) for c in caches):
            return "strided", None, caches
        stride0 = caches[0].stride(0)
        storage = caches[0].untyped_storage().data_ptr()
        base = caches[0].storage_offset()
        if (n > 1 and stride0 == page * n
                and all(c.untyped_storage().data_ptr() == storage and c.stride(0) == stride0 for c in caches)
                and all(c.storage_offset() == base + i * page for i, c in enumerate(caches))):
            return "fused", torch.as_strided(caches[0], (self.num_blocks, page * n), (stride0, 1), base), []
        return "rows", None, [torch.as_strided(c, (self.num_blocks, page), (c.stride(0), 1), c.storage_offset())
                              for c in caches]

    def _stack(self, views: list[torch.Tensor]) -> torch.Tensor | None:
        """One view ``[layers, num_blocks, ...]`` over the per-layer ``views`` when the layers are evenly
        spaced in one storage (``_layer_step``), else None."""
        if self._layer_step is None or len(views) < 2:
            return None
        first = views[0]
        return torch.as_strided(first, (len(views), *first.shape), (self._layer_step, *first.stride()),
                                first.storage_offset())

    @staticmethod
    def _even_layers(caches: list[torch.Tensor]) -> int | None:
        """The element distance between consecutive layers when they are views of one storage at one
        stride, evenly spaced (then one strided view covers every layer); else None."""
        first = caches[0]
        step = caches[1].storage_offset() - first.storage_offset() if len(caches) > 1 else 0
        storage = first.untyped_storage().data_ptr()
        if all(c.untyped_storage().data_ptr() == storage and c.stride() == first.stride()
               and c.storage_offset() == first.storage_offset() + i * step for i, c in enumerate(caches)):
            return step
        return None

    def tail_nbytes(self, tokens: int) -> int:
        """Bytes of the first ``tokens`` token slots of one block, every layer."""
        return self.block_nbytes // self.block_tokens * tokens

    def _tail_views(self, block_id: int, tokens: int) -> list[torch.Tensor]:
        """Views of the first ``tokens`` slots of block ``block_id``: one over all layers where the layers
        are evenly spaced in one storage (a single copy), else one per layer."""
        if not 0 < tokens <= self.block_tokens:
            raise ValueError(f"a block holds 1..{self.block_tokens} tokens; asked for {tokens}")
        first = self._words[0]
        shape = (self.inner[0], tokens, *self.inner[2:])
        if self._layer_step is not None:
            return [torch.as_strided(first, (len(self._words), *shape), (self._layer_step, *first.stride()[1:]),
                                     first.storage_offset() + block_id * first.stride(0))]
        return [c[block_id, :, :tokens] for c in self._words]

    def _tail_buffer(self, buf: torch.Tensor, tokens: int, views: list[torch.Tensor]) -> list[torch.Tensor]:
        nbytes = self.tail_nbytes(tokens)
        if buf.dtype != torch.uint8 or buf.numel() < nbytes:
            raise ValueError(f"staging buffer holds {buf.numel()} bytes; {tokens} token slots need {nbytes}")
        flat = buf[:nbytes].view(self._word)
        each = flat.numel() // len(views)
        return [flat[i * each:(i + 1) * each].view(v.shape) for i, v in enumerate(views)]

    def gather_tail(self, block_id: int, tokens: int, out: torch.Tensor) -> int:
        """Copy the first ``tokens`` token slots of block ``block_id`` (every layer) into ``out``; returns
        the bytes written (``tail_nbytes``)."""
        views = self._tail_views(block_id, tokens)
        for view, slot in zip(views, self._tail_buffer(out, tokens, views)):
            slot.copy_(view)
        return self.tail_nbytes(tokens)

    def scatter_tail(self, block_id: int, tokens: int, buf: torch.Tensor) -> int:
        """Write what ``gather_tail`` produced into the first ``tokens`` slots of block ``block_id``."""
        views = self._tail_views(block_id, tokens)
        for view, slot in zip(views, self._tail_buffer(buf, tokens, views)):
            view.copy_(slot)
        return self.tail_nbytes(tokens)

    def frames(self, buf: torch.Tensor, n: int) -> list[torch.Tensor]:
        """The messages a chunk of ``n`` blocks travels in, as slices of its staged bytes ``buf``: one per
        layer on the rows path (so that either end may use the KV rows themselves, see ``direct``), else one."""
        nbytes = n * self.block_nbytes
        if self.path != "rows":
            return [buf[:nbytes]]
        each = n * self.layer_block_nbytes
        return [buf[i * each:(i + 1) * each] for i in range(len(self.rows))]

    def direct(self, block_ids: list[int]) -> list[torch.Tensor] | None:
        """The KV's own bytes of ``block_ids``, framed as ``frames`` frames them, when the ids are one run of
        consecutive blocks that is contiguous in memory on the CPU (fused and rows paths): a transfer then
        sends from (or receives into) the KV tensor with no gather or scatter. None otherwise."""
        first, n = block_ids[0], len(block_ids)
        if self.device.type != "cpu" or self.path == "strided" or block_ids != list(range(first, first + n)):
            return None
        views = [src[first:first + n] for src in self._sources()]
        if not all(v.is_contiguous() for v in views):
            return None
        return [v.reshape(-1).view(torch.uint8) for v in views]

    def _view(self, buf: torch.Tensor, n: int) -> torch.Tensor:
        nbytes = n * self.block_nbytes
        if buf.dtype != torch.uint8 or buf.numel() < nbytes:
            raise ValueError(f"staging buffer holds {buf.numel()} bytes; {n} blocks need {nbytes}")
        flat = buf[:nbytes].view(self._word)
        if self.path == "fused":
            return flat.view(n, len(self.caches) * self.block_elems)
        if self.path == "rows":
            return flat.view(len(self.caches), n, self.block_elems)
        return flat.view(len(self.caches), n, *self.inner)

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)

    @staticmethod
    def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
        """(position in the chunk, first block, count) for each run of consecutive block ids."""
        runs: list[tuple[int, int, int]] = []
        for pos, b in enumerate(block_ids):
            if runs and runs[-1][1] + runs[-1][2] == b:
                pos0, first, n = runs[-1]
                runs[-1] = (pos0, first, n + 1)
            else:
                runs.append((pos, b, 1))
        return runs

    def _sources(self):
        return [self._fused] if self.path == "fused" else self.rows

    def _slots(self, view: torch.Tensor):
        return [view] if self.path == "fused" else list(view)

    def gather(self, block_ids: list[int], out: torch.Tensor) -> int:
        """Copy the blocks ``block_ids`` of every layer into ``out`` (uint8, on the KV's device, at least
        n * block_nbytes); returns the bytes written (n * block_nbytes). Runs of consecutive ids are sliced (a
        plain copy); many short runs go through ``index_select``."""
        return self._copy(block_ids, out, into_kv=False)

    def scatter(self, block_ids: list[int], buf: torch.Tensor) -> int:
        """Write what ``gather`` produced into the blocks ``block_ids`` (the same count, any ids); returns the
        bytes read from ``buf``."""
        return self._copy(block_ids, buf, into_kv=True)

    def _copy(self, block_ids: list[int], buf: torch.Tensor, into_kv: bool) -> int:
        """``gather`` (the KV's blocks to ``buf``) or ``scatter`` (``buf`` to them): one tensor op over the
        stacked KV; else per layer, a slice copy per run of consecutive ids, or one indexed copy past MAX_RUNS."""
        view = self._view(buf, len(block_ids))
        if self._stacked is not None:
            idx = self._index(block_ids)
            if into_kv:
                self._stacked.index_copy_(1, idx, view)
            else:
                torch.index_select(self._stacked, 1, idx, out=view)
            return len(block_ids) * self.block_nbytes
        runs = self._runs(block_ids)
        pairs = list(zip(self._sources(), self._slots(view)))
        if len(runs) <= MAX_RUNS:
            for kv, slot in pairs:
                for pos, first, n in runs:
                    kv_run, buf_run = kv[first:first + n], slot[pos:pos + n]
                    if into_kv:
                        kv_run.copy_(buf_run)
                    else:
                        buf_run.copy_(kv_run)
            return len(block_ids) * self.block_nbytes
        idx = self._index(block_ids)
        for kv, slot in pairs:
            if into_kv:
                kv.index_copy_(0, idx, slot)
            else:
                torch.index_select(kv, 0, idx, out=slot)
        return len(block_ids) * self.block_nbytes

class Staging:
    """A transfer's two staging slots for one KV: host buffers that Gloo sends from and receives into,
    and for KV on a GPU (or with ``two_hop``) device buffers and a copy stream between the two.

    ``load(i, ids)`` leaves blocks ``ids`` in ``host(i)``; ``store(i, ids)`` writes ``host(i)`` into blocks
    ``ids``. Both return when the bytes are where they should be (the stream is synchronized), so the
    caller may post the send, or tell the peer the blocks are in, right after.
    """

    def __init__(self, kv: KvBlocks, nbytes: int, two_hop: bool | None = None):
        self.kv = kv
        self.nbytes = nbytes
        self.two_hop = kv.device.type != "cpu" if two_hop is None else two_hop
        pin = kv.device.type == "cuda"
        # A thread starts on GPU 0 whatever its process's rank set for its own thread: pinning host memory (or
        # any call that needs a context) from a transfer thread of rank 1 would open a context on GPU 0 and
        # take memory there. Every CUDA call here runs with the KV's device current.
        with self._on_device():
            self._host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
            self._dev = [torch.empty(nbytes, dtype=torch.uint8, device=kv.device) for _ in range(2)] if self.two_hop else []
            self._stream = torch.cuda.Stream(device=kv.device) if kv.device.type == "cuda" else None

    def host(self, i: int) -> torch.Tensor:
        return self._host[i]

    def _on_device(self):
        return torch.cuda.device(self.kv.device) if self.kv.device.type == "cuda" else contextlib.nullcontext()

    def _on_stream(self):
        """The copy stream, with the KV's device current (see ``__init__``)."""
        if self._stream is None:
            return contextlib.nullcontext()
        both = contextlib.ExitStack()
        both.enter_context(torch.cuda.device(self.kv.device))
        both.enter_context(torch.cuda.stream(self._stream))
        return both

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def load(self, i: int, block_ids: list[int]) -> int:
        """The blocks ``block_ids`` into staging slot ``i``'s host buffer; returns their bytes."""
        return self._load(i, lambda into: self.kv.gather(block_ids, into))

    def load_tail(self, i: int, block_id: int, tokens: int) -> int:
        """Like ``load``, for the first ``tokens`` slots of one block (``KvBlocks.gather_tail``)."""
        return self._load(i, lambda into: self.kv.gather_tail(block_id, tokens, into))

    def store_tail(self, i: int, block_id: int, tokens: int) -> int:
        """Like ``store``, for the first ``tokens`` slots of one block (``KvBlocks.scatter_tail``)."""
        return self._store(i, self.kv.tail_nbytes(tokens), lambda src: self.kv.scatter_tail(block_id, tokens, src))

    def store(self, i: int, block_ids: list[int]) -> int:
        """Staging slot ``i``'s host buffer into the blocks ``block_ids``; returns their bytes."""
        return self._store(i, len(block_ids) * self.kv.block_nbytes, lambda src: self.kv.scatter(block_ids, src))

    def _load(self, i: int, gather: Callable[[torch.Tensor], int]) -> int:
        """``gather(into)`` (which returns the bytes it wrote) into slot ``i``'s host buffer: directly, or (two
        hops) into its device buffer, then copied to the host."""
        if not self.two_hop:
            return gather(self._host[i])
        with self._on_stream():
            n = gather(self._dev[i])
            self._host[i][:n].copy_(self._dev[i][:n], non_blocking=True)
        self._sync()
        return n

    def _store(self, i: int, n: int, scatter: Callable[[torch.Tensor], object]) -> int:
        """``scatter(src)`` of the first ``n`` bytes of slot ``i``'s host buffer: directly, or (two hops) copied
        to its device buffer first."""
        if not self.two_hop:
            scatter(self._host[i])
            return n
        with self._on_stream():
            self._dev[i][:n].copy_(self._host[i][:n], non_blocking=True)
            scatter(self._dev[i])
        self._sync()
        return n
