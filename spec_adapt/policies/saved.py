"""The default policy's memory across processes: what the process's default `Adaptive` for a target and drafter has
learned is written after each of its calls, and a later process starts its first call from it instead of cold.

One JSON file per target, drafter, dtype and device (the latency profile's key, `profile_key`, plus the drafter's
kind, the width bound and a fingerprint of the target's and the draft model's weights: two fine-tunes of one base
saved under the same folder name have files of their own), in `$SPEC_ADAPT_POLICY_DIR`, else
`<spec_adapt cache>/policies`. `SPEC_ADAPT_POLICY_DIR=off` keeps defaults in memory only.

Only a regular file is read (a symbolic link is followed to what it names), and at most the size its open descriptor
reports: a FIFO, a device or a folder at the path is refused without blocking. A file that cannot be read or is not
a valid state is ignored with a warning (the call starts cold); a cache that cannot be written is skipped with a
warning: neither ever fails a call, and each warns once per file and reason in a process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
import threading
import warnings
import weakref
from pathlib import Path

import torch

from ..loading import cache_dir
from .estimators import profile_key

OFF = ("off", "0", "none", "false")
# A saved Adaptive holds a few tables per batch-size bucket and per row of its largest batch: kilobytes to a few MB.
# A larger file is not one (it is not read: parsing it would allocate what it claims).
MAX_STATE_BYTES = 64 << 20


def state_dir() -> Path | None:
    """Where default policies are kept, or None when `SPEC_ADAPT_POLICY_DIR` turns keeping them off."""
    value = os.environ.get("SPEC_ADAPT_POLICY_DIR")
    if value is not None and value.strip().lower() in OFF + ("",):
        return None
    return Path(value) if value else cache_dir() / "policies"


def state_path(model, draft, kind: str, max_width: int | None) -> Path | None:
    """The file of the default policy for `model` with this draft model (or None) and drafter kind."""
    folder = state_dir()
    if folder is None:
        return None
    weights = fingerprint(model) + ("" if draft is None else "-" + fingerprint(draft))
    name = f"{profile_key(model, draft)}__{kind}__w{max_width or 'any'}__{weights}"
    return folder / (re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ".json")


# The weights' fingerprint: a few elements at fixed positions of a few tensors (evenly spaced over the parameter
# list, first and last included, and the input and output embeddings), with every sampled tensor's shape and dtype.
# Models that differ only in elements it does not sample share a file (a state learned on one is still a valid
# start for the other: it steers only speed, never the output).
SAMPLED_TENSORS = 8
SAMPLED_ELEMENTS = 16
# model -> (weak references to its sampled tensors, their signature, the fingerprint)
_FINGERPRINTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_FINGERPRINTS_LOCK = threading.Lock()


def fingerprint(model) -> str:
    """12 hex digits that differ between models with different weights (as far as the sample sees). Cached per
    model object (weakly) while the sampled tensors are alive, at the same storage and unchanged in place (their
    version counters), and the model's first parameter and embeddings are still among them: an optimizer step,
    `load_state_dict`, `.to()` or new embeddings make a new one. A cache hit reads no parameter list."""
    with _FINGERPRINTS_LOCK:
        cached = _FINGERPRINTS.get(model)
    if cached is not None:
        refs, signature, value = cached
        tensors = [r() for r in refs]
        if all(t is not None for t in tensors) and _signature(model, tensors) == signature:
            return value
    tensors = _sampled_tensors(model)
    digest = hashlib.blake2b(digest_size=6)
    for t in tensors:
        digest.update(f"{tuple(t.shape)}:{t.dtype}:{t.device.type};".encode())
        if t.device.type == "meta" or t.numel() == 0:      # offloaded: no values here
            continue
        flat = t.detach()
        flat = (flat if flat.is_contiguous() else flat.contiguous()).view(-1)
        n = flat.numel()
        positions = torch.tensor([min(n - 1, (n * i) // SAMPLED_ELEMENTS + (7919 * i + 13) % max(1, n // SAMPLED_ELEMENTS))
                                  for i in range(SAMPLED_ELEMENTS)], device=flat.device)
        values = flat[positions]
        digest.update(values.to("cpu", torch.float64 if values.is_floating_point() else torch.int64).numpy().tobytes())
    value = digest.hexdigest()
    signature = _signature(model, tensors)
    if signature is not None:
        try:
            with _FINGERPRINTS_LOCK:
                _FINGERPRINTS[model] = ([weakref.ref(t) for t in tensors], signature, value)
        except TypeError:           # not weakly referenceable: computed each time
            pass
    return value


def _anchors(model) -> list:
    """The model's first parameter and its input and output embeddings, which the sample always includes."""
    out = [next(model.parameters(), None)]
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            weight = getattr(getattr(model, getter)(), "weight", None)
        except (AttributeError, NotImplementedError, TypeError):
            weight = None
        out.append(weight if isinstance(weight, torch.Tensor) else None)
    return out


