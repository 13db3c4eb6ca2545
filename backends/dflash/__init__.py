"""DFlash: a block diffusion drafter (z-lab, arXiv 2602.06036) that drafts K tokens in one forward."""

from backends.dflash.network import MASK_TOKEN_ID, DFlashNetwork
from backends.dflash.speculator import DFlashSpeculator

__all__ = ["MASK_TOKEN_ID", "DFlashNetwork", "DFlashSpeculator"]
