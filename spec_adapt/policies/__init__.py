from .base import Policy, StepInfo, check_gammas
from .fixed import FixedLength, Heuristic

__all__ = ["Policy", "StepInfo", "check_gammas", "FixedLength", "Heuristic"]
