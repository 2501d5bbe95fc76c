"""The files each target needs, rendered from a checked `Job`, and the one command that submits them.

Every target runs the same `python train.py ...`, and every one restarts a job that failed for a
reason a restart can cure (preemption, a lost host, a stall) but not one that would fail again: exit 2
(a mistake in the config or data) and 3 (nan_policy) end the job (docs/errors.md has the codes).
"""

import shlex

import yaml

from maxlm.launch.job import MOUNT, PORT, Job

FINAL_EXIT_CODES = [2, 3]  # retrying cannot help: a bad config or data, or nan_policy=stop
RETRY_EXIT_CODES = [4, 5, 143]  # I/O failure, stall or lost peer (watchdog), SIGTERM (preemption): resume
# 134 too under srun, which reports a task killed by a signal over any exit code: when process 0 stops on a
# stall or a lost peer (exit 5), the JAX runtime aborts every other process (SIGABRT), and srun exits 134.
# 137 too: a task killed by SIGKILL (the kernel's OOM killer, a node's cgroup limit, `kill -9`); the others
# exit 5 once they find it lost, but srun reports the signal. Bounded by --max-restarts, as the others.
# (A JobSet restarts on every code but 2 and 3, xpk on 127-255 by itself.)
SLURM_RETRY_EXIT_CODES = sorted(RETRY_EXIT_CODES + [134, 137])
GRACE_S = 300  # SIGTERM -> SIGKILL: the step in flight and its checkpoint must be saved in between
GCSFUSE = "gcsfuse.csi.storage.gke.io"


def jobset(job: Job, image: str, max_restarts: int) -> dict:
    """A JobSet (jobset.x-k8s.io/v1alpha2): one Job per TPU slice (or one for the GPU nodes), one pod per
    host, every pod reachable at NAME-JOB-i-j.NAME through JobSet's headless service."""
    tpu, rjob = job.tpu, "slice" if job.tpu else "node"
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"},
           {"name": "MAXLM_JOB", "value": job.name}]  # a restarted attempt takes over its run_dir lease (25 s)
    if tpu:  # GKE injects TPU_WORKER_HOSTNAMES/TPU_WORKER_ID (and MEGASCALE_* across slices); jax reads them
        selector = {"cloud.google.com/gke-tpu-accelerator": tpu.gen.gke_accelerator,
                    "cloud.google.com/gke-tpu-topology": tpu.shape}
        resource = {"google.com/tpu": tpu.chips_per_host}
    else:  # maxlm/distributed.py joins through these
        env += [{"name": "JAX_COORDINATOR_ADDRESS", "value": f"{job.name}-{rjob}-0-0.{job.name}:{PORT}"},
                {"name": "JAX_NUM_PROCESSES", "value": str(job.processes)},
                {"name": "JAX_PROCESS_ID", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}}]
        selector = {"cloud.google.com/gke-accelerator": job.gpu}
        resource = {"nvidia.com/gpu": job.gpus_per_node}
    container = {"name": "maxlm", "image": image, "imagePullPolicy": "Always", "command": job.command(),
                 "env": env, "ports": [{"containerPort": PORT}],
                 "resources": {"limits": resource, "requests": dict(resource)},
                 "volumeMounts": [{"name": f"gcs-{i}", "mountPath": f"{MOUNT}/{b}", "readOnly": True}
                                  for i, b in enumerate(job.buckets)]}
    pod = {"restartPolicy": "Never", "terminationGracePeriodSeconds": GRACE_S, "nodeSelector": selector,
           "hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet",
           "tolerations": [{"key": next(iter(resource)), "operator": "Exists", "effect": "NoSchedule"}],
           "containers": [container],
           # Inputs only, read-only: implicit-dirs shows the prefixes of objects as directories, as data
           # readers expect. Nothing maxlm writes goes through FUSE (docs/storage.md).
           "volumes": [{"name": f"gcs-{i}", "csi": {"driver": GCSFUSE, "readOnly": True, "volumeAttributes": {
               "bucketName": b, "mountOptions": "implicit-dirs"}}} for i, b in enumerate(job.buckets)]}
    template = {"metadata": {"labels": {"maxlm/job": job.name}}, "spec": pod}
    if job.buckets:
        template["metadata"]["annotations"] = {"gke-gcsfuse/volumes": "true"}
    spec = {"parallelism": job.nodes, "completions": job.nodes, "completionMode": "Indexed", "backoffLimit": 0,
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                "containerName": "maxlm", "operator": "In", "values": FINAL_EXIT_CODES}}]},
            "template": template}
    meta = {"name": job.name, "labels": {"maxlm/job": job.name}}
    if tpu:  # one slice per node pool, as GKE's multi-slice placement requires
        meta["annotations"] = {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": meta, "spec": {
        "failurePolicy": {"maxRestarts": max_restarts, "rules": [
            {"name": "final-exit-code", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]},
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "replicatedJobs": [{"name": rjob, "replicas": job.slices if tpu else 1, "template": {"spec": spec}}]}}


