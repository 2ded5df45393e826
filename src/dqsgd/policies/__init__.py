"""Bit policies: fixed, DQSGD (convex / non-convex / budgeted / error target), Adaptive, AdaQS."""

from dqsgd.policies.adaptive import AdaptiveRMS, AdaQS
from dqsgd.policies.base import BitPolicy, GradStats, Rounding, grad_stats, integerize, state_from_dict, state_to_dict
from dqsgd.policies.budgeted import BudgetedDQSGD
from dqsgd.policies.rules import DQSGDRule, FixedBits

__all__ = [
    "AdaptiveRMS", "AdaQS", "BitPolicy", "GradStats", "Rounding", "grad_stats", "integerize",
    "state_from_dict", "state_to_dict", "BudgetedDQSGD", "DQSGDRule", "FixedBits",
]
