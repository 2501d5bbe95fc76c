"""Submit a maxlm job to GKE (JobSet or xpk), TPU VMs or Slurm: `python -m maxlm.launch` (docs/launch.md)."""
