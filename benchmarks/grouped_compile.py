"""What the GPU compiler makes of the MoE grouped matmul (`jax.lax.ragged_dot`), with no GPU: compiled for one
H100 through jax's CUDA plugin (MAXLM_CUDA_PLUGIN), it prints each shape's temporaries beside the size of
the rows' own output and of a product masked per expert (rows x experts x d_in, every row against every
expert's weights). Nothing runs; step time needs a GPU.

    JAX_PLATFORMS=cpu MAXLM_CUDA_PLUGIN=$PWD/.venv/cuda .venv/bin/python benchmarks/grouped_compile.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from maxlm import aot, cli  # noqa: E402

# (rows, experts, d_in, d_out): DeepSeek-V3's expert matmul for one device's 4096 tokens x k=8, all 256
# experts or 32 (expert=8), and a quarter of the rows.
SHAPES = [(32768, 256, 7168, 2048), (32768, 32, 7168, 2048), (8192, 256, 7168, 2048)]


def main() -> None:
    cli.Parser(description=__doc__.split("\n\n")[0]).parse_args()  # no flags: --help, and a mistake is one line
    print(aot.prepare("h100-8") or "")
    devices = aot.topology_devices("h100-8")[0]
    one = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), P())
    print(f"jax {jax.__version__}, compiled for one {devices[0].device_kind}, bfloat16")
    print(f"{'rows':>7} {'experts':>7} {'d_in':>5} {'d_out':>5} {'temp GiB':>9} {'output GiB':>10} {'masked GiB':>10}")
    for R, E, D, F in SHAPES:
        args = [jax.ShapeDtypeStruct((R, D), jnp.bfloat16, sharding=one),
                jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16, sharding=one),
                jax.ShapeDtypeStruct((E,), jnp.int32, sharding=one)]
        c = jax.jit(jax.lax.ragged_dot).lower(*args).compile()
        gib = lambda n: n / 2 ** 30  # noqa: E731
        print(f"{R:>7} {E:>7} {D:>5} {F:>5} {gib(c.memory_analysis().temp_size_in_bytes):>9.2f} "
              f"{gib(R * F * 2):>10.3f} {gib(R * E * D * 2):>10.2f}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
