"""benchmarks/hlo_count: ops inside loops counted as often as the loops run, bytes from the ops' shapes."""

import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import ROOT
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm.mesh import make_mesh

sys.path.insert(0, str(ROOT / "benchmarks"))
import hlo_count  # noqa: E402


def _compiled_text(trips: int) -> str:
    """A jitted scan of `trips` steps over 8 devices, each step a matmul of a batch-sharded x with a
    replicated w whose gradient-like sum over the batch is an all-reduce of a [64, 32] float32 block."""
    mesh = make_mesh({"data": 8})

    def f(x_TBD, w_DF):
        def body(acc_DF, x_BD):
            y_BF = x_BD @ w_DF
            return acc_DF + jax.lax.with_sharding_constraint(x_BD.T @ y_BF, NamedSharding(mesh, P())), None
        return jax.lax.scan(body, jnp.zeros((64, 32)), x_TBD)[0]

    x = jax.ShapeDtypeStruct((trips, 128, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    return jax.jit(f).lower(x, w).compile().as_text()


@pytest.mark.parametrize("trips", [3, 7])
def test_a_collective_in_a_loop_counts_once_per_trip(trips):
    hlo = _compiled_text(trips)
    ar = hlo_count.collectives(hlo)["all-reduce"]
    assert ar["ops"] == trips, hlo
    assert ar["bytes"] == trips * 64 * 32 * 4
    assert ar["sent"] == pytest.approx(ar["bytes"] * 2 * 7 / 8)  # a ring over 8 devices sends 2(g-1)/g
    # x @ w on 16 local rows (2 * 16 * 32 * 64) and x.T @ y (2 * 64 * 32 * 16), per trip
    assert hlo_count.matmul_flops(hlo) == {"all": trips * 2 * (2 * 16 * 32 * 64), "recomputed": 0, "unnamed": 0}


def test_group_sizes_and_async_shapes_are_read_from_the_op():
    line = ("  %rs = bf16[8,16]{1,0} reduce-scatter(bf16[32,16]{1,0} %p), channel_id=1, replica_groups=[2,4]<=[8], "
            "dimensions={0}, to_apply=%add")
    ag = ("  %ag = (bf16[8,16]{1,0}, bf16[32,16]{1,0}) all-gather-start(bf16[8,16]{1,0} %p), channel_id=2, "
          "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}")
    ar = ("  %ar = f32[4]{0} all-reduce(f32[4]{0} %p), replica_groups=mesh['data'=2,'fsdp'=4,'tensor'=2] "
          "{'fsdp','tensor'}, to_apply=%add")
    # GPU modules' async forms: an all-reduce-start's result is the reduced array itself; a
    # collective-permute-start's is (operand, result, two contexts), of which one buffer travels
    ars = "  %ars = bf16[1024]{0} all-reduce-start(bf16[1024]{0} %p), replica_groups={{0,1}}, to_apply=%add"
    cps = ("  %cps = (f32[256]{0}, f32[256]{0}, u32[], u32[]) collective-permute-start(f32[256]{0} %p), "
           "source_target_pairs={{0,1},{1,0}}")
    hlo = f"HloModule m\n\nENTRY %main () -> f32[] {{\n{line}\n{ag}\n{ar}\n{ars}\n{cps}\n}}\n"
    c = hlo_count.collectives(hlo)
    assert c["reduce-scatter"] == {"ops": 1, "bytes": 32 * 16 * 2, "sent": 32 * 16 * 2 * 3 / 4}
    assert c["all-gather"] == {"ops": 1, "bytes": 32 * 16 * 2, "sent": 32 * 16 * 2 * 3 / 4}
    assert c["all-reduce"] == {"ops": 2, "bytes": 16 + 2048, "sent": 16 * 2 * 7 / 8 + 2048}  # groups of 8, then 2
    assert c["collective-permute"] == {"ops": 1, "bytes": 1024, "sent": 1024}


# libtpu's own lines (Llama-3-8B on v5p-8, 2 x 8192 tokens a device): a matmul with a head dimension is a
# convolution whose window slides over the heads, padded so that each output head reads one position.
TPU_CONVOLUTIONS = """HloModule m

ENTRY %main () -> bf16[] {
  %x = bf16[2,8192,4096,1]{1,2,3,0} parameter(0)
  %wq = bf16[4096,32,128,1]{1,2,3,0} parameter(1)
  %q = bf16[2,8192,32,128]{3,1,2,0} convolution(%x, %wq), window={size=1x32 pad=0_0x31_31 rhs_reversal=0x1}, dim_labels=0bf1_i1o0->0b1f, metadata={op_name="jit(train_step)/jvp()/bld,d...->bl.../dot_general"}
  %dq = bf16[2,8192,32,128]{3,1,2,0} parameter(2)
  %dwq = bf16[4096,32,128,1]{2,0,1,3} convolution(%x, %dq), window={size=32x2 pad=31_31x0_0 rhs_reversal=1x0}, dim_labels=1fb0_1i0o->b0f1, metadata={op_name="jit(train_step)/transpose(jvp())/bld,d...->bl.../dot_general"}
  %h = bf16[2,8192,4096]{2,1,0} parameter(3)
  %wg = bf16[4096,14336,1]{1,0,2} parameter(4)
  ROOT %g = bf16[2,8192,14336]{2,1,0} convolution(bf16[2,8192,4096]{2,1,0} %h, %wg), window={size=1}, dim_labels=0bf_io0->0bf, metadata={op_name="jit(train_step)/checkpoint/rematted_computation/bld,df->blf/dot_general"}
}
"""


def test_libtpu_convolutions_count_the_window_positions_that_read_input():
    f = hlo_count.matmul_flops(TPU_CONVOLUTIONS)
    tokens = 2 * 8192
    q = 2 * tokens * 4096 * 32 * 128  # x @ wq, and its dW the same; a window's full size would count 32 x this
    assert f == {"all": 2 * q + 2 * tokens * 4096 * 14336, "recomputed": 2 * tokens * 4096 * 14336, "unnamed": 0}


@pytest.mark.parametrize("size,out,win,stride,lo,lhs_dilate,expect", [
    (1, 32, 32, 1, 31, 1, 32),        # the head trick: one position per output
    (10, 8, 3, 1, 0, 1, 24),          # a valid convolution: every window inside
    (10, 10, 3, 1, 1, 1, 28),         # 'same' padding: the two edge outputs lose one position each
    (10, 4, 3, 3, 0, 1, 10),          # strided: the last window hangs past the end
    (4, 7, 3, 1, 2, 2, 10)])          # a transposed convolution: holes between inputs read nothing
def test_window_positions_on_input_match_a_brute_count(size, out, win, stride, lo, lhs_dilate, expect):
    span = (size - 1) * lhs_dilate + 1
    brute = sum(0 <= o * stride + k - lo < span and (o * stride + k - lo) % lhs_dilate == 0
                for o in range(out) for k in range(win))
    assert hlo_count._window_pairs(size, out, win, stride, lo, lhs_dilate, 1) == brute == expect


# A loop like libtpu's windowed matmuls (a layer's all-gather folded into its matmul), reduced to its
# counter: no known_trip_count, a u32 counter stepped by 2; this one starts at 1 (a copy of a constant)
# and stops at 8, so it runs 4 times although the condition's only constant is 8.
WINDOWED = """HloModule m

%cond (p: (u32[], f32[4])) -> pred[] {
  %p = (u32[], f32[4]) parameter(0)
  %limit = u32[]{:T(128)} constant(8)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %limit), direction=LT
}

%body (q: (u32[], f32[4])) -> (u32[], f32[4]) {
  %q = (u32[], f32[4]) parameter(0)
  %j = u32[]{:T(128)} get-tuple-element(%q), index=0
  %x = f32[4]{0} get-tuple-element(%q), index=1
  %two = u32[]{:T(128)} constant(2)
  %next = u32[]{:T(128)S(6)} add(%j, %two), metadata={op_name="jit(f)/dot_general"}
  %y = f32[4]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  ROOT %t = (u32[], f32[4]) tuple(%next, %y)
}

ENTRY %main (a: f32[4]) -> (u32[], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %one = u32[]{:T(128)} constant(1)
  %start = u32[]{:T(128)} copy(%one)
  %init = (u32[], f32[4]) tuple(%start, %a)
  ROOT %w = (u32[], f32[4]) while(%init), condition=%cond, body=%body
}
"""


def test_a_loop_without_a_known_trip_count_is_read_from_its_counter():
    assert hlo_count.collectives(WINDOWED)["collective-permute"] == {"ops": 4, "bytes": 64, "sent": 64}