def gke(job: Job, image: str, max_restarts: int) -> tuple[dict[str, str], list[str]]:
    head = (f"# maxlm job {job.name}: {job.describe()}\n# written by `python -m maxlm.launch`; submit with "
            f"`kubectl apply -f jobset.yaml` (the cluster needs the JobSet controller"
            f"{' and the GCS FUSE CSI driver' if job.buckets else ''})\n")
    return {"jobset.yaml": head + yaml.safe_dump(jobset(job, image, max_restarts), sort_keys=False)}, \
        ["kubectl", "apply", "-f", "jobset.yaml"]


def xpk(job: Job, image: str, max_restarts: int, cluster: str) -> tuple[dict[str, str], list[str]]:
    shape = (["--tpu-type", job.tpu.name, "--num-slices", str(job.slices)] if job.tpu else
             ["--device-type", f"{job.gpu.removeprefix('nvidia-')}-{job.gpus_per_node}", "--num-nodes", str(job.nodes)])
    storage = [a for i, _ in enumerate(job.buckets) for a in ("--storage", f"{job.name}-gcs-{i}")]
    cmd = ["xpk", "workload", "create", "--cluster", cluster, "--workload", job.name, "--docker-image", image,
           *shape, "--max-restarts", str(max_restarts), "--restart-on-exit-codes",
           ",".join(map(str, RETRY_EXIT_CODES)), "--termination-grace-period-seconds", str(GRACE_S), *storage,
           "--command", f"MAXLM_JOB={job.name} {job.shell()}"]
    attach = "".join(f"xpk storage attach {job.name}-gcs-{i} --cluster {cluster} --type gcsfuse --bucket {b} "
                     f"--mount-point {MOUNT}/{b} --readonly true --auto-mount false || true\n"
                     for i, b in enumerate(job.buckets))
    script = (f"#!/usr/bin/env bash\n# maxlm job {job.name}: {job.describe()}\nset -euo pipefail\n"
              + (f"# the buckets of the run's inputs, mounted read-only in the pods with GCS FUSE (once per cluster)\n"
                 f"{attach}" if attach else "")
              + shlex.join(cmd) + "\n")
    return {"xpk.sh": script}, ["bash", "xpk.sh"]


def tpu_vm(job: Job, zone: str, project: str | None) -> tuple[dict[str, str], list[str]]:
    """Create the TPU VM unless it exists, copy this checkout to every worker, build its venv there, mount
    the buckets, and run the job on all workers at once (jax joins them through the TPU metadata)."""
    tpu, where = job.tpu, ["--zone", zone] + (["--project", project] if project else [])
    gc = "gcloud compute tpus tpu-vm"
    mounts = "".join(f"sudo mkdir -p {MOUNT}/{b} && sudo chown $USER {MOUNT}/{b} && "
                     f"(mountpoint -q {MOUNT}/{b} || gcsfuse --implicit-dirs -o ro {b} {MOUNT}/{b}) && "
                     for b in job.buckets)
    remote = (f"set -e; mkdir -p ~/maxlm && tar -xzf ~/maxlm.tgz -C ~/maxlm && cd ~/maxlm && "
              f"{'command -v gcsfuse >/dev/null || { echo gcsfuse is not installed on this TPU VM image >&2; exit 2; }; ' if job.buckets else ''}"
              f"{mounts}(test -x .venv/bin/python || python3 -m venv .venv) && "
              f".venv/bin/pip install -q -r requirements.txt 'jax[tpu]==0.11.2' && PYTHONUNBUFFERED=1 MAXLM_JOB={job.name} "
              f"{job.shell('.venv/bin/python')}")
    script = f"""#!/usr/bin/env bash
# maxlm job {job.name}: {job.describe()}
# Written by `python -m maxlm.launch tpu-vm`; run it from the checkout it was written in.
set -euo pipefail
cd {shlex.quote(job.workdir)}
where=({shlex.join(where)})
if ! {gc} describe {job.name} "${{where[@]}}" >/dev/null 2>&1; then
  {gc} create {job.name} "${{where[@]}}" --accelerator-type {tpu.name} --version {tpu.gen.runtime}
fi
tar -czf /tmp/{job.name}-maxlm.tgz --exclude=./.venv --exclude=./.git --exclude=./runs --exclude=./.jax_cache .
{gc} scp /tmp/{job.name}-maxlm.tgz {job.name}:maxlm.tgz --worker=all "${{where[@]}}"
{gc} ssh {job.name} --worker=all "${{where[@]}}" --command {shlex.quote(remote)}
"""
    return {"tpu-vm.sh": script}, ["bash", "tpu-vm.sh"]


