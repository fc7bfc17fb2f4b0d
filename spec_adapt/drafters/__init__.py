from .drafter import (CatchUp, Chains, ChecksTarget, Drafter, DraftRequest, Events, Features, FillsBudget,
                   Forwards, FreeSources, JoinsRows, Observes, Offloads, Proposal, ReadsTarget, TakesInputs, Trees)
from .chain import ChainDrafter
from .cross import CrossTokenizerDrafter
from .hf import CandidateGeneratorDrafter
from .lookup import PromptLookupDrafter
from .model import ModelDrafter
from .mtp import MTPDrafter
from .scripted import ScriptedDrafter
from .shared_kv import SharedKVDrafter
from .sources import MultiSourceDrafter, SourceState
from .suffix import SuffixDrafter, SuffixIndex

__all__ = ["CatchUp", "Chains", "ChecksTarget", "Events", "Features", "FillsBudget", "Forwards", "FreeSources", "JoinsRows", "Observes", "Offloads", "ReadsTarget", "TakesInputs", "Trees", "CandidateGeneratorDrafter", "ChainDrafter", "CrossTokenizerDrafter", "Drafter", "DraftRequest", "Proposal", "ModelDrafter", "MTPDrafter", "MultiSourceDrafter", "ScriptedDrafter", "SharedKVDrafter", "SourceState", "PromptLookupDrafter", "SuffixDrafter", "SuffixIndex"]
