"""The launcher: generated JobSets checked against the JobSet v1alpha2 schema and the Kubernetes pod/Job
schemas (offline), the shape of each target's job, the Slurm script run under a fake srun, the TPU VM
script under a fake gcloud, the ahead-of-time refusal, and every bad flag as one line with exit 2."""

import gzip
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import ROOT, cli_env, needs, run_cli

from maxlm.launch.__main__ import main

SCHEMA = Path(__file__).parent / "data" / "jobset" / "jobset-v1alpha2.schema.json.gz"
K8S = "1.33.0"
GCS = "run_dir=gs://bkt/runs/x"


def strict(schema):
    """The CRD's schema as `kubectl apply --validate=strict` applies it: an unknown field is an error
    (a CRD schema only prunes them), except where the schema keeps unknown fields on purpose."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if schema.get("type") == "object" and "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [strict(v) for v in schema]
    return schema


JOBSET = strict(json.loads(gzip.decompress(SCHEMA.read_bytes())))


def launch(tmp_path, *args, code=0) -> dict:
    """Run the launcher in-process (--no-compile: no libtpu here) and return the JobSet it wrote."""
    assert main([*args, "--no-compile", "--out", str(tmp_path / "out")]) == code
    return yaml.safe_load((tmp_path / "out" / "jobset.yaml").read_text()) if code == 0 else {}


def check_kubernetes(js: dict) -> None:
    jsonschema.validate(js, JOBSET)
    for rjob in js["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": rjob["template"]["spec"]}
        kubernetes_validate.validate(job, K8S, strict=True)  # the Job's and the pod template's fields and types
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": rjob["template"]["spec"]["template"]["spec"]}
        kubernetes_validate.validate(pod, K8S, strict=True)


def pod_of(js):
    (rjob,) = js["spec"]["replicatedJobs"]
    return rjob, rjob["template"]["spec"]["template"]["spec"]


@pytest.mark.malformed
def test_the_checks_catch_what_they_should(tmp_path):
    """The validators refuse a misspelled JobSet field, a wrong type, and a pod field that does not exist."""
    js = launch(tmp_path, "gke", "configs/tiny.yml", "--name", "t", "--topology", "v5p-8", "--image", "i", GCS)
    bad = json.loads(json.dumps(js))
    bad["spec"]["replicatedJob"] = bad["spec"].pop("replicatedJobs")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, JOBSET)
    bad = json.loads(json.dumps(js))
    bad["spec"]["replicatedJobs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, JOBSET)
    bad = json.loads(json.dumps(js))
    pod_of(bad)[1]["containers"][0]["resource"] = {}
    with pytest.raises(Exception, match="resource"):
        check_kubernetes(bad)


def test_one_host_v5p_8(tmp_path):
    js = launch(tmp_path, "gke", "configs/tiny.yml", "--name", "one", "--topology", "v5p-8", "--image", "img:1", GCS)
    check_kubernetes(js)
    rjob, pod = pod_of(js)
    assert (rjob["replicas"], rjob["template"]["spec"]["parallelism"], rjob["template"]["spec"]["completions"]) == (1, 1, 1)
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x2x1"}
    (c,) = pod["containers"]
    assert c["resources"]["limits"] == {"google.com/tpu": 4} and c["image"] == "img:1"
    # what the run writes stays gs://, written natively; nothing is mounted for it
    assert c["command"] == ["python", "train.py", "configs/tiny.yml", "run_dir=gs://bkt/runs/x"]
    assert c["volumeMounts"] == [] and pod["volumes"] == []
    assert {"name": "MAXLM_JOB", "value": "one"} in c["env"]
    assert js["metadata"]["annotations"] == {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}


def test_multi_host_v5p_64(tmp_path):
    js = launch(tmp_path, "gke", "configs/tiny.yml", "--name", "multi", "--topology", "v5p-64", "--image", "i",
                "global_batch_size=32", GCS)
    check_kubernetes(js)
    rjob, pod = pod_of(js)
    spec = rjob["template"]["spec"]
    assert (rjob["replicas"], spec["parallelism"], spec["completions"], spec["backoffLimit"]) == (1, 8, 8, 0)
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4x4"
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": 4}
    assert pod["hostNetwork"] is True and pod["restartPolicy"] == "Never"
    # TPU pods join through what GKE injects (TPU_WORKER_*, MEGASCALE_*), not through our variables
    assert [e["name"] for e in pod["containers"][0]["env"]] == ["PYTHONUNBUFFERED", "MAXLM_JOB"]
    # a mistake (exit 2) or nan_policy (exit 3) ends the JobSet; anything else restarts it
    assert spec["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2, 3]
    assert js["spec"]["failurePolicy"]["rules"][0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 10


def test_two_slice_v6e_256(tmp_path):
    js = launch(tmp_path, "gke", "configs/tiny.yml", "--name", "ms", "--topology", "v6e-256", "--slices", "2",
                "--image", "i", "mesh.data=2", "global_batch_size=512", GCS)
    check_kubernetes(js)
    rjob, pod = pod_of(js)
    assert (rjob["replicas"], rjob["template"]["spec"]["parallelism"]) == (2, 64)
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                   "cloud.google.com/gke-tpu-topology": "16x16"}
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": 4}
    assert pod["containers"][0]["command"][3:] == ["mesh.data=2", "global_batch_size=512", GCS, "mesh.slices=2"]


def test_two_gpu_nodes_of_8(tmp_path):
    js = launch(tmp_path, "gke", "configs/tiny.yml", "--name", "gpu", "--nodes", "2", "--gpus-per-node", "8",
                "--image", "i", GCS)
    check_kubernetes(js)
    rjob, pod = pod_of(js)
    assert (rjob["name"], rjob["replicas"], rjob["template"]["spec"]["parallelism"]) == ("node", 1, 2)
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["containers"][0]["env"]}
    assert env["JAX_COORDINATOR_ADDRESS"] == "gpu-node-0-0.gpu:8476"  # JobSet's DNS name of pod 0
    assert env["JAX_NUM_PROCESSES"] == "2"
    assert env["JAX_PROCESS_ID"] == {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    assert "annotations" not in js["metadata"]


def test_xpk_command(tmp_path, capsys):
    assert main(["xpk", "configs/tiny.yml", "--name", "x", "--topology", "v5p-64", "--slices", "2", "--cluster", "c",
                 "--image", "i", "mesh.data=2", "global_batch_size=64", GCS, "data.source=text",
                 "data.path=gs://data/docs.txt", "--no-compile", "--out", str(tmp_path)]) == 0
    script = (tmp_path / "xpk.sh").read_text()
    assert ("xpk workload create --cluster c --workload x --docker-image i --tpu-type v5p-64 --num-slices 2 "
            "--max-restarts 10 --restart-on-exit-codes 4,5,143 --termination-grace-period-seconds 300 --storage x-gcs-0 "
            "--command 'MAXLM_JOB=x python train.py configs/tiny.yml mesh.data=2 global_batch_size=64 run_dir=gs://bkt/runs/x "
            "data.source=text mesh.slices=2 data.path=/gcs/data/docs.txt'") in script
    # only the input's bucket is mounted, read-only; run_dir stays gs://
    assert ("xpk storage attach x-gcs-0 --cluster c --type gcsfuse --bucket data --mount-point /gcs/data "
            "--readonly true") in script
    assert subprocess.run(["bash", "-n", tmp_path / "xpk.sh"]).returncode == 0
    assert f"submit with:\n  bash {tmp_path}/xpk.sh" in capsys.readouterr().out


def fake_tools(tmp_path: Path, **scripts) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_tpu_vm_script_names_every_worker(tmp_path):
    assert main(["tpu-vm", "configs/tiny.yml", "--name", "vm", "--topology", "v5p-32", "--zone", "us-east5-a",
                 "global_batch_size=16", GCS, "--no-compile", "--out", str(tmp_path / "out")]) == 0
    calls = tmp_path / "calls.txt"
    # `describe` fails: the VM does not exist yet, so the script creates it
    env = fake_tools(tmp_path, gcloud=f'printf "%s\\n" "$*" >> {calls}; [[ "$4" != describe ]]\n')
    r = subprocess.run(["bash", tmp_path / "out" / "tpu-vm.sh"], env={**os.environ, **env}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = calls.read_text().splitlines()
    assert [line.split()[3] for line in lines] == ["describe", "create", "scp", "ssh"]
    assert "--accelerator-type v5p-32 --version v2-alpha-tpuv5" in lines[1]
    assert all("--worker=all" in line for line in lines[2:]) and all("--zone us-east5-a" in line for line in lines)
    assert "gcsfuse" not in lines[3]  # nothing to mount: run_dir is written natively
    assert "MAXLM_JOB=vm .venv/bin/python train.py configs/tiny.yml global_batch_size=16 run_dir=gs://bkt/runs/x" in lines[3]


SBATCH = """# fake sbatch: run the script as Slurm would start it on the first node
script=$1
nodes=$(sed -n 's/^#SBATCH --nodes=//p' "$script"); per=$(sed -n 's/^#SBATCH --ntasks-per-node=//p' "$script")
SLURM_JOB_ID=4242 SLURM_JOB_NUM_NODES=$nodes SLURM_NTASKS_PER_NODE=$per SLURM_NTASKS=$((nodes * per)) \
SLURM_JOB_NODELIST=localhost exec bash "$script"
"""
SRUN = """# fake srun: start SLURM_NTASKS copies of the command here, with Slurm's per-task variables
while [[ $1 == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NODELIST=localhost SLURM_STEP_NUM_NODES=1 \
  SLURM_STEP_TASKS_PER_NODE=$SLURM_NTASKS "$@" > "$LOGS/task$i.txt" 2>&1 & pids+=($!)
done
rc=0; for p in "${pids[@]}"; do wait $p || rc=$?; done; exit $rc
"""


def test_slurm_script(tmp_path, capsys):
    assert main(["slurm", "configs/tiny.yml", "--name", "s", "--nodes", "2", "--gpus-per-node", "8",
                 "--process-per", "gpu", "--no-compile", "--out", str(tmp_path)]) == 0
    assert "job s: 2 node(s) x 8 GPUs = 16 GPUs, 16 process(es); mesh and batch fit" in capsys.readouterr().out
    text = (tmp_path / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append"):
        assert line in text.splitlines()
    assert "--gpus-per-task" not in text.replace("--gpus-per-task is", "")
    assert f"setsid --wait srun --kill-on-bad-exit=0 {sys.executable} train.py configs/tiny.yml" in text
    assert subprocess.run(["bash", "-n", tmp_path / "job.sbatch"]).returncode == 0


def test_processes_are_counted_per_gpu(tmp_path, capsys):
    """--process-per gpu: 8 processes on 1 node, in the summary line. 4 sequences feed them: with
    mesh.tensor=4 the processes hold the same rows in fours, and each loads them whole (as both processes
    of test_distributed.py's context ring load every row)."""
    args = ["configs/tiny.yml", "--name", "s", "--nodes", "1", "--gpus-per-node", "8", "mesh.tensor=4",
            "global_batch_size=4", "--no-compile", "--out", str(tmp_path / "out")]
    assert main(["slurm", *args, "--process-per", "gpu"]) == 0
    assert "job s: 1 node(s) x 8 GPUs = 8 GPUs, 8 process(es); mesh and batch fit" in capsys.readouterr().out
    assert "#SBATCH --ntasks-per-node=8" in (tmp_path / "out" / "job.sbatch").read_text().splitlines()
    assert main(["slurm", *args]) == 0
    assert "job s: 1 node(s) x 8 GPUs = 8 GPUs, 1 process(es); mesh and batch fit" in capsys.readouterr().out


# The job script's own logic, under a fake srun that records the signals it gets and exits with $CODE once
# released (by the fake scancel, as training processes exit once they have saved), and fake scancel and
# scontrol that record their calls. tests/test_slurm.py runs the same script under a real Slurm (slow).
SLURM_FAKES = {
    "srun": 'echo "srun $1" >> "$CALLS"\ntrap \'echo "srun got SIGTERM" >> "$CALLS"\' TERM\n'
            'while [[ -n "${HOLD:-}" && ! -e "$HOLD" ]]; do sleep 0.05; done\nexit "$CODE"\n',
    "scancel": 'echo "scancel $*" >> "$CALLS"\ntouch "$HOLD"\n',
    "scontrol": 'echo "scontrol $*" >> "$CALLS"\nexit "${SCONTROL_CODE:-0}"\n',
    "squeue": '[[ -n "${STATE-RUNNING}" ]] && echo "${STATE-RUNNING}"\n',
}


def slurm_job(tmp_path, **env) -> tuple[subprocess.Popen, Path]:
    """Start the launcher's script as sbatch would, in a process group of its own (as slurmstepd does)."""
    assert main(["slurm", "configs/tiny.yml", "--name", "s", "--nodes", "1", "--gpus-per-node", "2", "--process-per",
                 "gpu", "--no-compile", "--max-restarts", "3", "--out", str(tmp_path / "out")]) == 0
    calls = tmp_path / "calls.txt"
    env = {**os.environ, **fake_tools(tmp_path, **SLURM_FAKES), "SLURM_JOB_ID": "4242", "CALLS": str(calls), **env}
    p = subprocess.Popen(["bash", tmp_path / "out" / "job.sbatch"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return p, calls


@pytest.mark.malformed
@pytest.mark.parametrize("code, restarts, state, scontrol, requeued, exit_code", [
    (0, 0, "RUNNING", 0, False, 0),        # done
    (2, 0, "RUNNING", 0, False, 2),        # a mistake: a restart would fail the same way
    (3, 0, "RUNNING", 0, False, 3),        # nan_policy
    (143, 0, "RUNNING", 0, True, 0),       # saved on SIGTERM: requeued, and the attempt is not a failure
    (5, 2, "RUNNING", 0, True, 0),         # a stall, 2 restarts so far of --max-restarts 3
    (134, 0, "RUNNING", 0, True, 0),       # process 0 stopped (exit 5) and the runtime aborted the others
    (137, 0, "RUNNING", 0, True, 0),       # a task killed (kill -9, the OOM killer): srun reports 137
    (137, 3, "RUNNING", 0, False, 137),    # ... bounded by --max-restarts like the others
    (1, 0, "RUNNING", 0, False, 1),        # an exception: a bug, not something a restart cures
    (4, 3, "RUNNING", 0, False, 4),        # I/O, but --max-restarts is reached
    (143, 0, "COMPLETING", 0, False, 143),  # cancelled (or timed out): a requeue would undo the cancel
    (143, 0, "", 0, True, 0),              # squeue could not say: requeued, as if running
    (143, 0, "RUNNING", 1, False, 143),    # the requeue refused (e.g. --no-requeue): the code stands
])
def test_slurm_script_requeues_on_retry_codes(tmp_path, code, restarts, state, scontrol, requeued, exit_code):
    p, calls = slurm_job(tmp_path, CODE=str(code), SLURM_RESTART_COUNT=str(restarts), STATE=state,
                         SCONTROL_CODE=str(scontrol))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == exit_code, out
    assert f"maxlm.launch: job 4242 attempt {restarts + 1} on " in out
    assert f"maxlm.launch: the training processes exited with code {code} at " in out
    tried = code in (4, 5, 134, 137, 143) and restarts < 3 and state != "COMPLETING"
    assert ("scontrol requeue 4242" in calls.read_text()) == tried
    assert ("maxlm.launch: requeued job 4242" in out) == requeued


def test_slurm_script_passes_a_sigterm_on_and_keeps_it_from_srun(tmp_path):
    """`scancel --signal=TERM --full` signals the batch shell's process group. The script passes the signal
    to the training processes with scancel (steps only), and srun, in a group of its own, never gets it:
    srun answers a SIGTERM by SIGKILLing its tasks."""
    p, calls = slurm_job(tmp_path, CODE="143", HOLD=str(tmp_path / "saved"))
    deadline = time.monotonic() + 30
    while not (calls.exists() and "srun" in calls.read_text()):
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()[0]
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert calls.read_text().splitlines()[1:] == ["scancel --signal=TERM 4242", "scontrol requeue 4242"]
    assert "maxlm.launch: requeued job 4242" in out


@pytest.mark.slow  # two trainings (~1 min): the joining end is in the fast suite's test_distributed
def test_slurm_script_trains_two_processes_like_one(tmp_path):
    """1 node x 2 'GPUs' (one process each, 4 CPU devices per process) under fake sbatch/srun: the same
    losses as 1 process x 8 devices."""
    model = ["model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=4", "model.n_kv_heads=2",
             "model.head_dim=16", "seq_len=32", "global_batch_size=8", "steps=6", "log_every=1", "sample_tokens=0"]
    ref = run_cli("configs/tiny.yml", *model, f"run_dir={tmp_path / 'ref'}")
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert main(["slurm", "configs/tiny.yml", *model, f"run_dir={tmp_path / 'run'}", "--name", "s", "--nodes", "1",
                 "--gpus-per-node", "2", "--process-per", "gpu", "--no-compile", "--out", str(tmp_path / "out")]) == 0
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**cli_env(devices=4), **fake_tools(tmp_path, sbatch=SBATCH, srun=SRUN), "LOGS": str(logs)}
    r = subprocess.run(["sbatch", tmp_path / "out" / "job.sbatch"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    out = (logs / "task0.txt").read_text()
    assert r.returncode == 0, out[-3000:] + (logs / "task1.txt").read_text()[-2000:]
    assert "process 0 of 2 (Slurm); 4 local of 8 devices" in out

    def losses(d):
        return [json.loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert losses(tmp_path / "run") == pytest.approx(losses(tmp_path / "ref"), rel=1e-6)


@pytest.mark.malformed
@pytest.mark.parametrize("args, message", [
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image", "i"],
     "run_dir `runs/tiny` is local, but a gke job needs shared storage"),
    (["tpu-vm", "configs/tiny.yml", "--name", "a", "--topology", "v5p-64", "--zone", "z", "global_batch_size=32"],
     "run_dir `runs/tiny` is local, but a tpu-vm job needs shared storage (every host must write the same checkpoint"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-7", "--image", "i", GCS],
     "--topology `v5p-7` is not a v5p slice maxlm knows"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-64", "--image", "i", GCS],
     "must be divisible by the data-parallel size data*fsdp*expert = 32"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-16", "--slices", "2", "--image", "i", GCS],
     "`mesh.data`=1 must be a multiple of `mesh.slices`=2"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--nodes", "2", "--image", "i", GCS],
     "give either --topology (TPU) or --nodes and --gpus-per-node (GPU), not both"),
    (["gke", "configs/tiny.yml", "--name", "a", "--image", "i", GCS], "the job's shape is missing"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", GCS], "gke runs a container: pass --image"),
    (["gke", "configs/tiny.yml", "--name", "Bad_Name", "--topology", "v5p-8", "--image", "i", GCS], "--name `Bad_Name`"),
    # a final newline passed a `$` match; in a Slurm script the header's rest became a command above #SBATCH
    (["slurm", "configs/tiny.yml", "--name", "a\n", "--nodes", "1", "--gpus-per-node", "8"], "--name 'a\\n': use 1-40"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image", "img:1\n", GCS],
     "--image 'img:1\\n' is not a container image reference"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image", "img:1 --privileged", GCS],
     "--image `img:1 --privileged` is not a container image reference"),
    # --no-compile (every row) skips the compile target's check, not this one: no node has that label
    (["gke", "configs/tiny.yml", "--name", "a", "--nodes", "1", "--gpus-per-node", "8", "--image", "i", "--gpu",
      "quantum-9000", GCS], "--gpu `quantum-9000` is not a GKE GPU type; the pods would select nodes labelled"),
    (["xpk", "configs/tiny.yml", "--name", "a", "--nodes", "1", "--gpus-per-node", "8", "--image", "i", "--gpu",
      "nvidia-h100-80g", "--cluster", "c", GCS], "--gpu `nvidia-h100-80g` is not a GKE GPU type (did you mean nvidia-h100-80gb?)"),
    # inputs a pod or TPU VM cannot see: outside the checkout, and not gs://
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image", "i", GCS, "data.source=text",
      "data.path=/srv/corpus.txt"], "`data.path` /srv/corpus.txt is outside this checkout (" ),
    (["xpk", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image", "i", "--cluster", "c", GCS,
      "data.tokenizer=/opt/tok/tokenizer.json"], "`data.tokenizer` /opt/tok/tokenizer.json is outside this checkout"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image", "i", GCS, "init_from=../ckpt/run1"],
     "pods see only the checkout and gs://: copy it to a bucket and pass init_from=gs://BUCKET/PATH, or move it"),
    (["tpu-vm", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--zone", "z", "data.source=text",
      "data.path=[data/a.txt,/srv/b.txt]"], "`data.path` /srv/b.txt is outside this checkout"),
    (["slurm", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8"], "slurm runs GPU jobs"),
    (["slurm", "configs/tiny.yml", "--name", "a", "--nodes", "1", "--gpus-per-node", "8", GCS],
     "run_dir `gs://bkt/runs/x` is a URL; a slurm job writes run_dir on the cluster's shared file system"),
    (["xpk", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image", "i", GCS], "xpk needs --cluster"),
    (["tpu-vm", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8"], "tpu-vm needs --zone"),
    (["tpu-vm", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--slices", "2", "--zone", "z"],
     "multi-slice TPU VMs need queued resources"),
    (["k8s", "configs/tiny.yml", "--name", "a"], "unknown target `k8s`"),
    (["gke", "/etc/passwd", "--name", "a", "--topology", "v5p-8", "--image", "i"], "config `/etc/passwd`: give a path inside"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image", "i", GCS, "mesh.slices=2"],
     "the job's slices come from --slices"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image", "i", GCS, "stepz=3"],
     "unknown config key `stepz`; did you mean `steps`?"),
    (["slurm", "configs/tiny.yml", "--name", "a", "--nodes", "3", "--gpus-per-node", "8"],
     "must be divisible by the data-parallel size data*fsdp*expert = 24"),
    (["gke", "configs/tiny.yml", "--topology", "v5p-8"], "the following arguments are required: --name"),
    (["gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image", "i", GCS, "--slices", "x"],
     "argument --slices: must be a whole number >= 1, got 'x'"),
    (["slurm", "configs/tiny.yml", "--name", "a", "--nodes", "0", "--gpus-per-node", "8"],
     "argument --nodes: must be a whole number >= 1, got 0"),  # was "the job's shape is missing"
    (["slurm", "configs/tiny.yml", "--name", "a", "--nodes", "1", "--gpus-per-node", "8", "--gpu", "nvidia-b200"],
     "--gpu is the GKE accelerator label of gke and xpk jobs; a slurm job does not read it"),  # was ignored
])
def test_bad_flags_are_one_line_and_nothing_is_written(tmp_path, capsys, args, message):
    assert main([*args, "--no-compile", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("maxlm.launch: error: ") and message in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.malformed
def test_an_empty_out_is_refused_not_read_as_the_current_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["slurm", str(ROOT / "configs/tiny.yml"), "--name", "a", "--nodes", "1", "--gpus-per-node", "8",
                 "--no-compile", "--out", ""]) == 2
    assert capsys.readouterr().err.strip() == ("maxlm.launch: error: argument --out: is empty; give a path (see python "
                                               "-m maxlm.launch --help)")
    assert not list(tmp_path.iterdir())


def test_inputs_inside_the_checkout_and_gs_are_kept(tmp_path):
    """Local inputs inside the checkout are in the image, gs:// ones are mounted: both are accepted."""
    js = launch(tmp_path, "gke", "configs/tiny.yml", "--name", "a", "--topology", "v5p-8", "--image",
                "us-docker.pkg.dev/p/r/maxlm:v1@sha256:" + "0" * 64, GCS, "data.source=text", "data.path=docs/data.md",
                "data.tokenizer=gs://tok/tokenizer.json")
    (c,) = pod_of(js)[1]["containers"]
    assert c["command"][-2:] == ["data.path=docs/data.md", "data.tokenizer=/gcs/tok/tokenizer.json"]


@pytest.mark.malformed
@pytest.mark.parametrize("out", ["o\nrm -rf x", "o p"])
def test_a_slurm_out_dir_that_would_break_the_script_is_refused(tmp_path, capsys, out):
    """--out is written into #SBATCH --output= and a comment: a newline would end the line, a space split it."""
    assert main(["slurm", "configs/tiny.yml", "--name", "a", "--nodes", "1", "--gpus-per-node", "8", "--no-compile",
                 "--out", str(tmp_path / out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds whitespace or a control character; choose a directory without" in err[0], err
    assert os.listdir(tmp_path) == []


@pytest.mark.malformed
def test_submit_without_the_tool_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "maxlm.launch", "slurm", "configs/tiny.yml", "--name", "a", "--nodes", "1",
                        "--gpus-per-node", "8", "--submit", "--out", str(tmp_path / "o")], cwd=ROOT,
                       env={**cli_env(), "PATH": "/nonexistent"}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"maxlm.launch: error: --submit needs `sbatch` on PATH, and it is not there; "
                                             f"install it, or submit the files yourself: sbatch {tmp_path}/o/job.sbatch"]


@pytest.mark.malformed
@pytest.mark.slow  # 14 s of TPU compiles; the dry-run path it calls is covered fast in test_aot.py
def test_compiles_for_the_topology_and_refuses_a_job_that_does_not_fit(tmp_path):
    """Before anything is written, the train step is compiled for 2 x v5litepod-4; a model that needs more HBM
    than a v5e chip has is refused with the memory figures."""
    ok = subprocess.run([sys.executable, "-m", "maxlm.launch", "gke", "configs/tiny.yml", "--name", "fits",
                         "--topology", "v5litepod-4", "--slices", "2", "--image", "i", "mesh.data=2", GCS,
                         "--out", str(tmp_path / "ok")], cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "2 slices joined over data" in ok.stdout and "and fits in HBM" in ok.stdout
    big = ["model.d_model=8192", "model.d_ff=32768", "model.n_heads=64", "model.n_kv_heads=8", "model.head_dim=128"]
    r = subprocess.run([sys.executable, "-m", "maxlm.launch", "gke", "configs/tiny.yml", "--name", "big",
                        "--topology", "v5e-4", "--image", "i", *big, GCS, "--out", str(tmp_path / "big")], cwd=ROOT,
                       env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    # the TPU compiler's own figures: what the step needs and what a v5e chip has
    assert re.match(r"maxlm.launch: error: the train step does not fit in device memory: .*\(\d+\.\d+G\) exceeds "
                    r"available HBM \(15.75G\)", last), last
    assert not (tmp_path / "big").exists()


needs_cuda_plugin = needs(os.path.isdir(os.environ.get("MAXLM_CUDA_PLUGIN", "")),
                          reason="jax's CUDA plugin is not installed (make test installs it in .venv/cuda)")


@needs_cuda_plugin
def test_a_gpu_job_is_compiled_for_its_nodes_before_anything_is_written(tmp_path):
    """The launcher compiles a GPU job as a TPU job, in a child process (jax's CUDA plugin registers only when
    jax starts), and shows the memory per GPU. The job is GPT-2 at full size in FP8 on 2 nodes of 4 H100s: the
    fast suite's compile of a real model config for an H100 node (test_gpu_models.py compiles the others, in
    the slow suite), with maxlm's flash kernels. Compiled without a GPU, XLA emits no cuBLAS GEMM of any type,
    so the check that its GEMMs are cuBLASLt's FP8 ones waits for the GPU (it refused every FP8 GPU job here
    until 2026-11-27), while the FP8 casts are checked."""
    r = subprocess.run([sys.executable, "-m", "maxlm.launch", "slurm", "configs/models/gpt2.yml", "--name", "g", "--nodes",
                        "2", "--gpus-per-node", "4", "quantization=fp8", "dtype=bfloat16", "--out", str(tmp_path / "ok")],
                       cwd=ROOT, env=cli_env(1), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert re.search(r"^maxlm: fp8: the compiled step casts to f8e4m3fn [1-9]\d* times and to f8e5m2 [1-9]\d* times; "
                     r"compiled without a GPU, where XLA emits no cuBLAS GEMM of any type", r.stdout, re.M), r.stdout[-3000:]
    assert "compiling the train step for h100-4x2 (2 node(s) x 4 GPUs = 8 GPUs, 2 process(es)) in a child process" in r.stdout
    assert "over 8 x NVIDIA H100 80GB HBM3" in r.stdout and "config:" not in r.stdout
    assert "attention: flash (auto on gpu)" in r.stdout and "parameters 124,439,808 " in r.stdout
    total = re.search(r"^ +total +([\d.]+) GiB", r.stdout, re.M)
    limit = re.search(r"^  limit +([\d.]+) GiB \(75% of the NVIDIA H100", r.stdout, re.M)
    assert total and limit and float(total[1]) < float(limit[1]), r.stdout[-3000:]
    assert "the train step compiles for 2 node(s) x 4 GPUs = 8 GPUs, 2 process(es) and fits in GPU memory" in r.stdout
    assert (tmp_path / "ok" / "job.sbatch").exists()


@pytest.mark.malformed
def test_a_gpu_job_without_the_cuda_plugin_is_refused_with_the_fix(tmp_path):
    r = subprocess.run([sys.executable, "-m", "maxlm.launch", "slurm", "configs/tiny.yml", "--name", "g", "--nodes", "1",
                        "--gpus-per-node", "8", "--out", str(tmp_path / "o")], cwd=ROOT,
                       env={**cli_env(1), "MAXLM_CUDA_PLUGIN": str(tmp_path / "none")}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("maxlm.launch: error: the train step does not compile for h100-8x1: cannot compile for "
                           "h100-8x1 (") and "a GPU compile needs jax's CUDA plugin: pip install --no-deps " in last
    assert last.endswith("; or pass --no-compile to skip the check"), last
    assert not (tmp_path / "o").exists()
    gke = subprocess.run([sys.executable, "-m", "maxlm.launch", "gke", "configs/tiny.yml", "--name", "g", "--nodes", "1",
                          "--gpus-per-node", "8", "--image", "i", "--gpu", "nvidia-l4", GCS, "--out", str(tmp_path / "o")],
                         cwd=ROOT, env=cli_env(1), capture_output=True, text=True, timeout=300)
    assert gke.returncode == 2 and gke.stderr.strip().splitlines()[-1] == (
        "maxlm.launch: error: maxlm has no compile target for --gpu nvidia-l4 (it has h100, h200, b200); pass "
        "--no-compile to submit without compiling")


@pytest.mark.malformed
def test_a_submit_the_tool_refuses_ends_with_a_launcher_line(tmp_path):
    """kubectl installed but no cluster: its own message, then one line saying the job was not submitted
    and where its files are."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text("#!/bin/sh\necho 'error: no context is set' >&2\nexit 1\n")
    (bin_dir / "kubectl").chmod(0o755)
    r = subprocess.run([sys.executable, "-m", "maxlm.launch", "gke", "configs/tiny.yml", "--name", "a", "--topology",
                        "v5p-8", "--image", "i", GCS, "--no-compile", "--submit", "--out", str(tmp_path / "o")], cwd=ROOT,
                       env={**cli_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}"}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: no context is set",
        f"maxlm.launch: error: `kubectl apply -f {tmp_path}/o/jobset.yaml` failed (exit 1), so the job was not "
        f"submitted; its files are in {tmp_path}/o: fix what kubectl reports above (its cluster, credentials or "
        f"project) and run that command again"]
    assert (tmp_path / "o" / "jobset.yaml").exists()
