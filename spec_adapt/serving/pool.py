"""ModelPool: the models a chain can use, registered by name, loaded lazily, with their devices and memory.

    pool = ModelPool()
    pool.register("small", "path/to/small")                       # loaded on first use
    pool.register("mid", "path/to/mid", device_map="auto")         # accelerate spreads it over the GPUs
    pool.register("lookup", PromptLookupDrafter())                 # objects are used as they are
    chain = pool.chain(["lookup", "small", "mid"])                 # a ChainDrafter, cheapest first
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Entry:
    source: object                  # a path / hub id, a loaded model, a Drafter, or a zero-argument loader
    device_map: object = None
    dtype: torch.dtype = torch.float32
    loaded: object = None
    kwargs: dict = field(default_factory=dict)


class ModelPool:
    def __init__(self):
        self._entries: dict[str, _Entry] = {}

    def register(self, name: str, source, device_map=None, dtype: torch.dtype = torch.float32, **kwargs) -> None:
        if name in self._entries:
            raise ValueError(f"ModelPool already has a model named {name!r}.")
        self._entries[name] = _Entry(source, device_map, dtype, kwargs=kwargs)

    def get(self, name: str):
        if name not in self._entries:
            raise KeyError(f"ModelPool has no model named {name!r}; registered: {sorted(self._entries)}")
        entry = self._entries[name]
        if entry.loaded is None:
            entry.loaded = self._load(entry)
        return entry.loaded

    def _load(self, entry: _Entry):
        source = entry.source
        if isinstance(source, str):
            if entry.device_map is None:
                from ..loading import load_model

                return load_model(source, dtype=entry.dtype)[0]
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(source, dtype=entry.dtype, device_map=entry.device_map,
                                                        **entry.kwargs).eval()
        if callable(source) and not isinstance(source, torch.nn.Module):
            return source()
        return source

    def loaded(self) -> list[str]:
        return [name for name, e in self._entries.items() if e.loaded is not None]

    def memory(self) -> dict[str, dict]:
        """Per loaded model: bytes of parameters and buffers, and the devices they are on."""
        report = {}
        for name in self.loaded():
            model = self._entries[name].loaded
            if not isinstance(model, torch.nn.Module):
                report[name] = {"bytes": 0, "devices": []}
                continue
            tensors = list(model.parameters()) + list(model.buffers())
            report[name] = {"bytes": sum(t.numel() * t.element_size() for t in tensors),
                            "devices": sorted({str(t.device) for t in tensors})}
        return report

    def chain(self, names: list[str]):
        """A ChainDrafter over these members, cheapest first (the target is the model generate runs on)."""
        from ..drafters.chain import ChainDrafter

        return ChainDrafter([self.get(n) for n in names])
