"""The experts' grouped matmul by tokamax (layers.gmm), as far as a CPU can check it.

- tokamax's Mosaic GPU kernels (sm90) run in jax's Mosaic GPU interpreter: the forward through
  `gmm.tokamax_grouped`, and the dx kernel as tokamax's own backward calls it (a ragged_dot with the
  weights transposed), against `lax.ragged_dot` in float32, with experts that get no rows first, in the
  middle and last, and rows past the last group. The dw kernel (ragged contracting dimension) fails in
  the interpreter (its shared-memory model rejects the kernel's transposed operand), and the interpreter's
  callbacks are effects that tokamax's own custom VJP refuses to differentiate: the full VJP, dw included,
  waits for a GPU (benchmarks/gpu_check.sh grouped).
- maxlm's own guarantees around the kernel (rows past the groups zero in y and dx, an expert with no rows
  exactly zero dw) are checked by handing `tokamax_grouped` an implementation that writes NaN wherever the
  kernel may leave memory unwritten: tokamax's Triton variant did (garbage or NaN dw for empty experts).
- the H100 compiles, with their memory, are in test_gpu_models.py."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, cli_env, needs

from maxlm.layers import gmm

try:
    import tokamax  # noqa: F401
    has_tokamax = True
except ImportError:
    has_tokamax = False
needs_tokamax = needs(has_tokamax, reason="tokamax is not installed (requirements.txt)")

# Group sizes over 4 experts and 256 rows: an empty expert first, in the middle, last, none, and only one.
GROUPS = [[0, 100, 0, 90], [64, 0, 64, 64], [70, 60, 50, 0], [64, 64, 64, 64], [0, 0, 200, 0]]


def _inputs(rows=256, d=128, f=128, experts=4, seed=0):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.standard_normal((rows, d)), jnp.bfloat16),
            jnp.asarray(r.standard_normal((experts, d, f)) / 10, jnp.bfloat16),
            jnp.asarray(r.standard_normal((rows, f)), jnp.bfloat16))


INTERPRETED = """
import json, sys
from maxlm import aot, topology
aot.prepare("h100-8")
import jax, jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
import tokamax
sys.path.insert(0, "tests")
from test_gmm import GROUPS, _inputs
from maxlm.layers import gmm

kernel = plgpu.kernel  # every Mosaic GPU kernel tokamax builds, run by the interpreter
plgpu.kernel = lambda *a, **kw: kernel(*a, **{**kw, "interpret": plgpu.InterpretGPUParams()})
h100 = aot.gpu_devices(topology.lookup_gpu("h100-8"))[0][0]
x, w, ct = _inputs()
f32 = lambda a: a.astype(jnp.float32)

def both(x, w, g, ct):
    dx = tokamax.ragged_dot(ct, jnp.swapaxes(w, 1, 2), g, preferred_element_type=x.dtype, implementation="mosaic_gpu")
    return gmm.tokamax_grouped(x, w, g), dx

out = []
for sizes in GROUPS:
    g = jnp.asarray(sizes, jnp.int32)
    with jax.default_device(h100):  # tokamax picks sm90 from the default device while tracing
        traced = jax.jit(both).trace(x, w, g, ct)
    y, dx = traced.lower().compile()(x, w, g, ct)  # lowered and run on the CPU
    n = sum(sizes)
    ry = jax.lax.ragged_dot(f32(x), f32(w), g)
    rdx = jax.lax.ragged_dot(f32(ct), jnp.swapaxes(f32(w), 1, 2), g)
    out.append({"y": float(jnp.max(jnp.abs(f32(y[:n]) - ry[:n]))), "dx": float(jnp.max(jnp.abs(f32(dx[:n]) - rdx[:n]))),
                "y_past": float(jnp.max(jnp.abs(f32(y[n:])), initial=0.0)), "scale": float(jnp.max(jnp.abs(ry)))})
