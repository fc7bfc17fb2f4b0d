"""The execution step, `prepare(model)`: run a model's linear layers the way their hardware wants, so a multi-token
forward costs close to what its memory traffic needs. `unprepare(model)` restores it.

Why it matters for speculation: on a CPU, eager PyTorch multiplies a [rows, in] input by a plain [out, in] weight. For
one row that is a matrix-vector product straight from the weight; for two or more rows oneDNN/MKL first repacks the
weight into the blocked layout its matrix kernels read, on every call. A verification feeds several tokens per row, so
it pays that repack for every weight of the model on every step: verifying a few drafts can cost about twice a
one-token step, where reading the weights once would cost about the same.

What prepare does (CPU): each `torch.nn.Linear` gets its weight reordered once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`) and its forward calls oneDNN with it (`torch.ops.mkldnn._linear_pointwise`),
the same two operations Inductor's CPU weight prepacking emits. The plain weight stays a plain Parameter (a tied
embedding, a LoRA or `state_dict` still read it), but not resident (`spill`), so a prepared model keeps one resident
copy of its linear weights, the packed one, instead of two:
- a weight that already lives in a file mapping (`from_pretrained` maps a safetensors checkpoint) stays there, and
  the pages packing read are handed back to the kernel (madvise MADV_PAGEOUT: the content is unchanged, a later read
  pages it in again);
- a weight in anonymous memory (built in memory, converted to another dtype) moves to a private mapping of a file
  of its own, unlinked at once.
The kernel pages the plain bytes in when something reads them and drops them again under memory pressure. A
spilled weight is an ordinary tensor for every reader (a write to it is copy-on-write, into memory, and is packed
again as below). Where no disk folder can hold them (a RAM-backed filesystem, no space), the plain weights stay in
memory and `prepared(model)` says why.
- float32: always packed.
- bfloat16: packed where oneDNN has native bf16 kernels on this CPU (avx512_bf16 or AMX); elsewhere bf16 is emulated
  and slower than float32, and prepare leaves the model as it is, with a warning that says so.
- Layers it leaves alone: subclasses of Linear (quantized layers such as bitsandbytes'), layers with accelerate hooks
  (offloaded weights move per forward), weights on another device than the CPU, other dtypes.
- Safe by construction: a weight changed in place after prepare (`load_state_dict`, an optimizer step, a write
  through `.data`, which a prepared weight notices whenever `.data` is handed out) is packed again on the next
  forward; a weight converted to a dtype that does not pack here (`model.double()`) runs eagerly; a deep copy or an
  unpickled prepared model packs again at its first forward; with autograd on and a weight that requires grad, the
  layer runs eagerly. A prepared weight is a Parameter subclass until `unprepare`.
On CUDA, prepare changes nothing: cuBLAS reads weights in their plain layout at every width (no repack to remove).

Logits change in their last bits (oneDNN sums in another order): judge greedy identity against stock `generate` on
the same prepared model, never across prepared and unprepared.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import tempfile
import warnings

import torch
import torch.nn.functional as F

_PACKED = "_spec_adapt_packed"          # a _Packed on a prepared layer
_PREPARED = "_spec_adapt_prepared"      # what prepare did, on the model
_SWITCH = "_spec_adapt_switch"          # {"on": bool}, shared by a model's packed layers (see `eager`)
SPILL_ENV = "SPEC_ADAPT_SPILL_DIR"      # where spilled plain weights go (default: ~/.cache/spec_adapt/spill)
_RAM_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}


def prepare(model: torch.nn.Module, dtype_check: bool = True, spill: bool | str = True) -> torch.nn.Module:
    """Pack `model`'s linear weights for this CPU (see the module docstring); returns the same model, changed in place.

    `spill`: True moves the plain copies of packed weights to a file-backed mapping in $SPEC_ADAPT_SPILL_DIR (default
    ~/.cache/spec_adapt/spill), a folder path puts them there, False keeps them in memory (two resident copies).
    Calling it again is a no-op; `unprepare(model)` undoes it; `prepared(model)` says what it did."""
    if getattr(model, _PREPARED, None) is not None:
        return model
    folder, why_not = spill_folder(spill)
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        _mark(model, 0, "not a CPU model: nothing to pack")
        return model
    reason = why_not_packed(param.dtype) if dtype_check else None
    if reason is not None:
        warnings.warn(f"spec_adapt.prepare: {reason}; the model runs unchanged.", RuntimeWarning, stacklevel=2)
        _mark(model, 0, reason)
        return model
    # "dtypes": what this machine packs, for a weight converted after prepare (model.double() runs eagerly).
    count, switch = 0, {"on": True, "dtypes": {d for d in (torch.float32, torch.bfloat16) if why_not_packed(d) is None},
                        "spill": folder}
    with torch.no_grad():
        for module in model.modules():
            if _packable(module, param.dtype):
                module.__dict__[_SWITCH] = switch
                _pack(module)
                _watch(module.weight)
                module.forward = functools.partial(_packed_forward, module)    # picklable, deep-copyable
                count += 1
    _mark(model, count, f"{count} linear layers packed for oneDNN ({str(param.dtype).removeprefix('torch.')})")
    model.__dict__[_PREPARED].update(switch=switch, plain=why_not or (
        f"not resident: file-mapped weights stay in their files, the others spill to {folder}"))
    return model


def spill_folder(spill: bool | str) -> tuple[str | None, str | None]:
    """(the folder plain weights spill to, None) or (None, why they stay in memory). A folder on a RAM-backed
    filesystem would keep them resident all the same, so it is not used."""
    if spill is False:
        return None, "kept in memory (spill=False): two resident copies of each packed weight"
    if spill is not True and not isinstance(spill, (str, os.PathLike)):
        raise TypeError(f"prepare(spill=...) takes True, False or a folder path, not {type(spill).__name__}")
    folder = os.fspath(spill) if spill is not True else os.environ.get(SPILL_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "spec_adapt", "spill")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        return None, f"kept in memory: cannot create the spill folder {folder!r} ({error})"
    kind = _filesystem(folder)
    if kind in _RAM_FILESYSTEMS:
        return None, f"kept in memory: the spill folder {folder!r} is on {kind}, which is memory too"
    return folder, None


def _filesystem(folder: str) -> str | None:
    """The filesystem type /proc/mounts gives for `folder`'s mount point (None where unknown)."""
    try:
        with open("/proc/mounts") as mounts:
            entries = [line.split()[1:3] for line in mounts if len(line.split()) > 2]
    except OSError:
        return None
    path = os.path.realpath(folder)
    best = max((point for point, _ in entries if path == point or path.startswith(point.rstrip("/") + "/")),
               key=len, default=None)
    return dict(entries).get(best) if best is not None else None


