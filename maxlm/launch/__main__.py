"""maxlm launcher:  python -m maxlm.launch TARGET CONFIG.yml [key=value ...] --name NAME [flags]

TARGET is gke (a JobSet manifest), xpk (an `xpk workload create` command), tpu-vm (a gcloud script) or
slurm (an sbatch script). The job's shape comes from --topology NAME [--slices N] (TPU) or --nodes N
--gpus-per-node G (GPU). The launcher checks the config against that shape, compiles the train step for
those TPUs or GPUs and refuses a job that would not fit, writes the files to --out (default launch/NAME),
and prints the one command that submits them; --submit runs it. Exit 2 on any bad flag or impossible
job, with nothing written or submitted. See docs/launch.md.
"""

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from maxlm import cli
from maxlm.errors import ConfigError

TOOLS = {"gke": "kubectl", "xpk": "xpk", "tpu-vm": "gcloud", "slurm": "sbatch"}


def log(msg: str) -> None:
    print(f"maxlm.launch: {msg}", flush=True)


def parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m maxlm.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="gke | xpk | tpu-vm | slurm")
    p.add_argument("config", help="the config file, a path inside this checkout")
    p.add_argument("overrides", nargs="*", help="key=value, as for train.py")
    p.add_argument("--name", required=True, help="the job's name: lowercase letters, digits and '-'")
    p.add_argument("--image", help="gke/xpk: the container image (it holds this checkout at its working directory)")
    p.add_argument("--out", type=cli.path, help="where to write the job's files (default: launch/NAME)")
    p.add_argument("--submit", action="store_true", help="run the submit command too (kubectl, xpk, gcloud, sbatch)")
    p.add_argument("--topology", help="TPU: the slice, e.g. v5p-64, v6e-256, v5litepod-16")
    p.add_argument("--slices", type=cli.whole(1), default=1, help="TPU: slices joined over DCN (mesh.slices)")
    p.add_argument("--nodes", type=cli.whole(1), help="GPU: nodes")
    p.add_argument("--gpus-per-node", type=cli.whole(1), help="GPU: GPUs per node")
    p.add_argument("--gpu", default="nvidia-h100-80gb", help="gke/xpk GPU type (GKE accelerator label)")
    p.add_argument("--process-per", choices=("node", "gpu"), default="node", help="slurm: one process per node or per GPU")
    p.add_argument("--no-compile", action="store_true", help="skip the ahead-of-time compile (it needs libtpu or jax's CUDA plugin)")
    p.add_argument("--max-restarts", type=cli.whole(0), default=10, help="gke/xpk/slurm: restarts after preemption or failure")
    p.add_argument("--cluster", help="xpk: the GKE cluster")
    p.add_argument("--zone", help="tpu-vm: the zone")
    p.add_argument("--project", help="tpu-vm: the project (default: gcloud's)")
    return p


def main(argv: list[str]) -> int:
    try:
        return _launch(parser().parse_intermixed_args(argv))
    except ConfigError as e:
        print(f"maxlm.launch: error: {e}", file=sys.stderr, flush=True)
        return 2


def _launch(a) -> int:
    from maxlm.launch import job as job_lib, targets

    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        raise ConfigError(f"`{bad[0]}` is not key=value; flags start with --")
    if a.target == "xpk" and not a.cluster:
        raise ConfigError("xpk needs --cluster (the GKE cluster xpk submits to)")
    if a.target == "tpu-vm" and not a.zone:
        raise ConfigError("tpu-vm needs --zone (where the TPU VM is or will be)")
    if a.gpu != parser().get_default("gpu") and a.target not in ("gke", "xpk"):  # else ignored
        raise ConfigError(f"--gpu is the GKE accelerator label of gke and xpk jobs; a {a.target} job does not read it")
    if a.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {a.max_restarts}")
    job = job_lib.plan(a.target, a.config, a.overrides, name=a.name, topology_name=a.topology, slices=a.slices,
                       nodes=a.nodes, gpus_per_node=a.gpus_per_node, image=a.image, gpu=a.gpu,
                       process_per_gpu=a.process_per == "gpu")
    log(f"job {job.name}: {job.describe()}; mesh and batch fit")
    out = Path(a.out or f"launch/{job.name}")
    _check_out(out, a.target)
    render = {"gke": lambda: targets.gke(job, a.image, a.max_restarts),
              "xpk": lambda: targets.xpk(job, a.image, a.max_restarts, a.cluster),
              "tpu-vm": lambda: targets.tpu_vm(job, a.zone, a.project),
              "slurm": lambda: targets.slurm(job, sys.executable, a.max_restarts, str(out.resolve()))}
    files, submit = render[a.target]()
    shown = " ".join(submit[:-1] + [str(out / submit[-1])])
    if a.submit and shutil.which(TOOLS[a.target]) is None:  # before the compile, which takes a while
        raise ConfigError(f"--submit needs `{TOOLS[a.target]}` on PATH, and it is not there; install it, or submit "
                          f"the files yourself: {shown}")
    if a.no_compile:
        log(f"--no-compile: the train step was not compiled for {job.describe()}; a job that does not compile or "
            f"does not fit will fail only once it runs")
    else:
        job_lib.compile_for(job, log)
    _write(out, files)
    if not a.submit:
        log(f"wrote {', '.join(str(out / f) for f in files)}; submit with:\n  {shown}")
        return 0
    log(f"submitting: {shown}")
    code = subprocess.run(submit, cwd=out).returncode
    if code:  # the tool said why above; say what it means for the job
        raise ConfigError(f"`{shown}` failed (exit {code}), so the job was not submitted; its files are in {out}: fix "
                          f"what {TOOLS[a.target]} reports above (its cluster, credentials or project) and run that "
                          f"command again")
    return 0


def _check_out(out: Path, target: str) -> None:
    """The out directory is written into the Slurm script (#SBATCH --output, a comment): a newline there
    would end the line and make the rest a command, a space would split the #SBATCH option."""
    text = str(out.resolve())
    if any(ord(c) < 32 or ord(c) == 127 for c in text) or (target == "slurm" and any(c.isspace() for c in text)):
        raise ConfigError(f"--out {text!r} holds " + ("whitespace or a control character" if target == "slurm" else
                          "a control character") + "; choose a directory without")


def _write(out: Path, files: dict[str, str]) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; choose a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (out / name).write_text(text)
            if name.endswith((".sh", ".sbatch")):
                os.chmod(out / name, 0o755)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror}); choose a writable directory") from None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