print(json.dumps(out))
"""


@needs_tokamax
@needs(os.path.isdir(os.environ.get("MAXLM_CUDA_PLUGIN", "")), reason="jax's CUDA plugin gives the H100 device tokamax reads")
def test_tokamax_mosaic_forward_and_dx_match_ragged_dot_in_the_interpreter():
    r = subprocess.run([sys.executable, "-c", INTERPRETED], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for sizes, got in zip(GROUPS, json.loads(r.stdout.strip().splitlines()[-1])):
        # bfloat16 outputs of values up to ~4: one rounding step is 2**-6; the kernel accumulates in float32
        assert got["y"] <= 2 ** -6 * max(1.0, got["scale"]) and got["dx"] < 0.05, (sizes, got)
        assert got["y_past"] == 0.0, (sizes, got)  # never written by the kernel, zeroed by maxlm


def _careless(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, preferred_element_type=None, **_):
    """A grouped matmul that leaves what it never writes as NaN, in its output and in its weights' gradient:
    what tokamax's kernels guarantee nothing about (rows past the groups; an expert with no rows)."""
    @jax.custom_vjp
    def f(x, w):
        return _nan_past(jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=preferred_element_type), group_sizes)

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, ct):
        x, w = res
        _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, group_sizes), x, w)
        dx, dw = vjp(ct)
        return _nan_past(dx, group_sizes), jnp.where((group_sizes > 0)[:, None, None], dw, jnp.nan).astype(w.dtype)

    f.defvjp(fwd, bwd)
    assert ragged_dot_dimension_numbers == jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return f(lhs, rhs)


def _nan_past(y, g):
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(g))[:, None], y, jnp.nan).astype(y.dtype)


@needs_tokamax
@pytest.mark.parametrize("sizes", GROUPS)
def test_rows_past_the_groups_and_empty_experts_come_out_zero_whatever_the_kernel_leaves(sizes):
    x, w, ct = (a.astype(jnp.float32) for a in _inputs(rows=64, d=16, f=8))
    g = jnp.asarray([s * 64 // 256 for s in sizes], jnp.int32)  # the same shape of groups, on 64 rows
    n = int(g.sum())

    def run(mm):
        y, vjp = jax.vjp(mm, x, w)
        return (y, *vjp(ct))

    y, dx, dw = jax.jit(lambda: run(lambda x, w: gmm.tokamax_grouped(x, w, g, implementation=(_careless,))))()
    ry, rdx, rdw = jax.jit(lambda: run(lambda x, w: jax.lax.ragged_dot(x, w, g)))()
    assert not jnp.isnan(y).any() and not jnp.isnan(dx).any() and not jnp.isnan(dw).any()
    assert jnp.all(y[n:] == 0) and jnp.all(dx[n:] == 0)
    assert all(jnp.all(dw[e] == 0) for e in range(4) if g[e] == 0)
    np.testing.assert_allclose(y, ry, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, rdx, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, rdw, rtol=1e-6, atol=1e-6)


def test_auto_keeps_xla_until_a_gpu_has_checked_tokamax_and_tokamax_runs_on_hopper_only():
    assert gmm.resolve("auto", "gpu", "NVIDIA H100 80GB HBM3") == "xla"  # VERIFIED is empty until gpu_check runs
    assert gmm.resolve("tokamax", "gpu", "NVIDIA H100 80GB HBM3") == "tokamax"
    assert gmm.resolve("auto", "tpu", "TPU v5") == gmm.resolve("auto", "cpu", "cpu") == "xla"
    assert gmm.refusal("tokamax", "gpu", "NVIDIA H200") is None
    assert gmm.refusal("xla", "cpu", "cpu") is None and gmm.refusal("auto", "gpu", "NVIDIA B200") is None
    assert "no backward" in gmm.refusal("tokamax", "gpu", "NVIDIA B200")
    assert "this run is on cpu" in gmm.refusal("tokamax", "cpu", "cpu")
    assert "this run is on the NVIDIA A100-SXM4-80GB" in gmm.refusal("tokamax", "gpu", "NVIDIA A100-SXM4-80GB")
