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
    assert hlo_count.dot_flops(hlo) == trips * 2 * (2 * 16 * 32 * 64)


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
