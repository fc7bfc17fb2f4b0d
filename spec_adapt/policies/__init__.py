"""Policies: what each step drafts. `Adaptive` (the default), `FixedLength` and `Heuristic`, `ChainScheduler` (multi-
level chains). The research baselines (Nightjar, BanditSpecUCB, GoodputModel, ElasticEWMA, PerRequest) live in
`spec_adapt.policies.baselines`; the estimators they share in `spec_adapt.policies.estimators`."""

from .adaptive import Adaptive
from .policy import Plan, Policy, StepInfo, check_gammas, check_plan, check_policy
from .baselines import BanditSpecUCB, ElasticEWMA, GoodputModel, Nightjar, PerRequest, goodput
from .chain_scheduler import ChainScheduler
from .estimators import LatencyTable, TreeShapes, bucket
from .fixed import FixedLength, FixedTree, Heuristic

__all__ = ["Adaptive", "FixedLength", "FixedTree", "Heuristic", "ChainScheduler", "Plan", "Policy", "StepInfo",
           "LatencyTable", "TreeShapes", "Nightjar", "BanditSpecUCB", "GoodputModel", "ElasticEWMA", "PerRequest",
           "check_plan", "check_policy", "check_gammas", "bucket", "goodput"]
