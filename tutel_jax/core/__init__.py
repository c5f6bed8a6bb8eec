"""What every MoE layer builds on: the platform a program is compiled for and the kernel resolver (`backends`),
shard_map varying-axis types (`vma`), per-call switches (`call_options`), the per-device routing context
(`token_group`), the auxiliary losses (`losses`) and the host: 64-byte aligned arrays (large ones on huge pages),
usable CPUs (`host_memory`); the user's cache directory and the persistent cache of compiled programs
(`compile_cache`)."""

from ._backends import KERNEL_BACKENDS, PLATFORMS, check_kernel_backend, kernels, platform, use_kernels
from ._call_options import DROPLESS_EXCHANGES, CallOptions
from ._compile_cache import (COMPILE_CACHE_ENV, COMPILE_CACHE_MAX_BYTES, cpu_fingerprint, enable_compile_cache,
                             machine_key, user_cache_dir)
from ._losses import (gshard_loss, load_importance_loss, router_z_loss, sequence_aux_loss, switch_load_loss,
                      update_correction_bias)
from ._token_group import LOCAL, TokenGroup
from ._host_memory import collapse_to_huge_pages, empty_aligned, usable_cpus
from ._vma import summed_like, varying, varying_like

__all__ = ["collapse_to_huge_pages", "empty_aligned", "router_z_loss", "sequence_aux_loss", "summed_like", "switch_load_loss",
           "update_correction_bias", "usable_cpus", "varying", "varying_like", "KERNEL_BACKENDS", "PLATFORMS",
           "check_kernel_backend", "kernels", "platform", "use_kernels", "CallOptions", "DROPLESS_EXCHANGES",
           "TokenGroup", "LOCAL", "gshard_loss", "load_importance_loss", "COMPILE_CACHE_ENV", "COMPILE_CACHE_MAX_BYTES",
           "cpu_fingerprint", "enable_compile_cache", "machine_key", "user_cache_dir"]
