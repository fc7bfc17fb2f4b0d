from .base import Drafter, DraftRequest, Proposal
from .lookup import PromptLookupDrafter
from .model import ModelDrafter
from .scripted import ScriptedDrafter

__all__ = ["Drafter", "DraftRequest", "Proposal", "ModelDrafter", "ScriptedDrafter", "PromptLookupDrafter"]
