"""The default policy's memory across processes: what the process's default `Adaptive` for a target and drafter has
learned is written after each of its calls, and a later process starts its first call from it instead of cold.

One JSON file per target, drafter, dtype and device (the latency profile's key, `profile_key`, plus the drafter's
kind and the width bound), in `$SPEC_ADAPT_POLICY_DIR`, else `<spec_adapt cache>/policies`. `SPEC_ADAPT_POLICY_DIR=off`
keeps defaults in memory only. A file that cannot be read or is not a valid state is ignored with a warning (the call
starts cold); a cache that cannot be written is skipped with a warning: neither ever fails a call.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from pathlib import Path

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
    name = f"{profile_key(model, draft)}__{kind}__w{max_width or 'any'}"
    return folder / (re.sub(r"[^A-Za-z0-9._-]+", "_", name) + ".json")


def restore(policy, path: Path | None) -> bool:
    """Load what an earlier process saved at `path` into `policy`; False (the policy as it was) where there is none
    or it is not a valid state for it."""
    if path is None or not path.exists():
        return False
    try:
        size = path.stat().st_size
        if size > MAX_STATE_BYTES:
            raise ValueError(f"{size} bytes, more than a saved policy's {MAX_STATE_BYTES}")
        policy.load_state_dict(json.loads(path.read_text()))
    except Exception as exc:        # noqa: BLE001 - a cache file never fails a call (JSONDecodeError is a ValueError)
        policy.reset()              # whatever a half-read state left: cold
        warnings.warn(f"Ignoring the saved default policy {path} ({exc}); this call starts cold. Delete the file, or "
                      "set SPEC_ADAPT_POLICY_DIR=off to keep default policies in memory only.", stacklevel=3)
        return False
    return True


def save(policy, path: Path | None) -> None:
    """Write `policy`'s state to `path` atomically (a reader never sees half a file)."""
    if path is None:
        return
    try:
        text = json.dumps(policy.state_dict())
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            f.write(text)
        os.replace(f.name, path)
    except (OSError, RuntimeError, ValueError) as exc:
        # RuntimeError: another thread's call changed the policy while it was read; the next call saves it.
        _warn_once(f"Could not save the default policy to {path} ({exc}); set SPEC_ADAPT_POLICY_DIR to a writable "
                   "folder, or to off.")


def forget(path: Path | None = None) -> None:
    """Delete one saved default policy, or (path None) every one in the folder."""
    folder = state_dir()
    paths = [path] if path is not None else (sorted(folder.glob("*.json")) if folder and folder.is_dir() else [])
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError as exc:
            _warn_once(f"Could not delete the saved default policy {p} ({exc}).")


_WARNED: set = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)
