"""Training for the drafters (EAGLE head, DFlash, DSpark): dense, differentiable forwards over whole sequences.

The inference paths run over a paged cache under ``no_grad``-style frozen
weights; training instead runs each block against dense attention built from
the network's own projections, so the trained weights are exactly those used
at inference.
"""

from backends.training.data import TargetFeatures, TrainSchedule, generate_sequences, target_features
from backends.training.dflash import block_hidden, decay_weights, train_dflash
from backends.training.dspark import train_dspark
from backends.training.eagle import train_eagle, unrolled_hidden

__all__ = [
    "TargetFeatures",
    "TrainSchedule",
    "block_hidden",
    "decay_weights",
    "generate_sequences",
    "target_features",
    "train_dflash",
    "train_dspark",
    "train_eagle",
    "unrolled_hidden",
]
