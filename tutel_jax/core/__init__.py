"""What every MoE layer builds on: the platform a program is compiled for and the kernel resolver (`backends`),
shard_map varying-axis types (`vma`), per-call switches (`call_options`), the per-device routing context
(`token_group`), the auxiliary losses (`losses`) and the host: 64-byte aligned arrays, usable CPUs (`host_memory`)."""

from .backends import KERNEL_BACKENDS, PLATFORMS, check_kernel_backend, kernels, platform, use_kernels
from .call_options import DROPLESS_EXCHANGES, CallOptions
from .losses import gshard_loss, load_importance_loss
from .token_group import LOCAL, TokenGroup

__all__ = ["KERNEL_BACKENDS", "PLATFORMS", "check_kernel_backend", "kernels", "platform", "use_kernels",
           "CallOptions", "DROPLESS_EXCHANGES", "TokenGroup", "LOCAL", "gshard_loss", "load_importance_loss"]
