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
The kernel pages the plain bytes in when something reads them and drops them again under memory pressure (the
fingerprint below keeps the few pages that hold its samples resident). A spilled weight is an ordinary tensor for
every reader (a write to it is copy-on-write, into memory, and is packed again as below). A weight whose storage
other tensors share (a `state_dict` taken before, a detached tensor, a view, `.data`) stays where it is, so a write
through them reaches the model as it would unprepared. Where no disk folder can hold them (a RAM-backed filesystem,
a folder that cannot be written, no space), the plain weights stay in memory; `prepared(model)["plain"]` says which
and why, and a folder that refuses them is warned about once.
- float32: always packed.
- bfloat16: packed where oneDNN has native bf16 kernels on this CPU (avx512_bf16 or AMX); elsewhere bf16 is emulated
  and slower than float32, and prepare leaves the model as it is, with a warning that says so.
- Layers it leaves alone: subclasses of Linear (quantized layers such as bitsandbytes'), layers with accelerate hooks
  (offloaded weights move per forward), weights on another device than the CPU, other dtypes.
- A packed copy is used only while a fingerprint of the plain weight it was packed from still matches, checked at
  every forward of its layer (so at every generate step and serving Engine step, whichever module the forward
  enters by): the Parameter object itself (a replaced one, `load_state_dict(assign=True)`, is packed from), its
  data pointer, dtype, shape and strides (a new `.data`), its version counter where it has one (every in-place
  write through the Parameter, a view of it or a detached alias: `load_state_dict`, an optimizer step), and the
  bits of 256 elements at positions fixed at pack time, 8 stripes spread from its first element to its last (writes
  no counter shows: through `.data`, or to an inference-mode tensor, which has no version counter). When it does
  not match, the layer packs again before it computes. It costs 0.2-0.3% of a one-token forward (the 1.5B
  Qwen2.5-Coder target in float32, 197 packed layers: docs/execution.md).
  Limit: a write that no counter shows and that leaves all 256 sampled elements as they were (a few rows or
  elements written through `.data` or to an inference tensor) goes unnoticed; a write of the whole weight (loading,
  `copy_`, `fill_`, scaling, an optimizer step) changes sampled elements and is caught. After such a partial
  write, `unprepare` and `prepare` again.
- A weight converted to a dtype that does not pack here (`model.double()`) runs eagerly; a deep copy or an
  unpickled prepared model packs again at its first forward; with autograd on and a weight that requires grad, the
  layer runs eagerly.
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
import weakref

import numpy as np
import torch
import torch.nn.functional as F

from .compat import mkldnn_op, storage_shared

_PACKED = "_spec_adapt_packed"          # a _Packed on a prepared layer
_PREPARED = "_spec_adapt_prepared"      # what prepare did, on the model
_SWITCH = "_spec_adapt_switch"          # {"on": bool}, shared by a model's packed layers (see `eager`)
SPILL_ENV = "SPEC_ADAPT_SPILL_DIR"      # where spilled plain weights go (default: ~/.cache/spec_adapt/spill)
_RAM_FILESYSTEMS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}
_CANNOT = "kept in memory: cannot"      # how spill_folder's reasons start where the folder refuses (prepare warns)


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
    kept: dict[str, int] = {}                  # why a plain weight stays in memory: how many
    with torch.no_grad():
        for module in model.modules():
            if _packable(module, param.dtype):
                module.__dict__[_SWITCH] = switch
                reason = _pack(module)
                if reason is not None:
                    kept[reason] = kept.get(reason, 0) + 1
                module.forward = functools.partial(_packed_forward, module)    # picklable, deep-copyable
                count += 1
    _mark(model, count, f"{count} linear layers packed for oneDNN ({str(param.dtype).removeprefix('torch.')})")
    plain = why_not or f"not resident: file-mapped weights stay in their files, the others spill to {folder}"
    if kept:
        plain = (f"kept in memory for {sum(kept.values())} of {count} packed weights ("
                 + "; ".join(f"{n}: {why}" for why, n in kept.items()) + ")"
                 + ("" if sum(kept.values()) == count else f"; the others are not resident (spill folder {folder})"))
    failed = why_not if why_not and why_not.startswith(_CANNOT) else next(
        (f"kept in memory: {why}" for why in kept if why.startswith(_FOLDER_FAILED)), None)
    if failed is not None:                     # asked to spill, and the folder cannot take them: say it, once
        warnings.warn(f"spec_adapt.prepare: plain weights {failed}, so both copies of them stay resident. Set "
                      f"{SPILL_ENV} or prepare(spill=...) to a writable folder on disk.", RuntimeWarning, stacklevel=2)
    model.__dict__[_PREPARED].update(switch=switch, plain=plain)
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
        return None, f"{_CANNOT} create the spill folder {folder!r} ({error})"
    kind = _filesystem(folder)
    if kind in _RAM_FILESYSTEMS:
        return None, f"kept in memory: the spill folder {folder!r} is on {kind}, which is memory too"
    try:                                         # it exists: can this process create files in it?
        fd, probe = tempfile.mkstemp(prefix="probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        return None, f"{_CANNOT} write to the spill folder {folder!r} ({error})"
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
            module.__dict__.pop("forward", None)
            module.__dict__.pop(_SWITCH, None)
            weight = module.weight
            if _in_mapping(weight) and not _shared(weight):     # back into memory, as before prepare (a tensor
                torch.Tensor.data.__set__(weight, weight.detach().clone())  # sharing it keeps it where it is)
    model.__dict__.pop(_PREPARED, None)
    return model


def prepared(model: torch.nn.Module) -> dict | None:
    """What `prepare` did to `model` ({"layers": packed layer count, "detail": ...}), or None if it was not asked."""
    return getattr(model, _PREPARED, None)


def why_not_packed(dtype: torch.dtype) -> str | None:
    """None if prepare packs weights of `dtype` on this machine, else the reason it does not."""
    if mkldnn_op("_reorder_linear_weight") is None or mkldnn_op("_linear_pointwise") is None:
        return "this PyTorch build has no oneDNN linear ops (torch.ops.mkldnn._linear_pointwise)"
    if dtype == torch.float32:
        return None
    if dtype == torch.bfloat16:
        return None if native_bf16() else "this CPU has no native bfloat16 (avx512_bf16 or AMX): use float32"
    return f"no packed path for {dtype}: prepare packs float32, and bfloat16 on CPUs with native bf16"


def native_bf16() -> bool:
    """True where oneDNN runs bfloat16 matrix products natively on this CPU (avx512_bf16 or AMX)."""
    check = mkldnn_op("_is_mkldnn_bf16_supported")
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


# The fingerprint's samples: _STRIPES stripes spread evenly over the weight's elements in memory order (its first
# and last elements included), each _PER_STRIPE elements _STEP apart (columns that differ from row to row, within
# about one page: reading a spilled weight's samples keeps at most two pages of each stripe resident).
_STRIPES, _PER_STRIPE, _STEP = 8, 32, 31
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}   # compared bit for bit (NaN, -0.0)


