from .adaptive import BanditSpecUCB, ElasticEWMA, GoodputModel, Nightjar, PerRequest, bucket, goodput
from .base import Plan, Policy, StepInfo, check_gammas, check_plan, check_policy
from .chain import ChainScheduler
from .default import Adaptive
from .fixed import FixedLength, Heuristic

__all__ = ["Adaptive", "ChainScheduler", "Plan", "Policy", "check_plan", "check_policy", "StepInfo", "check_gammas", "FixedLength", "Heuristic", "Nightjar", "BanditSpecUCB",
           "GoodputModel", "ElasticEWMA", "PerRequest", "bucket", "goodput"]
