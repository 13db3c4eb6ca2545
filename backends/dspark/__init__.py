"""DSpark (DeepSeek DeepSpec): a DFlash backbone plus a Markov head and a confidence head."""

from backends.dspark.capacity import StepCost, budget_capacity, prefix_mask, threshold_capacity
from backends.dspark.heads import DSparkHeads
from backends.dspark.speculator import DSparkSpeculator

__all__ = ["DSparkHeads", "DSparkSpeculator", "StepCost", "budget_capacity", "prefix_mask", "threshold_capacity"]
