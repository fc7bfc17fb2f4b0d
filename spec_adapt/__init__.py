"""spec_adapt: adaptive, batched, lossless speculative decoding for Hugging Face Transformers.

    out = model.generate(**inputs, custom_generate=spec_adapt.generate, drafter=draft, assistant_policy=policy)

or, after `spec_adapt.enable(model)`:

    out = model.generate(**inputs, assistant_model=draft, assistant_policy=policy)
"""

from .accept import greedy_accept, rejection_sample
from .api import SpecGenerateOutput, disable, enable, generate
from .drafters import CandidateGeneratorDrafter, ChainDrafter, Drafter, DraftRequest, ModelDrafter, PromptLookupDrafter, Proposal, ScriptedDrafter, SuffixDrafter, SuffixIndex
from .ledger import KVLedger
from .metrics import SpecStats, StepRecord, last_stats
from .fast import Acceptor
from .verifiers import EarlyExitVerifier, FullVerifier, Verifier
from .policies import (Adaptive, BanditSpecUCB, ChainScheduler, ElasticEWMA, FixedLength, GoodputModel, Heuristic, Nightjar, PerRequest,
                       Plan, Policy, StepInfo)
from .pool import ModelPool
from .profiling import LatencyTable

__version__ = "0.1.0"

__all__ = [
    "generate", "enable", "disable", "SpecGenerateOutput", "CandidateGeneratorDrafter", "ChainDrafter", "ChainScheduler",
    "Drafter", "DraftRequest", "Proposal", "ModelDrafter", "ScriptedDrafter", "PromptLookupDrafter", "SuffixDrafter", "SuffixIndex",
    "Policy", "Plan", "StepInfo", "Acceptor", "Verifier", "FullVerifier", "EarlyExitVerifier", "Adaptive", "FixedLength", "Heuristic", "Nightjar", "BanditSpecUCB", "GoodputModel", "ElasticEWMA",
    "PerRequest", "LatencyTable",
    "ModelPool", "SpecStats", "StepRecord", "last_stats", "KVLedger", "greedy_accept", "rejection_sample",
]
