"""LoRA as a parameter transform over any family: low-rank adapters beside frozen base weights.

The adapters are their own parameter tree, {"layers": {name: {"a": [n_layers, *in, r], "b": [n_layers, r,
*out]}}} for each target weight [n_layers, *in, *out]; they are the only trained parameters (only they
have optimizer state), and the rule table shards them like the weight they adapt (the rank axis is
replicated). `attach` puts a `Lora` node in place of each target, so the model runs unchanged and the
matmul hook (layers.dense) has the node add (alpha / r) x A B; `merge` folds them into plain weights for
export. B starts at zero, so step 0 is exactly the base model.
"""

import dataclasses
import functools
import math
import string
from typing import Any

import jax
import jax.numpy as jnp

from maxlm.errors import ConfigError
from maxlm.layers.dense import WeightNode, dense, innermost
from maxlm.models.params import Param, is_drawn, normal, zeros


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "a", "b", "key"],
                   meta_fields=["scale", "dropout"])
@dataclasses.dataclass
class Lora(WeightNode):
    """A frozen weight `w` [*in, *out] (an array, or another node: an FP8 base) and its adapters `a` [*in, r]
    and `b` [r, *out], added with `scale` (alpha / r): W x + scale B A x. `key` (raw key data) switches on
    dropout of the adapters' input at rate `dropout`."""
    w: Any
    a: Any
    b: Any
    key: Any = None
    scale: float = 1.0
    dropout: float = 0.0

    def matmul(self, eq: str, x: jax.Array, out_dtype=None) -> jax.Array:
        eq_w, eq_a, eq_b = _eqs(eq, innermost(self.w).ndim)
        y = dense(eq_w, x, self.w, out_dtype=out_dtype)
        if self.key is not None and self.dropout:
            keep = jax.random.bernoulli(jax.random.wrap_key_data(self.key), 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        xa = jnp.einsum(eq_a, x, self.a.astype(x.dtype))
        return y + (self.scale * jnp.einsum(eq_b, xa, self.b.astype(x.dtype), preferred_element_type=out_dtype)).astype(y.dtype)


def _eqs(eq: str, w_ndim: int) -> tuple[str, str, str]:
    """einsum equations of x -> x A -> (x A) B for a weight matmul `eq` ("bld,dhk->blhk", or "bld,d...->bl...")."""
    ins, out = eq.split("->")
    x_sub, w_sub = ins.split(",")[:2]
    if "..." in w_sub:  # spell the ellipsis out: the weight's trailing axes, in the output too
        free = [c for c in string.ascii_letters if c not in eq][:w_ndim - len(w_sub) + 3]
        w_sub, out = w_sub.replace("...", "".join(free)), out.replace("...", "".join(free))
    r = next(c for c in string.ascii_letters if c not in x_sub + w_sub + out)
    contracted = "".join(c for c in w_sub if c in x_sub and c not in out)
    kept = "".join(c for c in x_sub if c not in contracted)
    w_out = "".join(c for c in w_sub if c in out)
    return f"{x_sub},{w_sub}->{out}", f"{x_sub},{contracted}{r}->{kept}{r}", f"{kept}{r},{r}{w_out}->{out}"


def _split(spec: Param) -> int:
    """How many of a weight's axes (after `layers`) are the matmul's inputs: the first when it is `embed`
    (projections out of the residual), else all but the last (projections back into it)."""
    return 1 if spec.axes[1] == "embed" else len(spec.shape) - 2


def check_targets(base_specs, lcfg) -> None:
    layers = base_specs["layers"]
    matrices = sorted(k for k, s in layers.items() if len(s.shape) >= 3 and is_drawn(s) and "experts" not in s.axes)
    for t in lcfg.targets:
        s = layers.get(t)
        if s is None or len(s.shape) < 3:
            raise ConfigError(f"lora.targets: this model has no weight `{t}`; its layer weights are {', '.join(matrices)}")
        if not is_drawn(s):  # GPT-2's biases are 3-D too
            raise ConfigError(f"lora.targets: `{t}` is a bias or norm gain, which LoRA does not adapt; its layer weights "
                              f"are {', '.join(matrices)}")
        if "experts" in s.axes:
            raise ConfigError(f"lora.targets: `{t}` holds the MoE experts, which LoRA does not adapt yet; target the "
                              f"attention or shared weights ({', '.join(matrices)})")


def specs(base_specs, lcfg) -> dict:
    """The adapters' spec tree for the model whose specs are `base_specs` (targets checked)."""
    check_targets(base_specs, lcfg)
    r, out = lcfg.rank, {}
    for t in lcfg.targets:
        s = base_specs["layers"][t]
        n_in = _split(s)
        L, ins, outs = s.shape[0], s.shape[1:1 + n_in], s.shape[1 + n_in:]
        # A as PEFT draws it (Kaiming-uniform's scale, 1/sqrt(fan_in)); B zero, so training starts at the base.
        out[t] = {"a": Param((L, *ins, r), ("layers", *s.axes[1:1 + n_in], None), normal(1 / math.sqrt(math.prod(ins)))),
                  "b": Param((L, r, *outs), ("layers", None, *s.axes[1 + n_in:]), zeros)}
    return {"layers": out}


def scale_of(lcfg) -> float:
    """PEFT's scaling (without rsLoRA), so an exported adapter behaves the same there."""
    return lcfg.alpha / lcfg.rank


def attach(base, adapters, scale: float, dropout: float = 0.0, key=None):
    """The base tree with each target replaced by Lora(w, a, b): what the model runs with. `key` (raw key
    data) turns on `dropout` for a train step. Works on trees of shardings and abstract arrays too."""
    layers = dict(base["layers"])
    for i, (t, ab) in enumerate(sorted(adapters["layers"].items())):
        k = None
        if key is not None and dropout:  # one key per layer and target: the scan hands each layer its own
            n = ab["a"].shape[0]
            k = jax.vmap(lambda j: jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(key), i * 4096 + j)))(
                jnp.arange(n))
        layers[t] = Lora(layers[t], ab["a"], ab["b"], k, scale=scale, dropout=dropout)
    return {**base, "layers": layers}


def merge(base, adapters, scale: float):
    """Plain float32 params with every adapter folded in: w + (alpha / r) A B, per layer."""
    layers = dict(base["layers"])
    for t, ab in adapters["layers"].items():
        a, b = jnp.asarray(ab["a"], jnp.float32), jnp.asarray(ab["b"], jnp.float32)
        n_in = a.ndim - 2
        delta = jnp.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, a.shape[-1]), b.reshape(b.shape[0], b.shape[1], -1))
        layers[t] = jnp.asarray(layers[t], jnp.float32) + scale * delta.reshape(a.shape[:1 + n_in] + b.shape[2:])
    return {**base, "layers": layers}
