"""A memory budget for the serving engine: what bounds the batch when memory, not `max_batch`, is short.

`MemoryBudget(total_bytes, target, draft)` accounts for the target's weights, the draft's weights while resident,
and each running request's KV reserved for its whole length (prompt + max_new_tokens, in the target and, while the
draft is resident, in the draft), as a paged KV allocator reserves blocks. The engine admits a waiting request only
if it fits (`admissible`). `free()` is the budget's answer to "how much memory is free": negative while the head of
the queue waits for memory, so a `DraftOffload` given `free_memory=budget.free` offloads under exactly that
pressure (once the policy has kept speculation off for its `persist` steps) and reloads once the queue fits with the
draft back in (its weights and its KV for the running rows).

On a GPU this is the KV-cache share of device memory; on a CPU, a cap the operator sets (the process's RSS is what
the draft's offload frees, measured by benchmarks/offload.py).
"""

from __future__ import annotations

import math
import numbers

from ..drafters.model import ModelDrafter
from ..drafters.offload import DraftOffload


def weight_bytes(model) -> int:
    """Bytes of a model's parameters and buffers (tied tensors once): transformers' own footprint count."""
    return int(model.get_memory_footprint())


def kv_bytes_per_token(model) -> int:
    """Bytes one token of KV takes in `model`'s cache: keys and values, every layer, in the model's dtype."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(p for p in model.parameters() if p.is_floating_point()).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * element


class MemoryBudget:
    """See the module docstring. `Engine(model, drafter, memory=MemoryBudget(total_bytes))` binds it: the budget
    counts the engine's target and drafter (a model drafter's weights and KV; model-free drafters cost nothing
    here), and a `DraftOffload` drafter with no `free_memory` of its own follows this budget."""

    def __init__(self, total_bytes: int):
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, numbers.Real) \
                or not math.isfinite(total_bytes) or total_bytes <= 0:
            raise ValueError(f"A memory budget is a positive, finite number of bytes, got {total_bytes!r}: e.g. "
                             "MemoryBudget(4 << 30) for 4 GiB.")
        self.total = int(total_bytes)
        self.engine, self.draft = None, None
        self.weights = self.per_token = self.draft_weights = self.draft_per_token = 0

    def bind(self, engine) -> None:
        self.engine, self.draft = engine, engine.loop.given_drafter
        self.weights, self.per_token = weight_bytes(engine.model), kv_bytes_per_token(engine.model)
        if isinstance(self.draft, (ModelDrafter, DraftOffload)):
            self.draft_weights = self.draft.size if isinstance(self.draft, DraftOffload) else \
                weight_bytes(self.draft.model)
            self.draft_per_token = kv_bytes_per_token(self.draft.model)
        if isinstance(self.draft, DraftOffload) and self.draft.free_memory is None:
            self.draft.free_memory = self.free
        if self.total <= self.weights + self.draft_weights:
            raise ValueError(
                f"A memory budget of {self.total / 2**20:.0f} MB leaves no room for KV: the weights alone take "
                f"{(self.weights + self.draft_weights) / 2**20:.0f} MB. Raise the budget or use a smaller draft.")

    @property
    def draft_resident(self) -> bool:
        return self.draft_weights > 0 and not self.draft.offloaded

    def request_bytes(self, tokens: int, with_draft: bool | None = None) -> int:
        with_draft = self.draft_resident if with_draft is None else with_draft
        return tokens * (self.per_token + (self.draft_per_token if with_draft else 0))

    def used(self) -> int:
        tokens = sum(reserved_tokens(h) for h in self.engine.running.values()) if self.engine else 0
        resident = self.draft_weights if self.draft_resident else 0
        return self.weights + resident + self.request_bytes(tokens)

    def admissible(self, handles) -> int:
        """How many of `handles` (in order) fit next to the running requests. With nothing running no step would
        ever offload the draft, so a head that fits only without it takes the draft out here (not while a drafter
        call the engine stopped waiting for still runs: the head then waits until it has returned)."""
        if handles and not self.engine.running and self.draft_resident and isinstance(self.draft, DraftOffload) \
                and self._count(handles[:1]) == 0 and self.engine.loop.drafter_idle():
            self.draft.offload()
        return self._count(handles)

    def _count(self, handles) -> int:
        room, count = self.total - self.used(), 0
        for handle in handles:
            room -= self.request_bytes(reserved_tokens(handle))
            if room < 0:
                break
            count += 1
        return count

    def fits_alone(self, tokens: int) -> bool:
        """Whether a request of `tokens` could ever run (with the draft resident, or offloaded if it can be)."""
        stays = self.draft_weights > 0 and not isinstance(self.draft, DraftOffload)     # a draft that cannot leave
        floor = self.weights + (self.draft_weights if stays else 0)
        return floor + self.request_bytes(tokens, with_draft=stays) <= self.total

    def free(self) -> int:
        """Bytes free once the head of the queue is admitted (negative: it waits for memory). While the draft is
        away, its KV for the running rows counts as taken: that is what its reload would need besides its weights."""
        waiting = self.engine.waiting[:1] if self.engine else []
        head = sum(self.request_bytes(reserved_tokens(h)) for h in waiting)
        free = self.total - self.used() - head
        if not self.draft_resident and self.draft_weights and self.engine:
            free -= self.draft_per_token * sum(reserved_tokens(h) for h in self.engine.running.values())
        return free


def reserved_tokens(handle) -> int:
    return len(handle.prompt) + handle.max_new_tokens
