"""FP8 training as a transform over any family (`quantization: fp8`): the layers' weight matmuls run
with both operands in e4m3 and the output gradient in e5m2, each scaled per tensor by delayed scaling,
the Transformer Engine / flax recipe: a tensor is divided by scale = amax / fp8_max before the cast,
where amax is the largest |value| in its last HISTORY steps, this step's not yet included.

The scaling state is its own tree beside the params, {"layers": {name: {"scale": [n_layers, 3], "amax":
[n_layers, 3, HISTORY]}}} for each target weight (slots: the matmul's two operands and its output
gradient). It is train state: no AdamW, no weight decay, checkpointed. `attach` puts an `Fp8` node in
place of each target's weight, so the model runs unchanged and the matmul hook (layers.dense) has the node
multiply in FP8 (flax's fp8_ops); the gradient of the state is its next value (flax's convention), which
`merge_microbatches` combines by max, never by sum: summing M microbatches' scales would make them M times
too large (NVIDIA/JAX-Toolbox#478).

Targets are the layers' dense matrices: attention projections, MLPs, shared experts. The embedding, the
unembedding, the MoE router and the routed experts stay in `dtype`, as Transformer Engine keeps the
embedding, output layer and router; `describe` says so in the log.
"""

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from maxlm.errors import ConfigError
from maxlm.layers.dense import WeightNode, wrap_innermost
from maxlm.models.params import Param, is_drawn, ones, zeros

HISTORY = 1024  # steps of amax kept per tensor (Transformer Engine's and flax's default)
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and later


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "scale", "amax"], meta_fields=[])
@dataclasses.dataclass
class Fp8(WeightNode):
    """A weight `w` to multiply in FP8, with its matmul's scaling state: `scale` [3] and amax `history`
    [3, H] for the matmul's two operands (e4m3) and its output gradient (e5m2). Their gradient is their
    next value (flax's fp8_ops convention), which the FP8 transform turns into the state's update."""
    w: Any
    scale: Any
    amax: Any

    def matmul(self, eq: str, x: jax.Array, out_dtype=None) -> jax.Array:
        # einsum may hand the operands to dot_general in either order; slots 0 and 1 follow its order, which
        # is fixed for a call site, so each operand keeps its own history from step to step.
        dot = functools.partial(fp8_ops.fp8_scaled_dot_general, lhs_scale=self.scale[0], rhs_scale=self.scale[1],
                                grad_scale=self.scale[2], lhs_amax_history=self.amax[0], rhs_amax_history=self.amax[1],
                                grad_amax_history=self.amax[2], quantize_compute_type=x.dtype)
        return jnp.einsum(eq, x, self.w.astype(x.dtype), preferred_element_type=out_dtype or x.dtype,
                          _dot_general=lambda a, b, dims, precision=None, **kw: dot(a, b, dims, **kw))


def targets(base_specs) -> list[str]:
    """The layer weights that run in FP8: the drawn matrices (not biases or gains, which start at 0 or 1),
    not the routed experts, not the router."""
    return sorted(k for k, s in base_specs["layers"].items() if len(s.shape) >= 3 and is_drawn(s)
                  and "experts" not in s.axes and k != "router")


def specs(base_specs) -> dict:
    """The scaling state's spec tree: scales start at 1 and histories at 0 (the first step scales by 1)."""
    out = {}
    for t in targets(base_specs):
        L = base_specs["layers"][t].shape[0]
        out[t] = {"scale": Param((L, 3), ("layers", None), ones),
                  "amax": Param((L, 3, HISTORY), ("layers", None, None), zeros)}
    return {"layers": out}


def attach(params, state):
    """`params` with each target's weight wrapped as Fp8(w, scale, amax), inside any node that already wraps
    it (under LoRA the frozen base runs in FP8, the adapters in `dtype`). Works on shardings and abstract
    trees too."""
    layers = dict(params["layers"])
    for t, s in state["layers"].items():
        layers[t] = wrap_innermost(layers[t], lambda w, s=s: Fp8(w, s["scale"], s["amax"]))
    return {**params, "layers": layers}


def merge_microbatches(a, b):
    """Two microbatches' next scaling states: every microbatch starts from the same state, so the scales
    agree and the histories differ only in this step's amax, of which the step keeps the larger."""
    return jax.tree.map(jnp.maximum, a, b)


def describe(names: list[str], platform: str, dtype: str) -> str:
    where = ("simulated on CPU: XLA:CPU widens the FP8 operands again for each matmul, so the numerics are FP8's "
             "and the speed is not" if platform == "cpu" else "FP8 GEMMs on the GPU's tensor cores")
    return (f"quantization=fp8: {', '.join(names)} in FP8 (e4m3 operands, e5m2 gradients, delayed per-tensor scaling "
            f"over {HISTORY} steps), {where}; the embedding, unembedding, router and routed experts stay in {dtype}")


def check_device(device) -> None:
    """Refuse, in one line, a device with no FP8 matmuls, rather than train slower in simulated FP8."""
    if device.platform == "cpu":
        return
    cc = getattr(device, "compute_capability", None)
    if device.platform == "gpu" and cc and tuple(int(x) for x in str(cc).split(".")[:2]) >= MIN_CAPABILITY:
        return
    what = f"compute capability {cc}" if cc else "no FP8 matmul units"
    raise ConfigError(f"quantization=fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability >= 8.9: "
                      f"L4, L40, H100, H200, B200); this {device.device_kind} has {what}. Use quantization=none")


F8_GEMM = re.compile(r'custom_call_target="__cublas\$lt\$matmul\$f8"')


def check_compiled(hlo_text: str, platform: str, n_expected: int, on_device: bool = True) -> str:
    """What the compiled step's HLO shows of FP8 (a line for the log). On a GPU, XLA must have rewritten
    the FP8 dot-generals into cuBLASLt FP8 GEMMs; none at all means the run would train at bf16 speed
    under an fp8 config (the silent fallback of torchtitan#3123), which is refused. Compiled for a GPU
    without one (`compile_topology`), XLA emits no cuBLAS call at all, FP8 or bf16, so only the casts
    are checked there, and the log says the GEMM check waits for the GPU."""
    casts = {t: hlo_text.count(t + "[") for t in ("f8e4m3fn", "f8e5m2")}
    if platform != "gpu" or not on_device:
        if not all(casts.values()):
            raise RuntimeError(f"quantization=fp8 but the compiled step holds no {', '.join(k for k, v in casts.items() if not v)} "
                               f"array: the FP8 transform did not reach the matmuls")
        note = f"fp8: the compiled step casts to f8e4m3fn {casts['f8e4m3fn']} times and to f8e5m2 {casts['f8e5m2']} times"
        return note + ("" if platform != "gpu" else "; compiled without a GPU, where XLA emits no cuBLAS GEMM of any "
                       "type, so that its GEMMs are cuBLASLt's FP8 ones is checked when the step compiles on the GPUs")
    gemms = len(F8_GEMM.findall(hlo_text))
    if not gemms:
        raise ConfigError("quantization=fp8: XLA compiled no cuBLASLt FP8 GEMM into the train step, so it would run "
                          "at bf16 speed; check the XLA/CUDA versions (benchmarks/gpu_check.sh) or use quantization=none")
    note = f"fp8: {gemms} cuBLASLt FP8 GEMMs in the compiled step"
    return note + (f" (of {n_expected} FP8 matmuls traced: the rest run in bf16)" if gemms < n_expected else "")