def _sampled_tensors(model) -> list:
    params = list(model.parameters())
    picks = [params[(len(params) - 1) * i // (SAMPLED_TENSORS - 1)] for i in range(SAMPLED_TENSORS)] if params else []
    picks += [t for t in _anchors(model)[1:] if t is not None]
    return list({id(t): t for t in picks}.values())


def _signature(model, tensors) -> tuple | None:
    """What a cached fingerprint holds for: the anchors' identities and each sampled tensor's identity, storage
    and in-place version (None where a tensor has no version counter, as under inference mode: no caching)."""
    try:
        return (tuple(id(a) for a in _anchors(model)),
                tuple((id(t), t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for t in tensors))
    except RuntimeError:
        return None


def restore(policy, path: Path | None) -> bool:
    """Load what an earlier process saved at `path` into `policy`; False (the policy as it was) where there is none
    or it is not a valid state for it."""
    if path is None:
        return False
    try:
        text = _read_state(path)
        if text is None:
            return False
        policy.load_state_dict(json.loads(text))
    except Exception as exc:        # noqa: BLE001 - a cache file never fails a call (JSONDecodeError is a ValueError)
        policy.reset()              # whatever a half-read state left: cold
        _warn_once((str(path), "restore", type(exc).__name__),
                   f"Ignoring the saved default policy {path} ({exc}); this call starts cold. Delete the file, or "
                   "set SPEC_ADAPT_POLICY_DIR=off to keep default policies in memory only.")
        return False
    return True


def _read_state(path: Path) -> str | None:
    """The text of the regular file at `path` (None where there is none). Opened without blocking (a FIFO with no
    writer would block an ordinary open), checked on the open descriptor (no race with a rename), read up to the
    size it reports and no further (a device such as /dev/zero reports 0 and never ends)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError):     # no file (or a file where a folder of the path should be)
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_STATE_BYTES:
            raise ValueError(f"{info.st_size} bytes, more than a saved policy's {MAX_STATE_BYTES}")
        data = f.read(info.st_size)
    return data.decode("utf-8")


def save(policy, path: Path | None) -> None:
    """Write `policy`'s state to `path` atomically (a reader never sees half a file)."""
    if path is None:
        return
    temporary = None
    try:
        text = json.dumps(policy.state_dict())
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            temporary = f.name
            f.write(text)
        os.replace(temporary, path)
        temporary = None
    except (OSError, RuntimeError, ValueError) as exc:
        # RuntimeError: another thread's call changed the policy while it was read; the next call saves it.
        # Once per file and reason: an OSError's text names the temporary file, another one each call.
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        _warn_once((str(path), "save", type(exc).__name__, getattr(exc, "errno", None)),
                   f"Could not save the default policy to {path} ({reason}); set SPEC_ADAPT_POLICY_DIR to a writable "
                   "folder, or to off.")
    finally:
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass


def forget(path: Path | None = None) -> None:
    """Delete one saved default policy, or (path None) every one in the folder."""
    folder = state_dir()
    paths = [path] if path is not None else (sorted(folder.glob("*.json")) if folder and folder.is_dir() else [])
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError as exc:
            _warn_once((str(p), "forget", type(exc).__name__),
                       f"Could not delete the saved default policy {p} ({exc.strerror or exc}).")


_WARNED: set = set()      # (path, what, reason): warned already in this process


def _warn_once(key: tuple, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)
