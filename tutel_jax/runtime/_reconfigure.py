"""Runtime reconfiguration: switch an MoE layer's layout and routing switches between two training steps.

Tutel lets a running job change its parallelism, capacity and top-k without a restart. Here that is three steps,
all outside any compiled function:

1. describe the new way of running in a frozen, hashable :class:`RuntimeConfig` (mesh shape and axes, top_k,
   capacity_factor, adaptive_r, a2a_ffn_overlap_degree, use_2dh, dropless_impl);
2. :func:`plan_layout` validates it against the layer (E experts, hidden size, gates) and returns a
   :class:`Layout`: the device mesh, the :class:`~tutel_jax.parallel.ExpertParallel` placement and the layer's
   `MoEConfig` for that expert-axis size (count_per_node = E / W, or -W / E for sharded experts);
3. :func:`reshard` moves parameters and optimizer state with ``jax.device_put`` to the shardings of the new
   layout (:func:`params_shardings`, :func:`opt_state_shardings`). Arrays keep their global shapes (expert
   tensors stay [E, ...]); only their placement changes, bit for bit.

A compiled step is then chosen for the new layout (`tutel_jax.training._trainer.MoETrainer` caches one per
configuration); the NNX module has `MoE.reconfigure`.

Which switches change the math (Tutel semantics, every device routing its own tokens):
  * layout-only, for a fixed set of token shards (same device count, data axes outside the expert axes, so
    token shard i stays on device i): the mesh shape / expert-axis size, adaptive_r, use_2dh and the overlap
    degree d. Caveats: the capacity is rounded up to a multiple of s * d (s = devices per expert), so d and s
    are layout-only when C already is such a multiple; with capacity_factor <= 0 the capacity is the maximum
    over the expert group, so a different expert-axis size can change C (no effect on the result for cf = 0,
    which drops nothing; cf < 0 may drop other tokens). Changing the number of devices changes which tokens are
    routed together, and so the result.
  * semantic: top_k and capacity_factor.
  * dropless_impl only chooses how a dropless plan runs where the experts run locally (one device, r = 0); every
    path gives the same result up to float rounding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..layer import MoEConfig, valid_adaptive_degrees
from ..experts import impl_names, resolve_impl
from ..native import NativeKernelError
from ..parallel import ExpertParallel, param_shardings
from ..validation import check_capacity_factor, check_choice, check_int

__all__ = ["RuntimeConfig", "Layout", "plan_layout", "is_moe_layer", "params_shardings", "opt_state_shardings",
           "batch_shardings", "reshard", "with_gate_defaults", "reconfigure_layer"]


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """How an MoE layer runs between two reconfigurations. Frozen and hashable (a compile-cache key).

    Attributes:
      mesh_shape: ordered ((axis name, size), ...) of the device mesh, outermost first; the mesh takes the first
        prod(sizes) devices in order. Tokens are split over all axes in this order, so with the data axis
        outermost and the expert axes innermost, token shard i lives on device i for every shape.
      expert_axes: the mesh axes of the all_to_all group (consecutive, in mesh order); W = product of their
        sizes. W must divide E (E / W experts per device) or be a multiple of it (W / E devices share one
        expert, Tutel's count_per_node = -s).
      top_k: k of the gate(s); None keeps each gate's default. 1 <= k <= E.
      capacity_factor: Tutel's cf (> 0 fixed, 0 dropless, < 0 bounded dropless); None keeps the gate's default.
      adaptive_r: Tutel's r for sharded experts, in {0} u divisors(s); None keeps the layer's parallel_type.
        r = 0 (data parallel: experts gathered, no all_to_all) is valid for any layout.
      a2a_ffn_overlap_degree: d, chunks of the capacity axis overlapping all_to_all and expert compute.
      use_2dh: hierarchical all_to_all; needs exactly two expert axes (node, local) and s = 1.
      dropless_impl: the layer's `MoEConfig.dropless_impl` (one of `dropless.impl_names()`), how a dropless
        plan runs where the experts run locally (r = 0); None keeps the layer's own.
    """

    mesh_shape: tuple[tuple[str, int], ...]
    expert_axes: tuple[str, ...] = ("expert",)
    top_k: int | None = None
    capacity_factor: float | None = None
    adaptive_r: int | None = None
    a2a_ffn_overlap_degree: int = 1
    use_2dh: bool = False
    dropless_impl: str | None = None

    def __post_init__(self):
        shape = self.mesh_shape.items() if isinstance(self.mesh_shape, Mapping) else self.mesh_shape
        try:
            shape = tuple((str(name), size) for name, size in shape)
        except (TypeError, ValueError):
            raise ValueError(f"mesh_shape must be ((axis name, size), ...), got {self.mesh_shape!r}") from None
        if not shape:
            raise ValueError("mesh_shape must name at least one axis")
        names = [name for name, _ in shape]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh axis names must be unique, got {names}")
        for name, size in shape:
            check_int(size, f"the size of mesh axis {name!r}", minimum=1)
        shape = tuple((name, int(size)) for name, size in shape)
        expert_axes = (self.expert_axes,) if isinstance(self.expert_axes, str) else tuple(self.expert_axes)
        if not expert_axes:
            raise ValueError("expert_axes must name at least one mesh axis")
        missing = [a for a in expert_axes if a not in names]
        if missing:
            raise ValueError(f"expert axes {missing} are not mesh axes {names}")
        first = names.index(expert_axes[0])
        if tuple(names[first:first + len(expert_axes)]) != expert_axes:
            raise ValueError(f"expert axes {expert_axes} must be consecutive mesh axes in mesh order {names}")
        check_int(self.top_k, "top_k", minimum=1, optional=True)
        cf = self.capacity_factor
        if cf is not None:  # None keeps the gate's default
            cf = check_capacity_factor(cf)
        check_int(self.adaptive_r, "adaptive_r", minimum=0, optional=True)
        degree = self.a2a_ffn_overlap_degree
        check_int(degree, "a2a_ffn_overlap_degree", minimum=1)
        if not isinstance(self.use_2dh, (bool, np.bool_)):
            raise ValueError(f"use_2dh must be a bool, got {self.use_2dh!r}")
        if self.use_2dh and len(expert_axes) != 2:
            raise ValueError(f"use_2dh needs two expert axes (node, local), got {expert_axes}")
        check_choice(self.dropless_impl, "dropless_impl", impl_names(), optional=True)
        object.__setattr__(self, "mesh_shape", shape)
        object.__setattr__(self, "expert_axes", expert_axes)
        object.__setattr__(self, "top_k", None if self.top_k is None else int(self.top_k))
        object.__setattr__(self, "capacity_factor", cf)
        object.__setattr__(self, "adaptive_r", None if self.adaptive_r is None else int(self.adaptive_r))
        object.__setattr__(self, "a2a_ffn_overlap_degree", int(degree))
        object.__setattr__(self, "use_2dh", bool(self.use_2dh))

    # -- constructors ----------------------------------------------------------------------------------------
    @classmethod
    def ep(cls, expert: int, data: int = 1, **switches: Any) -> "RuntimeConfig":
        """Mesh ('data', 'expert') = (data, expert): EP over `expert` devices, times `data` replicas."""
        return cls(mesh_shape=(("data", data), ("expert", expert)), expert_axes=("expert",), **switches)

    @classmethod
    def ep_2dh(cls, nodes: int, local: int, data: int = 1, **switches: Any) -> "RuntimeConfig":
        """Mesh ('data', 'node', 'local'); the expert group is (node, local) with the 2DH all_to_all on."""
        switches.setdefault("use_2dh", True)
        return cls(mesh_shape=(("data", data), ("node", nodes), ("local", local)), expert_axes=("node", "local"),
                   **switches)

    def replace(self, **changes: Any) -> "RuntimeConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    # -- derived sizes ---------------------------------------------------------------------------------------
    @property
    def num_devices(self) -> int:
        """Devices of the mesh (= token shards)."""
        return math.prod(size for _, size in self.mesh_shape)

    @property
    def expert_world_size(self) -> int:
        """W: devices in the all_to_all group."""
        sizes = dict(self.mesh_shape)
        return math.prod(sizes[a] for a in self.expert_axes)

    def describe(self) -> str:
        """A one-line summary, e.g. 'data=2 x expert=4 (EP 4) r=1 d=1 2dh=off top_k=2 cf=1' (and ' dropless=<impl>'
        when dropless_impl is set)."""
        mesh = " x ".join(f"{n}={s}" for n, s in self.mesh_shape)
        opt = lambda v: "default" if v is None else f"{v:g}"  # noqa: E731
        return (f"{mesh} (EP {self.expert_world_size}) r={'default' if self.adaptive_r is None else self.adaptive_r} "
                f"d={self.a2a_ffn_overlap_degree} 2dh={'on' if self.use_2dh else 'off'} "
                f"top_k={opt(self.top_k)} cf={opt(self.capacity_factor)}"
                + ("" if self.dropless_impl is None else f" dropless={self.dropless_impl}"))


@dataclasses.dataclass(frozen=True)
class Layout:
    """A validated RuntimeConfig bound to devices and to the layer. Hashable.

    Attributes:
      runtime: the RuntimeConfig with adaptive_r resolved (never None).
      config: the layer's MoEConfig for this expert-axis size (count_per_node, a2a_ffn_overlap_degree, use_2dh,
        parallel_type and, when set, dropless_impl from the runtime config; gates unchanged).
      placement: mesh and axes for `moe_apply_parallel`; token axes = all mesh axes, in mesh order.
    """

    runtime: RuntimeConfig
    config: MoEConfig
    placement: ExpertParallel

    @property
    def mesh(self) -> Mesh:
        return self.placement.mesh

    def replicated(self) -> NamedSharding:
        """Sharding of a replicated array (gates, dense layers, scalars) on this mesh."""
        return NamedSharding(self.mesh, P())

    def token_sharding(self) -> NamedSharding:
        """Sharding of a batch array [B, ...]: B split over the token shards (all mesh axes)."""
        return NamedSharding(self.mesh, P(self.placement.token_axes))

    def moe_kwargs(self) -> dict[str, Any]:
        """The per-call switches of `moe_apply_parallel` for this runtime config."""
        rt = self.runtime
        return dict(top_k=rt.top_k, capacity_factor=rt.capacity_factor, adaptive_r=rt.adaptive_r,
                    a2a_ffn_overlap_degree=rt.a2a_ffn_overlap_degree, use_2dh=rt.use_2dh)


def _refuse(runtime: RuntimeConfig, why: str) -> ValueError:
    return ValueError(f"cannot switch to [{runtime.describe()}]: {why}")


def plan_layout(config: MoEConfig, runtime: RuntimeConfig, devices: Sequence[Any] | None = None) -> Layout:
    """Validates `runtime` against the layer and binds it to devices; nothing is moved or compiled.

    Args:
      config: the layer's MoEConfig, for any expert-axis size (only E, the experts, gates, parallel_type and the
        flags are read; count_per_node is recomputed).
      runtime: the requested configuration.
      devices: the devices to build the mesh from, in order (default `jax.devices()`); the mesh takes the first
        `runtime.num_devices`.

    Returns:
      The Layout.

    Raises:
      ValueError: with the reason, for a mesh larger than the devices, an expert-axis size W that neither
        divides E nor is a multiple of it, a hidden size not divisible by the devices per expert, an adaptive_r
        not in {0} u divisors(s), top_k > E, 2DH with sharded experts, or a dropless_impl the experts cannot
        run (what the path requires, e.g. 'gather' needs experts with gathered(); 'native' a CPU backend, SwiGLU
        experts and a kernel that builds).
    """
    if not isinstance(runtime, RuntimeConfig):
        raise ValueError(f"expected a RuntimeConfig, got {type(runtime).__name__}")
    devices = list(jax.devices() if devices is None else devices)
    if runtime.num_devices > len(devices):
        raise _refuse(runtime, f"the mesh needs {runtime.num_devices} devices, only {len(devices)} are available")
    E, W = config.num_global_experts, runtime.expert_world_size
    if E % W == 0:
        count_per_node = E // W
    elif W % E == 0:
        count_per_node = -(W // E)
        hidden = config.experts.hidden_size_per_expert
        if not config.experts.supports("hidden_axes"):
            raise _refuse(runtime, f"{W} expert devices share each of the {E} experts, which needs an expert type "
                                   f"with hidden_axes(); {config.experts.type_name} has none")
        if hidden is not None and hidden % (W // E):
            raise _refuse(runtime, f"the hidden size per expert {hidden} is not divisible by the {W // E} devices "
                                   "sharing each expert")
        if runtime.use_2dh:
            raise _refuse(runtime, "use_2dh is not available when several devices share an expert (W > E)")
    else:
        raise _refuse(runtime, f"the expert-axis size {W} must divide the number of experts E={E} or be a "
                               "multiple of it")
    if runtime.top_k is not None and runtime.top_k > E:
        raise _refuse(runtime, f"top_k={runtime.top_k} exceeds the number of experts E={E}")
    dropless_impl = config.dropless_impl if runtime.dropless_impl is None else runtime.dropless_impl
    if runtime.dropless_impl not in (None, "auto"):  # the layer's own impl was checked by make_config
        try:
            resolve_impl(dropless_impl, config.experts)
        except (ValueError, NativeKernelError) as exc:
            raise _refuse(runtime, str(exc)) from None
    s = -count_per_node if count_per_node < 0 else 1
    parallel_type = config.parallel_type if runtime.adaptive_r is None else f"adaptive:{runtime.adaptive_r}"
    if parallel_type == "model":
        parallel_type = f"adaptive:{s}"
    layer_config = dataclasses.replace(
        config, num_local_experts=count_per_node, a2a_ffn_overlap_degree=runtime.a2a_ffn_overlap_degree,
        use_2dh=runtime.use_2dh, parallel_type=parallel_type, dropless_impl=dropless_impl)
    try:
        r = layer_config.adaptive_degree()
    except ValueError:
        raise _refuse(runtime, f"adaptive_r must be one of {valid_adaptive_degrees(s)} (0 or a divisor of the "
                               f"{s} devices per expert), got {parallel_type.split(':')[-1]}") from None
    names = tuple(name for name, _ in runtime.mesh_shape)
    sizes = tuple(size for _, size in runtime.mesh_shape)
    mesh = Mesh(np.array(devices[:runtime.num_devices], dtype=object).reshape(sizes), names)
    placement = ExpertParallel(mesh, expert_axes=runtime.expert_axes, token_axes=names)
    return Layout(runtime=runtime.replace(adaptive_r=r), config=layer_config, placement=placement)


def with_gate_defaults(config: MoEConfig, top_k: int | None, capacity_factor: float | None) -> MoEConfig:
    """`config` with every gate's default k / capacity_factor replaced (None keeps them); for the NNX module,
    whose calls use the gate defaults. Gates must be dataclasses with `k` and `capacity_factor` fields."""
    if top_k is None and capacity_factor is None:
        return config
    changes = {k: v for k, v in (("k", top_k), ("capacity_factor", capacity_factor)) if v is not None}
    gates = []
    for gate in config.gates:
        fields = {f.name for f in dataclasses.fields(gate)} if dataclasses.is_dataclass(gate) else set()
        if not set(changes) <= fields:
            raise ValueError(f"gate {type(gate).__name__} is not a dataclass with fields {sorted(changes)}; pass "
                             "top_k / capacity_factor per call instead")
        gates.append(dataclasses.replace(gate, **changes))
    return dataclasses.replace(config, gates=tuple(gates))


# -- shardings ---------------------------------------------------------------------------------------------------
def is_moe_layer(node: Any) -> bool:
    """Whether a pytree node is one MoE layer's parameters (`init_params`' dict): a mapping with the keys 'gates' and
    'experts' (and possibly 'shared_experts')."""
    return isinstance(node, Mapping) and "gates" in node and "experts" in node


def params_shardings(params: Any, layout: Layout) -> Any:
    """Shardings for a model's parameter pytree on `layout`.

    Every MoE layer's parameters (a dict with the keys 'gates' and 'experts', anywhere in the tree) get
    the expert-parallel shardings of `parallel.param_shardings` (experts split on their leading E axis, for
    sharded experts also on the hidden axis; gates replicated); every other leaf is replicated."""
    def leaf(node):
        if is_moe_layer(node):
            return param_shardings(node, layout.placement, layout.config)
        return layout.replicated()
    return jax.tree.map(leaf, params, is_leaf=is_moe_layer)


def opt_state_shardings(optimizer: Any, opt_state: Any, param_shardings_tree: Any, layout: Layout) -> Any:
    """Shardings for an optax state: every copy of the parameter tree inside it (adam's mu / nu, momentum, ...)
    gets the parameters' shardings, every other leaf (counters, scalars) is replicated.

    Uses `optax.tree_utils.tree_map_params`, so `optimizer` must be the optax GradientTransformation (or its
    init function) that made `opt_state`."""
    replicated = layout.replicated()
    return optax.tree_utils.tree_map_params(
        optimizer, lambda _, sharding: sharding, opt_state, param_shardings_tree,
        transform_non_params=lambda leaf: jax.tree.map(lambda _: replicated, leaf))


def batch_shardings(batch: Any, layout: Layout) -> Any:
    """Shardings for a batch pytree: arrays with a leading axis are split over the token shards, scalars replicated."""
    def leaf(x):
        ndim = len(x.shape) if hasattr(x, "shape") else np.ndim(x)
        return layout.token_sharding() if ndim >= 1 else layout.replicated()
    return jax.tree.map(leaf, batch)


def reshard(tree: Any, shardings: Any, *, donate: bool = False) -> Any:
    """`jax.device_put(tree, shardings)`, waited for: a bitwise copy onto the new placement.

    With `donate`, the source buffers may be reused / freed (peak memory stays near one copy); the old arrays
    must not be used afterwards."""
    return jax.block_until_ready(jax.device_put(tree, shardings, donate=donate))


# -- the NNX module ------------------------------------------------------------------------------------------------
def _moves(old_tree: Any, new_shardings: Any) -> dict[tuple, Any]:
    """{(old sharding, shape): new sharding} for every leaf; refuses a key that would go two ways."""
    moves: dict[tuple, Any] = {}
    for old, new in zip(jax.tree.leaves(old_tree), jax.tree.leaves(new_shardings)):
        key = (old.sharding, tuple(old.shape))
        if moves.setdefault(key, new) != new:
            raise ValueError(f"two parameters of shape {tuple(old.shape)} with the same sharding would move to "
                             "different shardings; reshard the optimizer state with opt_state_shardings instead")
    return moves


def reconfigure_layer(layer: Any, runtime: RuntimeConfig, *, optimizer: Any = None,
                      devices: Sequence[Any] | None = None) -> Layout:
    """Switches an NNX `MoE` layer (and optionally its `nnx.Optimizer`) to `runtime`; see `MoE.reconfigure`.

    Validates first (ValueError, nothing changed), then moves the layer's parameters to the new layout's
    shardings, its other arrays (routing statistics) to the new mesh, and, when `optimizer` is given, every
    optimizer array that sits like one of the layer's parameters (same sharding and shape: adam's mu / nu,
    momentum) to that parameter's new sharding and every fully replicated array of the old mesh to the new mesh.
    Sets the layer's `config` (count_per_node, overlap degree, use_2dh, parallel_type, gate defaults top_k /
    capacity_factor) and `placement`. Returns the new Layout.
    """
    layout = plan_layout(layer.config, runtime, devices)
    config = with_gate_defaults(layout.config, runtime.top_k, runtime.capacity_factor)
    old_params = layer.param_tree()
    moves = _moves(old_params, param_shardings(old_params, layout.placement, layout.config))
    old_devices = set(layer.placement.mesh.devices.flat) if layer.placement is not None else None

    def move(x):
        if not isinstance(x, jax.Array):
            return x
        target = moves.get((x.sharding, tuple(x.shape)))
        if target is None and old_devices is not None and isinstance(x.sharding, NamedSharding) \
                and x.sharding.is_fully_replicated and set(x.sharding.mesh.devices.flat) == old_devices:
            target = layout.replicated()
        return x if target is None else jax.device_put(x, target)

    new_layer_state = jax.block_until_ready(jax.tree.map(move, nnx.state(layer)))
    new_opt_state = None if optimizer is None else jax.block_until_ready(jax.tree.map(move, nnx.state(optimizer)))
    nnx.update(layer, new_layer_state)
    if new_opt_state is not None:
        nnx.update(optimizer, new_opt_state)
    layer.config = config
    layer.placement = layout.placement
    return layout
