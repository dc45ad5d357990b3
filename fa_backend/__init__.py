"""fa_backend: fused FlashAttention kernels for PyTorch, and routing of unchanged SDPA calls to them.

Importing the package registers the custom ops under torch.ops.fa_backend and changes nothing else:
routing starts with `fa_backend.enable()` or inside `with fa_backend.enabled():`.
"""

from . import ops  # noqa: F401  (registers torch.ops.fa_backend.*)
from .api import attention
from .dispatch import (BackendUnsupportedError, Explanation, Reason, ReasonCode, explain, reset_stats,
                       sdpa_backends, stats)
from .integrations.sdpa import disable, enable, enabled

__version__ = "0.1.0"

__all__ = ["attention", "BackendUnsupportedError", "disable", "enable", "enabled", "Explanation", "explain",
           "Reason", "ReasonCode", "reset_stats", "sdpa_backends", "stats", "__version__"]
