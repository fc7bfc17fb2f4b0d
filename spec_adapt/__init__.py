"""spec_adapt: adaptive, batched, lossless speculative decoding for Hugging Face Transformers.

    out = model.generate(**inputs, custom_generate=spec_adapt.generate, drafter=draft)

or, after `spec_adapt.enable(model)`:

    out = model.generate(**inputs, assistant_model=draft)

Layout: the speculative core is this package's flat modules (api, loop, ledger, tree, acceptance_rules, acceptor,
verifiers, processors, running_estimates, metrics, execution, distributed, loading, compat, ...) plus `drafters/` and
`policies/`; `serving/` holds the engine; `kernels/` the Triton kernels beside their references; `eval/` and
`recipes/` the quality harness and workloads; `tools/` the CLI and benchmarks (docs/design.md lists every module).
"""

from .acceptor import Acceptor
from .api import SpecGenerateOutput, disable, enable, generate, reset_default_policies
from .drafters import (ChainDrafter, Drafter, ModelDrafter, MTPDrafter, PromptLookupDrafter, ScriptedDrafter,
                       SharedKVDrafter, SuffixDrafter)
from .drafters.offload import DraftOffload
from .drafters.sources import MultiSourceDrafter
from .metrics import SpecStats, last_stats
from .policies import Adaptive, ChainScheduler, FixedLength, FixedTree, Policy
from .execution import prepare, unprepare
from .serving import Engine, MemoryBudget
from .verifiers import EarlyExitVerifier, FullVerifier

__version__ = "0.1.0"

# The names a user starts from (at most 25). Also importable: SpecGenerateOutput (what generate returns with
# return_dict_in_generate), MTPDrafter (a checkpoint's multi-token prediction layers; `use_mtp=True` after `enable`
# makes one), SharedKVDrafter (a Gemma 4 assistant; `assistant_model=` one makes it) and ScriptedDrafter (scripted drafts for tests); `spec_adapt.compat` names the transformers
# internals spec_adapt relies on.
__all__ = [
    # entry points
    "generate", "enable", "disable", "reset_default_policies", "prepare", "unprepare",
    # statistics
    "SpecStats", "last_stats",
    # drafters
    "Drafter", "ModelDrafter", "MultiSourceDrafter", "PromptLookupDrafter", "SuffixDrafter", "ChainDrafter",
    "DraftOffload",
    # policies
    "Policy", "Adaptive", "FixedLength", "FixedTree", "ChainScheduler",
    # verify and accept phases
    "FullVerifier", "EarlyExitVerifier", "Acceptor",
    # serving
    "Engine", "MemoryBudget",
]