class _Packed:
    """A layer's packed weight and the fingerprint of the plain weight it was packed from: the Parameter itself
    (a weak reference), its data pointer, dtype, shape, strides and version counter, and the bits of a few hundred
    elements at positions fixed at pack time. The packed copy is used only while all of them match (`current`).
    Never copied or pickled: a deep copy or an unpickled model holds an empty one and packs again at its first
    forward (oneDNN's packed tensors have no storage)."""

    def __init__(self, packed=None, weight=None, samples=None):
        self.packed, self.samples = packed, samples
        if weight is None:
            return
        self.ref, self.pointer, self.dtype = weakref.ref(weight), weight.data_ptr(), weight.dtype
        self.shape, self.stride, self.version = weight.shape, weight.stride(), _version(weight)
        self.rows, self.cols = _positions(weight.shape)
        self.bits = _bits(weight)                # a numpy view of the weight's storage (reads nothing now)

    def current(self, weight) -> bool:
        return (self.packed is not None and self.ref() is weight and weight.data_ptr() == self.pointer
                and weight.dtype is self.dtype and weight.shape == self.shape and weight.stride() == self.stride
                and _version(weight) == self.version and self.sample() == self.samples)

    def sample(self) -> bytes:
        """The sampled elements' bits, read now from the storage the weight had at pack time (valid to compare
        only once the pointer matched: then it is the weight's storage)."""
        return self.bits[self.rows, self.cols].tobytes()

    def __deepcopy__(self, memo):
        return _Packed()

    def __reduce__(self):
        return _Packed, ()


