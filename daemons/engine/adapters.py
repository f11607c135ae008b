"""The LoRA adapters an engine holds: its slots, which adapter each holds, how recently each was used, which
requests run with each, and the choice of the adapter a new one replaces (the least recently used that no
request runs with). When every slot holds an adapter in use, a new one loads beyond the slots (its request waits
in the engine's queue: vLLM runs at most max_loras adapters in a batch), and the least recently used one goes as
soon as it is idle. Both engines keep one (``AdapterTable``); loading the weights is the engine's own part
(vllm_lora.py for vLLM; the sim engine only waits its load time)."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from daemons.engine.base import EngineError


@dataclass
class Adapter:
    name: str
    path: str
    lora_id: int  # the engine's id for it (vLLM's lora_int_id: unique per load)
    used: int = 0  # when it was last used (the table's counter: larger is more recent)
    running: set[str] | None = None  # requests that run with it now
    unloading: bool = False  # unload asked: it goes when the last request running with it ends


class AdapterTable:
    """Owns the held adapters. The engine asks ``plan`` before it loads (which adapter, if any, to unload
    first), tells ``loaded`` and ``unloaded`` after, and ``started`` and ``ended`` for each request that runs
    with one."""

    def __init__(self, slots: int):
        self.slots = slots
        self._held: dict[str, Adapter] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.loads = 0  # monotonic
        self.evictions = 0  # monotonic: adapters unloaded to make room

    def get(self, name: str) -> Adapter | None:
        return self._held.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._held

    def held(self) -> list[str]:
        """Held adapters, most recently used first."""
        return [a.name for a in sorted(self._held.values(), key=lambda a: -a.used)]

    def rows(self) -> list[Adapter]:
        return sorted(self._held.values(), key=lambda a: -a.used)

    def free_slots(self) -> int:
        return max(0, self.slots - len(self._held))

    def open_slots(self) -> int:
        """Slots a new adapter could take now: free, or holding an adapter no request runs with (the load reports'
        ``adapter_slots``: dispatch sends a request for an adapter not held only where it can load)."""
        return self.free_slots() + sum(1 for a in self._held.values() if not a.running)

    def plan(self, name: str) -> Adapter | None:
        """Before loading ``name``: the held adapter to unload first (None: a slot is free, ``name`` is held, or
        every slot's adapter is in use: it loads beyond the slots, see ``ended``)."""
        if not self.slots:
            raise EngineError(f"adapter {name!r}: this instance serves no LoRA adapters (lora.slots = 0)")
        if name in self._held or len(self._held) < self.slots:
            return None
        return self._idlest()

    def _idlest(self) -> Adapter | None:
        idle = [a for a in self._held.values() if not a.running]
        return min(idle, key=lambda a: a.used) if idle else None

    def new_id(self) -> int:
        return next(self._ids)

    def loaded(self, name: str, path: str, lora_id: int) -> Adapter:
        a = self._held[name] = Adapter(name, path, lora_id, next(self._clock), set())
        self.loads += 1
        return a

    def unloaded(self, name: str, evicted: bool = False) -> None:
        self._held.pop(name, None)
        self.evictions += evicted

    def unload_when_idle(self, name: str) -> bool:
        """Unload asked: True when it may go now; else it goes when its last request ends (``ended``)."""
        a = self._held[name]
        a.unloading = True
        return not a.running

    def renew(self, name: str, path: str) -> bool:
        """A load of ``name`` from ``path`` that finds it held: True (and it stays, in use) when it is held from
        that path; False when it is not held; EngineError when it is held from another path."""
        held = self.get(name)
        if held is None:
            return False
        if held.path != path:
            raise EngineError(f"adapter {name!r} is loaded here from {held.path!r}; unload it before loading "
                              f"another {path!r} under that name")
        held.unloading = False
        self.use(name)
        return True

    def use(self, name: str) -> Adapter:
        a = self._held[name]
        a.used = next(self._clock)
        return a

    def started(self, name: str, request_id: str) -> Adapter:
        a = self.use(name)
        a.running.add(request_id)
        return a

    def ended(self, name: str, request_id: str) -> list[Adapter]:
        """A request that ran with ``name`` left; the adapters to unload now: ``name`` if an unload was asked while
        it ran (``unloading``), and while more are held than the slots, the least recently used idle ones (evicted)."""
        a = self._held.get(name)
        if a is None:
            return []
        a.running.discard(request_id)
        gone = [a] if a.unloading and not a.running else []
        return gone + self._excess(gone)

    def settle(self, live) -> list[Adapter]:
        """``ended`` for every request that ``live(request_id)`` says has left (an engine without a hook per exit)."""
        gone = []
        for a in self._held.values():
            left = [r for r in a.running if not live(r)]
            a.running.difference_update(left)
            if left and a.unloading and not a.running:
                gone.append(a)
        return gone + self._excess(gone)

    def _excess(self, going: list[Adapter]) -> list[Adapter]:
        """While more are held than the slots: the least recently used idle ones."""
        over = len(self._held) - len(going) - self.slots
        idle = sorted((b for b in self._held.values() if not b.running and b not in going), key=lambda b: b.used)
        return idle[:max(0, over)]

    def unloading(self, name: str) -> bool:
        a = self._held.get(name)
        return a is not None and a.unloading


def module_dims(hf_config) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of the projections a LoRA adapter of a LLaMA-like model targets, from the model's
    config (hidden size, heads, head size, MLP size); {} for a config that does not say."""
    hidden = getattr(hf_config, "hidden_size", None)
    heads = getattr(hf_config, "num_attention_heads", None)
    if not hidden or not heads:
        return {}
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    q = heads * head_dim
    dims = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    mlp = getattr(hf_config, "intermediate_size", None)
    if mlp:
        dims.update(gate_proj=(hidden, mlp), up_proj=(hidden, mlp), down_proj=(mlp, hidden))
    return dims


def check_shapes(name: str, path: str, dims: dict[str, tuple[int, int]], base: str = "") -> None:
    """Each of the adapter's low-rank pairs fits the projection it targets here (A: inputs, B: outputs): vLLM copies
    a smaller adapter into its slots without a word, and its answers are then garbage. EngineError names the
    adapter, the projection and the model it was made for (adapter_config.json's base_model_name_or_path)."""
    from safetensors import safe_open

    weights = Path(path) / "adapter_model.safetensors"
    if not dims or not weights.exists():
        return  # a .bin adapter: vLLM's own checks only
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            module, sep, rest = key.partition(".lora_")
            kind = module.rsplit(".", 1)[-1]
            if not sep or kind not in dims:
                continue
            shape = f.get_slice(key).get_shape()
            got, want, what = ((shape[-1], dims[kind][0], "inputs") if rest.startswith("A") else
                               (shape[0], dims[kind][1], "outputs"))
            if got != want:
                made_for = f" (it was made for {base})" if base else ""
                raise EngineError(f"adapter {name!r} does not fit this model{made_for}: its {kind} has {got} {what}, "
                                  f"this model's {want}")


def check_adapter_dir(name: str, path: str, max_rank: int) -> dict:
    """What can be checked of an adapter before an engine reads its weights: the directory and its
    adapter_config.json exist, and its rank is within ``max_rank``. Returns the config; EngineError names the
    adapter and what is wrong."""
    p = Path(path)
    if not p.is_dir():
        raise EngineError(f"adapter {name!r}: {path!r} is not a directory (a PEFT adapter directory with "
                          f"adapter_config.json and adapter_model.safetensors)")
    try:
        config = json.loads((p / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise EngineError(f"adapter {name!r}: {path!r} holds no adapter_config.json (not a PEFT adapter)") from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"adapter {name!r}: cannot read {p / 'adapter_config.json'}: {exc}") from None
    ranks = [config.get("r") or 0, *(config.get("rank_pattern") or {}).values()]
    rank = max(int(r) for r in ranks if isinstance(r, (int, float)))
    if rank > max_rank:
        raise EngineError(f"adapter {name!r}: its rank is {rank}, over this instance's limit lora.max_rank = {max_rank}")
    return config
