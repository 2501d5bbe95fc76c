"""maxlm.platforms: which jax platforms start, chosen before jax starts them."""

import pytest


@pytest.mark.malformed
def test_a_gpu_jax_cannot_use_is_one_line_and_exit_2(tmp_path):
    """/dev/nvidia* present, no CUDA plugin, JAX_PLATFORMS unset: before, jax raised "Backend 'cuda' is not in
    the list of known backends" from jax.process_index() (with libtpu installed) or fell back to the CPU."""
    import subprocess
    import sys

    from conftest import ROOT, cli_env

    code = ("import sys\nfrom jax._src import hardware_utils\nhardware_utils.has_visible_nvidia_gpu = lambda: True\n"
            f"sys.path.insert(0, {str(ROOT)!r})\nimport train\n"
            f"sys.exit(train.main(['configs/tiny.yml', 'steps=1', 'run_dir={tmp_path}']))\n")
    env = {k: v for k, v in cli_env(devices=1).items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        "maxlm: error: this machine has an NVIDIA GPU, but jax has no CUDA backend to use it: pip install "
        "'jax[cuda13]==0.11.2' to train on the GPU, or set JAX_PLATFORMS=cpu to run on the CPU")
    assert "Traceback" not in r.stderr