@contextlib.contextmanager
def eager(model: torch.nn.Module):
    """Run a prepared model eagerly inside the block (the packed copies stay): what the model did before `prepare`,
    without packing it again after. Benchmarks time both configurations in one process this way."""
    switch = (prepared(model) or {}).get("switch")
    if switch is None:
        yield model
        return
    switch["on"] = False
    try:
        yield model
    finally:
        switch["on"] = True


def unprepare(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `prepare`: every layer runs its own forward again and the packed copies are freed."""
    for module in model.modules():
        if hasattr(module, _PACKED):
            delattr(module, _PACKED)
            _unwatch(module.weight)
            module.__dict__.pop("forward", None)
            module.__dict__.pop(_SWITCH, None)
            if _in_mapping(module.weight):             # back into memory, as before prepare
                torch.Tensor.data.__set__(module.weight, module.weight.detach().clone())
    model.__dict__.pop(_PREPARED, None)
    return model


def prepared(model: torch.nn.Module) -> dict | None:
    """What `prepare` did to `model` ({"layers": packed layer count, "detail": ...}), or None if it was not asked."""
    return getattr(model, _PREPARED, None)


def why_not_packed(dtype: torch.dtype) -> str | None:
    """None if prepare packs weights of `dtype` on this machine, else the reason it does not."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this PyTorch build has no oneDNN linear ops (torch.ops.mkldnn._linear_pointwise)"
    if dtype == torch.float32:
        return None
    if dtype == torch.bfloat16:
        return None if native_bf16() else "this CPU has no native bfloat16 (avx512_bf16 or AMX): use float32"
    return f"no packed path for {dtype}: prepare packs float32, and bfloat16 on CPUs with native bf16"


def native_bf16() -> bool:
    """True where oneDNN runs bfloat16 matrix products natively on this CPU (avx512_bf16 or AMX)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def fastest(model: torch.nn.Module, pack: bool = True):
    """`model` in the dtype this hardware computes fastest, prepared when `pack`: (the model, its dtype, why).

    Chosen by capability, never by a timing (two timings a few percent apart flip on a busy machine): bfloat16 on a
    GPU that supports it and on a CPU where oneDNN runs bf16 natively (avx512_bf16 or AMX, which halves the bytes a
    decode step reads), float32 elsewhere (where bf16 is emulated and slower). A bfloat16 choice is a
    copy (drop the float32 model to free its memory); a float32 choice is the model itself.

    Meant for a draft model, whose precision changes which tokens it proposes, never what the target commits. For
    a target it would change the output's numerics: a bf16 target breaks near-ties differently at different
    widths, so keep a target in float32 where strict identity with one-token decoding matters (docs/execution.md)."""
    import copy

    ready = prepare if pack else (lambda m: m)
    dtype, why = bf16_capability(model.device)
    chosen = model if dtype == model.dtype else copy.deepcopy(model).to(dtype)
    return ready(chosen), dtype, why


def bf16_capability(device) -> tuple[torch.dtype, str]:
    """(bfloat16 or float32, why): whether `device` computes bf16 natively."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "this GPU computes bfloat16 natively"
        return torch.float32, "this GPU has no native bfloat16"
    if device.type != "cpu":
        return torch.float32, f"no bfloat16 capability check for {device.type}: float32"
    if native_bf16():
        return torch.bfloat16, "this CPU computes bfloat16 natively (oneDNN reports avx512_bf16 or AMX)"
    return torch.float32, "this CPU has no native bfloat16 (no avx512_bf16 or AMX): bf16 would be emulated"


# -- one layer --------------------------------------------------------------------------------------------------
def _packable(module, dtype) -> bool:
    if type(module) is not torch.nn.Linear or hasattr(module, "_hf_hook"):
        return False
    weight = module.weight
    return weight.device.type == "cpu" and weight.dtype == dtype and weight.dim() == 2


class _Packed:
    """A layer's packed weight and what it was packed from. Never copied or pickled: a deep copy or an unpickled
    model holds an empty one and packs again at its first forward (oneDNN's packed tensors have no storage)."""

    def __init__(self, packed=None, version=None, pointer=None, dtype=None):
        self.packed, self.version, self.pointer, self.dtype = packed, version, pointer, dtype

    def current(self, weight) -> bool:
        return (self.packed is not None and not weight.__dict__.get(_WRITTEN) and weight.dtype == self.dtype
                and weight.data_ptr() == self.pointer and _version(weight) == self.version)

    def __deepcopy__(self, memo):
        return _Packed()

    def __reduce__(self):
        return _Packed, ()


def _version(tensor):
    """The tensor's version counter (None for an inference-mode tensor, which has none)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


_WRITTEN = "_spec_adapt_data_read"     # set on a watched weight whose `.data` was handed out since it was packed


class _WatchedParameter(torch.nn.Parameter):
    """A prepared layer's weight. `.data` is a tensor with a version counter of its own, so an in-place write through
    it (`w.data.mul_(...)`, `w.data.copy_(...)`: EMA, weight averaging, older init code) changes neither the
    parameter's version nor its pointer: every hand-out of `.data` marks the packed copy stale instead."""

    @property
    def data(self):
        self.__dict__[_WRITTEN] = True
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        self.__dict__[_WRITTEN] = True
        torch.Tensor.data.__set__(self, value)


def _watch(weight) -> None:
    if type(weight) is torch.nn.Parameter:
        weight.__class__ = _WatchedParameter


def _unwatch(weight) -> None:
    if type(weight) is _WatchedParameter:
        weight.__class__ = torch.nn.Parameter
        weight.__dict__.pop(_WRITTEN, None)


def _pack(module) -> None:
    weight = module.weight
    previous = getattr(module, _PACKED, None)
    changed = previous is not None and previous.packed is not None    # written since (its pages may be in memory)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    _spill(weight, module.__dict__[_SWITCH].get("spill"), changed)
    weight.__dict__.pop(_WRITTEN, None)
    setattr(module, _PACKED, _Packed(packed, _version(weight), weight.data_ptr(), weight.dtype))


_SPILLED = "_spec_adapt_spilled"       # on a weight: (storage pointer, version) of its file-backed mapping, or False


def _spill(weight, folder: str | None, changed: bool = False) -> None:
    """Take `weight`'s plain bytes out of resident memory (see the module docstring): a file-mapped weight's pages
    go back to the kernel; anonymous memory moves to a private mapping of a file in `folder` (unlinked at once: the
    mapping keeps it until the storage is freed). The Parameter stays the same object (tied weights follow). Left in
    memory where the folder cannot take it (no space, no permission). A `changed` weight may hold written pages in
    memory, which the kernel cannot hand back: it moves to a file of its own."""
    if folder is None or _spilled(weight) or weight.__dict__.get(_SPILLED) is False:
        return                                   # a changed weight spills again: its written pages are in memory
    if not changed and _file_mapped(weight.data_ptr()):
        _page_out(weight)
        return
    try:
        mapped = _mapped_copy(weight.detach(), folder)
        torch.Tensor.data.__set__(weight, mapped)
    except (OSError, RuntimeError):              # a full disk; an inference-mode weight refuses a new `.data`
        weight.__dict__[_SPILLED] = False        # not tried again for this weight
        return
    weight.__dict__[_SPILLED] = (weight.untyped_storage().data_ptr(), _version(weight))


def _mapped_copy(tensor: torch.Tensor, folder: str) -> torch.Tensor:
    fd, path = tempfile.mkstemp(prefix="weight-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            tensor.contiguous().view(torch.uint8).numpy().tofile(file)
        mapped = torch.from_file(path, shared=False, size=tensor.numel(), dtype=tensor.dtype)
    finally:
        os.unlink(path)
    return mapped.view(tensor.shape)


def _spilled(weight) -> bool:
    """Whether `weight` lives, unchanged, in the mapping `_spill` gave it (not after a write, a new `.data` or a deep
    copy, which put bytes in memory)."""
    spilled = weight.__dict__.get(_SPILLED)
    return _in_mapping(weight) and spilled[1] == _version(weight) and not weight.__dict__.get(_WRITTEN)


def _file_mapped(address: int) -> bool:
    """Whether `address` lies in a mapping of a file (/proc/self/maps: an inode and a path), not anonymous memory."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return len(fields) > 5 and fields[4] != "0" and not fields[5].startswith("[")
    except OSError:
        pass
    return False


_MADV_PAGEOUT = 21      # Linux >= 5.4: reclaim these pages now; content unchanged (a clean file page is re-read)


def _page_out(tensor) -> None:
    """Hand the whole pages of `tensor`'s bytes back to the kernel. A hint: where it is not available, the pages
    stay until memory pressure reclaims them (they are clean file pages either way)."""
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    if end > start:
        try:
            ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                                      _MADV_PAGEOUT)
        except (OSError, AttributeError):
            pass


def _in_mapping(weight) -> bool:
    spilled = weight.__dict__.get(_SPILLED)
    return bool(spilled) and weight.untyped_storage().data_ptr() == spilled[0]


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if not self.__dict__[_SWITCH]["on"] or torch.is_grad_enabled() and weight.requires_grad \
            or x.dtype != weight.dtype or x.device.type != "cpu" or weight.device.type != "cpu" \
            or weight.dtype not in self.__dict__[_SWITCH]["dtypes"]:
        # training, an input or a weight (moved, converted with model.double()) the packed path does not fit
        return F.linear(x, weight, self.bias)
    state = getattr(self, _PACKED)
    if not state.current(weight):                    # changed since it was packed (or a copy): pack again
        _pack(self)
        state = getattr(self, _PACKED)
    packed = state.packed
    bias = None if self.bias is None else self.bias.detach()
    out = _packed_linear(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _packed_linear(x, packed, bias, *args):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, *args)


def _mark(model, layers: int, detail: str) -> None:
    model.__dict__[_PREPARED] = {"layers": layers, "detail": detail}
