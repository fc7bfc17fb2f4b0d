from .base import Drafter, DraftRequest, Proposal
from .model import ModelDrafter
from .scripted import ScriptedDrafter

__all__ = ["Drafter", "DraftRequest", "Proposal", "ModelDrafter", "ScriptedDrafter"]