def _positions(shape) -> tuple[np.ndarray, np.ndarray]:
    """The sampled (rows, columns) of a weight of `shape`: see _STRIPES."""
    rows, cols = shape
    count = rows * cols
    if count == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    span = (_PER_STRIPE - 1) * _STEP
    starts = np.linspace(0, max(count - 1 - span, 0), _STRIPES).round().astype(np.int64)
    flat = np.unique(np.minimum(starts[:, None] + np.arange(_PER_STRIPE) * _STEP, count - 1))
    return flat // cols, flat % cols


def _bits(weight) -> np.ndarray:
    return weight.detach().view(_BITS[weight.element_size()]).numpy()


def _version(tensor):
    """The tensor's version counter (None for an inference-mode tensor, which has none)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _shared(weight) -> bool:
    """Whether another tensor shares `weight`'s storage (a `state_dict` entry, a detached tensor, a view, `.data`):
    moving the weight to another storage would cut that alias off, and a write through it would reach the model no
    more. (Where PyTorch does not tell, assume shared.)"""
    try:
        return storage_shared(weight)
    except (AttributeError, RuntimeError):
        return True


def _pack(module) -> str | None:
    """Pack `module`'s weight (again), spill its plain copy, record its fingerprint. Returns why the plain weight
    stays in memory, or None."""
    weight = module.weight
    previous = getattr(module, _PACKED, None)
    changed = previous is not None and previous.packed is not None    # written since (its pages may be in memory)
    if previous is not None:                     # the stale copy and its view of the storage go first
        previous.packed = previous.bits = None
    setattr(module, _PACKED, _Packed())
    packed = mkldnn_op("_reorder_linear_weight")(weight.detach(), None)
    rows, cols = _positions(weight.shape)
    samples = _bits(weight)[rows, cols].tobytes()     # read before the spill: the mapping's pages stay out
    reason = _spill(weight, module.__dict__[_SWITCH].get("spill"), changed)
    setattr(module, _PACKED, _Packed(packed, weight, samples))
    return reason


_SPILLED = "_spec_adapt_spilled"       # on a weight: (storage pointer, version) of its file-backed mapping, or False


_FOLDER_FAILED = "the spill folder"


def _spill(weight, folder: str | None, changed: bool = False) -> str | None:
    """Take `weight`'s plain bytes out of resident memory (see the module docstring): a file-mapped weight's pages
    go back to the kernel; anonymous memory moves to a private mapping of a file in `folder` (unlinked at once: the
    mapping keeps it until the storage is freed). The Parameter stays the same object (tied weights follow). A
    `changed` weight may hold written pages in memory, which the kernel cannot hand back: it moves to a file of its
    own. Returns why it stays in memory instead, or None: another tensor shares its storage (tried again at its next
    repack), or the folder cannot take it (no space, no permission) or it cannot take a new storage (an
    inference-mode tensor), not tried again for this weight."""
    if folder is None:
        return None
    if weight.__dict__.get(_SPILLED) is False:
        return "an earlier spill of it failed"
    if not changed and _spilled(weight):
        return None
    if not changed and _file_mapped(weight.data_ptr()):
        _page_out(weight)                        # the storage stays: tensors that share it still do
        _sampled_pages_alone(weight)
        return None
    if _shared(weight):
        return "other tensors share its storage (state_dict entries, views): a move would cut them off"
    try:
        mapped = _mapped_copy(weight.detach(), folder)
    except OSError as error:                     # a full disk, a folder that stopped taking files
        weight.__dict__[_SPILLED] = False
        return f"{_FOLDER_FAILED} {folder!r} cannot take them ({error})"
    try:
        torch.Tensor.data.__set__(weight, mapped)
    except RuntimeError:                         # an inference-mode weight refuses a new storage
        weight.__dict__[_SPILLED] = False
        return "inference-mode tensors cannot take a new storage"
    weight.__dict__[_SPILLED] = (weight.untyped_storage().data_ptr(), _version(weight))
    _sampled_pages_alone(weight)
    return None


def _mapped_copy(tensor: torch.Tensor, folder: str) -> torch.Tensor:
    fd, path = tempfile.mkstemp(prefix="weight-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            tensor.contiguous().view(torch.uint8).numpy().tofile(file)
            _drop_cached(file, tensor)
        mapped = torch.from_file(path, shared=False, size=tensor.numel(), dtype=tensor.dtype)
    finally:
        os.unlink(path)
    return mapped.view(tensor.shape)


def _drop_cached(file, tensor) -> None:
    """Write `file` (`tensor`'s bytes) out and drop its pages from the page cache, all but the few pages that hold
    the fingerprint's samples: the plain bytes leave memory now, and reading the samples through the mapping maps
    those pages alone (not the large folios a fresh write leaves cached, nor a read-around window)."""
    try:
        file.flush()
        os.fdatasync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)     # this descriptor's reads: no read-ahead
        rows, cols = _positions(tensor.shape)
        for offset in np.unique((rows * tensor.shape[1] + cols) * tensor.element_size() // mmap.PAGESIZE):
            os.pread(file.fileno(), 1, int(offset) * mmap.PAGESIZE)
    except (OSError, AttributeError):           # a filesystem without it: the kernel reclaims them in its time
        pass


def _spilled(weight) -> bool:
    """Whether `weight` lives in the mapping `_spill` gave it, not written in place since as its version counter
    shows (a new `.data` or a deep copy put its bytes in memory)."""
    spilled = weight.__dict__.get(_SPILLED)
    return _in_mapping(weight) and spilled[1] == _version(weight)


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


def convert_paging_out(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model.to(dtype)` one tensor at a time, in place, handing each converted tensor's file pages back to the kernel
    at once. For a model whose weights live in a file mapping (`from_pretrained` over a float32 safetensors file):
    converting it whole would hold the whole file's pages resident beside the copy; this holds one tensor's."""
    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if param.is_floating_point() and param.dtype != dtype:      # a tied weight is converted once
                    old = param.data
                    param.data = old.to(dtype)
                    _page_out_if_mapped(old)
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.is_floating_point() and buffer.dtype != dtype:
                    module._buffers[name] = buffer.to(dtype)
    return model


def _page_out_if_mapped(tensor) -> None:
    if tensor.numel() and _file_mapped(tensor.data_ptr()):
        _page_out(tensor)


_MADV_RANDOM = 1


def _sampled_pages_alone(weight) -> None:
    """Mark the pages that hold the fingerprint's samples for random access (madvise MADV_RANDOM, on those pages
    alone): reading the samples at each check then faults in those pages, not a read-around window or the large
    folios around them, and the rest of the weight stays out of resident memory. A hint, like `_page_out`."""
    page = mmap.PAGESIZE
    rows, cols = _positions(weight.shape)
    stride = weight.stride()
    offsets = (rows * stride[0] + cols * stride[1]) * weight.element_size()
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        for start in np.unique((weight.data_ptr() + offsets) // page * page):
            madvise(ctypes.c_void_p(int(start)), ctypes.c_size_t(page), _MADV_RANDOM)
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
    if not getattr(self, _PACKED).current(weight):   # changed since it was packed (or a copy): pack again
        _pack(self)
    packed = getattr(self, _PACKED).packed
    bias = None if self.bias is None else self.bias.detach()
    out = _packed_linear(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _packed_linear(x, packed, bias, *args):
    return mkldnn_op("_linear_pointwise")(x, packed, bias, *args)


def _mark(model, layers: int, detail: str) -> None:
    model.__dict__[_PREPARED] = {"layers": layers, "detail": detail}
