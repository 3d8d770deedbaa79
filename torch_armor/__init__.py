"""torch_armor: ARMOR 2:4 semi-structured pruning for PyTorch models."""

from .config import ArmorConfig, SparsityPattern, parse_pattern
from .factorize import factorize
from .factors import ArmorFactors
from .proxy import nowag_prune, proxy_loss, relative_proxy_loss

__all__ = [
    "ArmorConfig",
    "ArmorFactors",
    "SparsityPattern",
    "factorize",
    "nowag_prune",
    "parse_pattern",
    "proxy_loss",
    "relative_proxy_loss",
]
__version__ = "0.1.0"
