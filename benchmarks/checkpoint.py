"""Checkpoint save and restore speed for a ~1 GB train state, through maxlm.checkpoint (what the loop uses).

    python benchmarks/checkpoint.py [--layers 5] [--saves 3] [--dir /path/on/the/disk/to/test]

The state is a real maxlm TrainState (params + AdamW moments, float32) of a Llama with d_model 1024;
five layers make it 1.01 GB. Every array is filled with random values, so nothing compresses.
It measures, per save:
  block   the time `Checkpointer.save` holds the caller: what the training loop pauses for
  commit  from the start of the save to the step being committed on disk (the async write included)
and then restore: a fresh Checkpointer reads the newest step onto the same shardings, until every
array is on device. The restored state is compared bit for bit with the saved one.
Restore reads right after the saves, so the OS page cache may still hold the files; the script says
whether it could drop the cache first (it needs root and a writable /proc/sys/vm/drop_caches).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxlm import cli  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from maxlm import checkpoint as ckpt, config, mesh as mesh_lib, recipe as recipe_lib, sharding  # noqa: E402
from maxlm.state import StateSpec  # noqa: E402


def random_state(ss):
    """A TrainState with random values in every float array, created directly in its shardings."""
    def fill(path, a):
        if not np.issubdtype(a.dtype, np.floating):
            return np.zeros(a.shape, a.dtype)
        key = jax.random.fold_in(jax.random.key(0), hash(jax.tree_util.keystr(path)) % (1 << 31))
        return jax.random.normal(key, a.shape, a.dtype)
    return jax.jit(lambda: jax.tree_util.tree_map_with_path(fill, ss.abstract), out_shardings=ss.shardings)()


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main():
    ap = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()

    cfg = config.load("configs/tiny.yml", [f"model.n_layers={args.layers}", "model.d_model=1024", "model.n_heads=16",
                                           "model.n_kv_heads=16", "model.head_dim=64", "model.d_ff=4096"])
    devices = jax.devices()
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, len(devices)), devices)
    ss = StateSpec(recipe_lib.build(cfg, m), m, sharding.rules(cfg))
    state = jax.block_until_ready(random_state(ss))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(f"state: {nbytes / 1e9:.3f} GB in {len(jax.tree.leaves(state))} arrays; {len(devices)} x "
          f"{devices[0].device_kind}; mesh {mesh_lib.describe(m)}")

    root = Path(args.dir or tempfile.mkdtemp(prefix="maxlm-ckpt-bench-"))
    directory = root / "checkpoints"
    shutil.rmtree(directory, ignore_errors=True)
    print(f"writing to {directory} ({subprocess.run(['df', '-h', str(root)], capture_output=True, text=True).stdout.splitlines()[-1]})")
    ck = ckpt.Checkpointer(str(directory), keep=2)
    meta = ckpt.metadata(config.to_dict(cfg), m, 0, 0)
    for i in range(1, args.saves + 1):
        t = time.perf_counter()
        block = ss.save(ck, i, state, {"next_index": i}, meta)
        ck.wait()
        commit = time.perf_counter() - t
        size = sum(f.stat().st_size for f in (directory / str(i)).rglob("*") if f.is_file())
        print(f"save {i}: block {block:.3f} s | commit {commit:.2f} s | {size / 1e9:.3f} GB on disk | "
              f"{nbytes / commit / 1e6:.0f} MB/s end to end")
    ck.close()

    dropped = drop_page_cache()
    print(f"page cache {'dropped' if dropped else 'NOT dropped (no permission): restore may read from RAM'}")
    t = time.perf_counter()
    ck = ckpt.Checkpointer(str(directory))
    restored, data_state, _ = ss.restore(ck, args.saves)
    jax.block_until_ready(restored)
    dt = time.perf_counter() - t
    ck.close()
    same = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
               for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)))
    print(f"restore: {dt:.2f} s = {nbytes / dt / 1e6:.0f} MB/s | bitwise identical: {same} | data state {data_state}")
    if not args.dir:
        shutil.rmtree(root)


if __name__ == "__main__":
    sys.exit(cli.run(main))
