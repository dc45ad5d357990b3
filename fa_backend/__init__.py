"""fa_backend: fused FlashAttention kernels for PyTorch, and routing of unchanged SDPA calls to them.

Importing the package registers the custom ops under torch.ops.fa_backend and lists "fa_backend" in
torch.nn.attention's flash-attention provider registry (where torch has one); it activates nothing.
Routing starts with `fa_backend.enable()` or inside `with fa_backend.enabled():`; the provider path with
`fa_backend.integrations.provider.activate()` or `torch.nn.attention.activate_flash_attention_impl("fa_backend")`.
"""

from . import ops  # noqa: F401  (registers torch.ops.fa_backend.*)
from .api import attention
from .flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                   flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                   flash_attn_varlen_qkvpacked_func)
from .dispatch.backends.cute import bind_ops as _bind_cute_ops
from .dispatch.backends.triton import bind_ops as _bind_triton_ops
from .dispatch import (BackendUnsupportedError, Explanation, Reason, ReasonCode, explain, reset_stats,
                       sdpa_backends, stats)
from .integrations import provider as _provider
from .integrations.sdpa import disable, enable, enabled
from .kvcache import flash_attn_with_kvcache  # noqa: F401  (FlashAttention-2 KV-cache API)

_provider.register()  # lists "fa_backend" in torch.nn.attention's registry; activates nothing
_bind_cute_ops()  # the backends' ops, now that both are imported (never inside a torch.compile trace)
_bind_triton_ops()

__version__ = "0.1.0"

__all__ = ["attention", "BackendUnsupportedError", "disable", "enable", "enabled", "Explanation", "explain",
           "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
           "Reason", "ReasonCode", "reset_stats", "sdpa_backends", "stats", "__version__"]
