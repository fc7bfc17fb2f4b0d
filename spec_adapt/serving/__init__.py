"""Serving: requests join a running batch (`Engine`), under a memory budget (`MemoryBudget`), with a pool of drafts
(`ModelPool`). The engine is where policies learn under live load; for serving many users at scale, see
docs/serving.md."""

from .engine import Engine, Handle, RequestError
from .memory import MemoryBudget
from .pool import ModelPool

__all__ = ["Engine", "Handle", "RequestError", "MemoryBudget", "ModelPool"]
