"""The logical-axis rule table -> PartitionSpec / NamedSharding, and activation constraints.

Layers name logical axes (`('batch', 'length', 'heads', 'head_dim')`); only the config's
`sharding_rules` decide which mesh axes those live on. Resolution is flax's (first matching rule whose
mesh axes are still free wins); we add one check flax lacks: a logical name with no rule is an error,
not a silent replication.
"""

import contextlib

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxlm.errors import ConfigError

Axes = tuple[str | None, ...]


def rules(cfg) -> tuple:
    return tuple((name, tuple(t) if isinstance(t, (list, tuple)) else t) for name, t in cfg.sharding_rules)


def spec(axes: Axes, rule_table) -> P:
    known = {name for name, _ in rule_table}
    for a in axes:
        if a is not None and a not in known:
            raise ConfigError(f"logical axis `{a}` has no entry in sharding_rules; add e.g. [{a}, null]")
    return nn.logical_to_mesh_axes(axes, rule_table)


def named(mesh: Mesh, axes: Axes, rule_table) -> NamedSharding:
    return NamedSharding(mesh, spec(axes, rule_table))


@contextlib.contextmanager
def use(mesh: Mesh, rule_table):
    """Trace and run inside this: it makes `constrain` effective and gives jit its mesh. On a GPU mesh it
    also makes the mesh's first device (this process's, where it has one) jax's default: tokamax's kernels
    (layers.gmm) pick their architecture and tiles from the default device while tracing, which in a
    compile without a GPU is the CPU."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rule_table), _kernel_device(mesh):
        yield


def _kernel_device(mesh: Mesh):
    if mesh.devices.flat[0].platform not in ("gpu", "cuda"):
        return contextlib.nullcontext()
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return jax.default_device((mine or list(mesh.devices.flat))[0])


def current_rules() -> tuple:
    """The rule table of the enclosing `use(...)` (empty outside one). A jitted function whose tracing
    reads it (through `constrain`) takes it as a static argument, so that other rules retrace."""
    return tuple(nn.get_logical_axis_rules())


def active_spec(axes: Axes) -> P:
    """`spec` under the rules of the enclosing `use(...)`."""
    return spec(axes, current_rules())


def platform() -> str:
    """The platform this trace compiles for: the mesh's (a TPU topology when compiling ahead of time),
    else the default backend's: cpu, gpu or tpu."""
    mesh = jax.sharding.get_abstract_mesh()
    where = jax.default_backend() if mesh.empty else mesh.abstract_device.platform
    return "gpu" if where in ("cuda", "rocm") else where


def device_kind() -> str:
    """The chip this trace compiles for: the mesh's (a TPU topology or GPU target ahead of time), else the
    first device's."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.devices()[0].device_kind if mesh.empty else mesh.abstract_device.device_kind


# A parameter that is one vector per layer (a norm's scale, a bias) of at most this many entries is
# replicated but for its layer axis: split over fsdp, each layer's slice would cost an all-gather in the
# forward, another in the recomputed forward and a reduce-scatter in the backward, each a few KiB and so
# all latency, to save at most 3 x 256 KiB (with Adam's moments) per layer per device.
SMALL_VECTOR = 1 << 16
LAYER_AXES = ("layers", "stack")


def param_spec(shape, axes: Axes, rule_table) -> P:
    """A parameter's PartitionSpec: the rule table's, less the split of a small per-layer vector."""
    out = spec(axes, rule_table)
    other = [n for n, a in zip(shape, axes) if a not in LAYER_AXES]
    if len(other) <= 1 and (not other or other[0] <= SMALL_VECTOR):
        out = P(*(m if a in LAYER_AXES else None for m, a in zip(tuple(out) + (None,) * len(axes), axes)))
    return out


def param_shardings(specs, mesh: Mesh, rule_table):
    """Each parameter's NamedSharding (a tree like `specs`, the model's Param tree), with every
    dimension checked divisible by the mesh axes it is split over (one line naming the parameter)."""
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, param_spec(s.shape, s.axes, rule_table)), specs, is_leaf=_is_spec)

    def check(path, s, sh):
        for dim, (size, logical) in enumerate(zip(s.shape, s.axes)):
            mesh_axes = sh.spec[dim] if dim < len(sh.spec) else None
            names = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
            n = 1
            for a in names:
                n *= mesh.shape[a]
            if size % n:
                raise ConfigError(f"parameter {jax.tree_util.keystr(path)} axis `{logical}` has size {size}, not divisible "
                                  f"by mesh {'*'.join(names)}={n}; change the model size or the mesh/sharding_rules")
    jax.tree_util.tree_map_with_path(check, specs, shardings, is_leaf=_is_spec)
    return shardings


def _is_spec(x) -> bool:
    # A models.params.Param, recognised by its fields: sharding sits below the models and imports none.
    return isinstance(x, tuple) and hasattr(x, "axes") and hasattr(x, "shape")


def constrain(x: jax.Array, axes: Axes) -> jax.Array:
    """Pin an activation's sharding by logical axes. Outside `use(...)` (a notebook, one device) a no-op."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, active_spec(axes))
