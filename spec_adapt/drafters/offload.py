"""Draft offload under memory pressure (Nightjar's elastic memory): the draft's weights leave for the next memory
tier while speculation is off and memory is short, and come back when it is free again.

Tiers: CUDA -> pinned host memory (copies on a side stream, so a reload overlaps target steps; the first proposal
after it waits on the copy's event); CPU -> disk (accelerate's `offload_state_dict`: one numpy memmap per tensor,
read back on reload). accelerate's hooks (`cpu_offload`, `disk_offload`) move weights in and out around *every*
forward, synchronously and from pageable memory; here the weights move twice per pressure episode, so only its
offload utilities are used, not its hooks.

Triggers (Nightjar): the policy chose γ = 0 for `persist` steps in a row and free memory is below `low`
bytes -> offload; free memory above the draft's size + `low` -> reload (hysteresis). Free memory is free device
memory on CUDA, available RAM on the CPU, or what `free_memory()` (a callable the user passes: a budget) returns.
The draft's KV is dropped on offload; after a reload the draft rebuilds it by catching up on the committed tokens
(its lag, which the policies already price as the switching cost). While the draft is away `available()` is False
and the loop runs plain steps without asking the policy.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from .drafter import (CatchUp, ChecksTarget, Drafter, DraftRequest, Events, JoinsRows, Observes, Offloads, Proposal,
                   TakesInputs, Trees)
from .model import ModelDrafter


def _available_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def _free_memory(device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return _available_ram()


class DraftOffload(Trees, CatchUp, JoinsRows, Offloads, Observes, Events, ChecksTarget, TakesInputs):
    """Wrap a model drafter (or a draft model) so its weights can leave and come back. See the module docstring."""

    def __init__(self, drafter, low: int = 1 << 30, persist: int = 8, free_memory=None, folder=None):
        _check_movable(drafter)
        self.inner = drafter if isinstance(drafter, ModelDrafter) else ModelDrafter(drafter)

        if is_quantized(self.inner.model):
            raise ValueError("DraftOffload does not move bitsandbytes-quantized weights (their quantization state "
                             "lives beside each tensor, outside what it moves). Offload the unquantized draft, or "
                             "keep the quantized one resident: it is the other way to make room.")
        if not isinstance(persist, int) or persist < 1 or low < 0:
            raise ValueError(f"DraftOffload needs persist >= 1 and low >= 0, got {persist!r}, {low!r}.")
        self.low, self.persist = low, persist
        self.free_memory = free_memory
        self.folder = Path(folder) if folder is not None else None
        self.offloaded = False
        self.idle = 0                       # consecutive steps at γ = 0
        self.events: list[dict] = []        # {"event": "offload" | "reload" | "reload failed", "step", "seconds", ...}
        self._host: dict[str, torch.Tensor] = {}
        self._index = None
        self._ready: torch.cuda.Event | None = None
        self._steps = 0
        if next(self.model.parameters()).device.type == "cpu":
            _own_storage(self.model)

    # -- memory --------------------------------------------------------------------------------------------------
    @property
    def model(self):
        return self.inner.model

    @property
    def size(self) -> int:
        """Bytes of the draft's weights (tied tensors once)."""
        seen, total = set(), 0
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total if not self.offloaded else self._size

    def free(self) -> int:
        return int(self.free_memory()) if self.free_memory is not None else _free_memory(self.inner_device)

    @property
    def inner_device(self):
        return self._device if self.offloaded else next(self.model.parameters()).device

    def offload(self) -> None:
        """Move the weights to the next tier and drop the draft's KV."""
        if self.offloaded:
            return
        start = time.perf_counter()
        self._size, self._device = self.size, next(self.model.parameters()).device
        params = dict(self.model.named_parameters())       # tied weights appear once
        if self._device.type == "cuda":
            stream = torch.cuda.Stream(self._device)
            with torch.cuda.stream(stream):
                self._host = {n: torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p.data, non_blocking=True)
                              for n, p in params.items()}
            stream.synchronize()                            # the device copy may go only once the host has it
        else:
            from accelerate.utils import offload_state_dict

            if self.folder is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="spec_adapt-draft-")
                self.folder = Path(self._tmp.name)
            if self._index is None:                         # written once; weights do not change
                offload_state_dict(str(self.folder), {n: p.data for n, p in params.items()})
                self._index = list(params)
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if self.inner.ledger is not None:
            self.inner.ledger.drop_kv()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _trim_heap()
        self.offloaded = True
        self.events.append({"event": "offload", "step": self._steps, "seconds": time.perf_counter() - start})

    def reload(self) -> None:
        """Bring the weights back (CUDA: asynchronously; the next proposal waits for the copy)."""
        if not self.offloaded:
            return
        start = time.perf_counter()
        params = dict(self.model.named_parameters())
        if self._device.type == "cuda":
            stream = torch.cuda.Stream(self._device)
            with torch.cuda.stream(stream):
                for n, p in params.items():
                    p.data = self._host[n].to(self._device, non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record(stream)
        else:
            import json

            from accelerate.utils import load_offloaded_weight

            index = json.loads((self.folder / "index.json").read_text())
            for n, p in params.items():
                # A copy out of the memmap (bfloat16 restored): the files stay the offload copy for the next episode.
                p.data = load_offloaded_weight(str(self.folder / f"{n}.dat"), index[n])
        self.offloaded = False
        self.events.append({"event": "reload", "step": self._steps, "seconds": time.perf_counter() - start})

    # -- the drafter's members: everything goes to the inner drafter while resident ----------------------------------
    def available(self) -> bool:
        return not self.offloaded

    def observe(self, record) -> None:
        self._steps += 1
        self.idle = self.idle + 1 if max(record.gammas, default=0) == 0 else 0
        if not self.offloaded and self.idle >= self.persist and self.free() < self.low:
            self.offload()
        elif self.offloaded and self.free() > self._size + self.low:
            try:
                self.reload()
            except Exception as exc:                        # noqa: BLE001 - no draft is better than no answer
                self.events.append({"event": "reload failed", "step": self._steps,
                                    "error": f"{type(exc).__name__}: {exc}"})
                raise

    def validate(self, target):
        self.inner.validate(target)

    def share_inputs(self, inputs):
        self.inner.share_inputs(inputs)

    def begin(self, input_ids, attention_mask):
        self._steps, self.idle = 0, 0
        self.inner.begin(input_ids, attention_mask)        # nothing cached yet: no weights needed

    def add_rows(self, input_ids, attention_mask, rows):
        self.inner.add_rows(input_ids, attention_mask, rows)

    def propose(self, request: DraftRequest) -> Proposal:
        if self.offloaded:                                   # the loop does not ask while unavailable
            return Proposal.empty(len(request.gammas), request.tokens.device)
        if self._ready is not None:
            torch.cuda.current_stream(self._device).wait_event(self._ready)
            self._ready = None
        return self.inner.propose(request)

    def lag(self, lengths):
        return self.inner.lag(lengths)

    def keep_tree(self, path):
        self.inner.keep_tree(path)

    def rollback(self, keep_len):
        self.inner.rollback(keep_len)

    def select_rows(self, index):
        self.inner.select_rows(index)

    def end(self, tokens=None, lengths=None):
        self.inner.end(tokens, lengths)


def _check_movable(drafter) -> None:
    """Refuse, before anything is copied, a Drafter that is not one draft model's `ModelDrafter`: the weights moved
    are that model's, and the drafter's KV dropped on offload is that drafter's."""
    if not isinstance(drafter, Drafter) or isinstance(drafter, ModelDrafter):
        return
    from .lookup import PromptLookupDrafter
    from .scripted import ScriptedDrafter
    from .sources import MultiSourceDrafter
    from .suffix import SuffixDrafter

    name = type(drafter).__name__
    if isinstance(drafter, MultiSourceDrafter) and drafter.model_drafter is not None:
        raise ValueError(f"DraftOffload moves a draft model's weights, and a {name} drafts with its draft model beside "
                         "model-free sources: offload its draft model instead, "
                         "MultiSourceDrafter(DraftOffload(ModelDrafter(draft))) (with the same free= and max_free=). "
                         "While the draft is away its rows may still draft from the model-free sources.")
    if isinstance(drafter, (MultiSourceDrafter, PromptLookupDrafter, SuffixDrafter, ScriptedDrafter)):
        raise ValueError(f"DraftOffload({name}): nothing to offload, {name} drafts without a model (it holds no "
                         "weights). Use it as it is.")
    raise ValueError(f"DraftOffload wraps a draft model or its ModelDrafter, got a {name}: pass "
                     "DraftOffload(ModelDrafter(draft)) where the draft model is a causal LM.")


def _own_storage(model) -> None:
    """Give every parameter a storage of its own. A `from_pretrained` model's tensors may be views into what the
    loader keeps (a memory-mapped file, one flat buffer): dropping them then frees nothing. Measured on the 0.5B draft
    in bfloat16: the first offload freed 519 of 1202 MB without this, 1159 MB with it (benchmarks/offload.py)."""
    with torch.no_grad():
        for p in model.parameters():          # tied weights are one parameter, cloned once
            p.data = p.data.clone()
    _trim_heap()


def _trim_heap() -> None:
    """Return freed heap pages to the OS. glibc raises its mmap threshold after freeing a large block, so later
    weights of that size come from the heap, whose free pages stay in the process until trimmed."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):          # not glibc (macOS, musl): the allocator decides
        pass


def quantization_of(model) -> str | None:
    """"8bit" / "4bit" for a model loaded with a bitsandbytes config, else None."""
    if getattr(model, "is_loaded_in_8bit", False):
        return "8bit"
    return "4bit" if getattr(model, "is_loaded_in_4bit", False) else None


def is_quantized(model) -> bool:
    """True for a bitsandbytes model, or any model whose config carries a quantization config (its weights cannot
    be copied out and back as plain tensors)."""
    return quantization_of(model) is not None or \
        getattr(getattr(model, "config", None), "quantization_config", None) is not None
