from .base import Drafter, DraftRequest, Proposal
from .lookup import PromptLookupDrafter
from .model import ModelDrafter
from .scripted import ScriptedDrafter
from .suffix import SuffixDrafter, SuffixIndex

__all__ = ["Drafter", "DraftRequest", "Proposal", "ModelDrafter", "ScriptedDrafter", "PromptLookupDrafter", "SuffixDrafter", "SuffixIndex"]
