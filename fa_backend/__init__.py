"""fa_backend: fused FlashAttention kernels for PyTorch.

Importing the package registers the custom ops under torch.ops.fa_backend and changes nothing else.
"""

from . import ops  # noqa: F401  (registers torch.ops.fa_backend.*)
from .api import attention
from .dispatch.reasons import BackendUnsupportedError, Reason, ReasonCode

__version__ = "0.1.0"

__all__ = ["attention", "BackendUnsupportedError", "Reason", "ReasonCode", "__version__"]