def slurm(job: Job, python: str, max_restarts: int, out_dir: str) -> tuple[dict[str, str], list[str]]:
    """An sbatch script: one task per node (all its GPUs) or per GPU. Tasks join through the Slurm
    variables (maxlm/distributed.py). --gpus-per-task is avoided on purpose: it hides the other GPUs of
    a node from each task and breaks jax's detection (jax#28194).

    Slurm requeues a job by itself only when it ends the job itself (a node failure, a preemption whose
    GraceTime ran out). A job that saved and exited 143 on a preemption's or the time limit's SIGTERM has
    simply ended, as FAILED, so the script requeues itself on the retry codes, as the JobSet restarts on
    GKE. Where each SIGTERM comes from and why each line is there: docs/launch.md, "Slurm: signals and
    requeues"; tests/test_slurm.py runs the script under a real Slurm."""
    retry = " ".join(map(str, SLURM_RETRY_EXIT_CODES))
    script = f"""#!/usr/bin/env bash
# maxlm job {job.name}: {job.describe()} ({job.processes_per_node} per node)
# Written by `python -m maxlm.launch slurm`; submit with `sbatch {out_dir}/job.sbatch`. run_dir must be on
# the cluster's shared file system (every node writes its checkpoint shards there).
#SBATCH --job-name={job.name}
#SBATCH --nodes={job.nodes}
#SBATCH --ntasks-per-node={job.processes_per_node}
#SBATCH --gpus-per-node={job.gpus_per_node}
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=TERM@{GRACE_S}
#SBATCH --open-mode=append
#SBATCH --output={out_dir}/slurm-%j.out
set -euo pipefail
cd {shlex.quote(job.workdir)}
export PYTHONUNBUFFERED=1
# Every attempt appends to the one log (--open-mode=append); this line starts each.
echo "maxlm.launch: job $SLURM_JOB_ID attempt $((${{SLURM_RESTART_COUNT:-0}} + 1)) on $(hostname) at $(date -Is)"
# Whether Slurm is ending the job (cancelling it, timing it out, requeueing it): it is no longer RUNNING.
# A state squeue could not read counts as running.
ending() {{ slurm_state=$(squeue -h -j "$SLURM_JOB_ID" -o %T 2>/dev/null) && [[ -n "$slurm_state" && "$slurm_state" != RUNNING ]]; }}
# A SIGTERM for this shell alone (`scancel --signal=TERM --full` or `-b`) goes on to the training
# processes, which save at the end of their step and exit 143: scancel without --full signals every step
# but this shell's. Not `kill` to srun: srun answers a SIGTERM by SIGKILLing its tasks, unsaved. A job
# that Slurm is ending sends its own SIGTERM to every process: nothing to pass on then.
trap 'ending || scancel --signal=TERM "$SLURM_JOB_ID" || true' TERM
# In the background, so that the trap runs while srun does (bash runs a trap only between commands); in
# a process group of its own (setsid), since `scancel --full` signals this shell's group, srun with it.
# --kill-on-bad-exit=0, over a cluster's KillOnBadExit=1: the processes exit one by one after a save, and
# killing the others when the first exits can cut a slow host's save short. A process that really died
# is noticed by the others, which exit 5 within watchdog_s (maxlm/distributed.py's peer monitor).
setsid --wait srun --kill-on-bad-exit=0 {job.shell(python)} &
srun_pid=$!
while kill -0 $srun_pid 2>/dev/null; do wait $srun_pid || true; done  # a trapped signal ends `wait` early
code=0
wait $srun_pid || code=$?
trap '' TERM  # nothing left to pass on
echo "maxlm.launch: the training processes exited with code $code at $(date -Is)"
# {retry}: I/O (4), a stall or a lost peer (5, or 134: the others' abort when process 0 stops), a task
# killed (137: SIGKILL, e.g. out of memory), a preemption or the time limit (143); the next attempt resumes
# from the last checkpoint. 2 and 3 (a
# mistake in the config or data, nan_policy) would only fail again. A job Slurm is ending stays ended:
# `scontrol requeue` would bring back a cancelled job.
if [[ " {retry} " == *" $code "* ]]; then
  if (( ${{SLURM_RESTART_COUNT:-0}} >= {max_restarts} )); then
    echo "maxlm.launch: not requeueing: the job has been restarted {max_restarts} times (--max-restarts)" >&2
  elif ending; then
    echo "maxlm.launch: not requeueing: Slurm is ending the job ($slurm_state)" >&2
  elif scontrol requeue "$SLURM_JOB_ID"; then
    # The job is back in the queue and this attempt is REQUEUED, whatever this script's exit code now
    # (Slurm ignores it); 0 says nothing failed here.
    echo "maxlm.launch: requeued job $SLURM_JOB_ID: the next attempt resumes from the last checkpoint"
    exit 0
  fi
fi
exit $code
"""
    return {"job.sbatch": script}, ["sbatch", "job.sbatch"]
