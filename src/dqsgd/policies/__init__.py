"""Bit policies: fixed, DQSGD (convex / non-convex / budgeted / coded budget / error target), Adaptive, AdaQS;
a budgeted policy choosing both legs of the sharded step (split); widths from the link's time model (link)."""

from typing import TYPE_CHECKING

from dqsgd.core.lazy import attach

if TYPE_CHECKING:
    from dqsgd.policies.adaptive import AdaptiveRMS, AdaQS
    from dqsgd.policies.base import (BitPolicy, GradStats, PolicyState, Rounding, Spent, grad_stats, integerize,
                                     split_spent, state_from_dict, state_to_dict)
    from dqsgd.policies.budgeted import BudgetedDQSGD
    from dqsgd.policies.coded import CodedBudgetedDQSGD, level_entropies
    from dqsgd.policies.link import LinkPolicy, LinkState
    from dqsgd.policies.rules import DQSGDRule, FixedBits
    from dqsgd.policies.split import SplitBudget, SplitState

__getattr__, __dir__, __all__ = attach(__name__, __file__)
