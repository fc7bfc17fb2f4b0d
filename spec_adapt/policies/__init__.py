from .adaptive import BanditSpecUCB, ElasticEWMA, GoodputModel, Nightjar, PerRequest, bucket, goodput
from .base import Policy, StepInfo, check_gammas
from .chain import ChainScheduler
from .fixed import FixedLength, Heuristic

__all__ = ["ChainScheduler", "Policy", "StepInfo", "check_gammas", "FixedLength", "Heuristic", "Nightjar", "BanditSpecUCB",
           "GoodputModel", "ElasticEWMA", "PerRequest", "bucket", "goodput"]
