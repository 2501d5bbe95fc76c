"""Weights & Biases, beside metrics.jsonl and TensorBoard (`tracking: [tensorboard, wandb]`).

The W&B run's id is kept in the run directory (wandb.json), so a resume continues the same W&B run
wherever the directory is now, and a run started over (step 0) is a new W&B run. A resumed attempt
re-trains the steps after its checkpoint bit for bit; those already logged are not logged again, so each
step is logged once. Only process 0 logs. Project, entity and mode come from W&B's own variables
(WANDB_PROJECT, default `maxlm`; WANDB_ENTITY; WANDB_MODE=offline, synced later with `wandb sync`).
"""

import io
import json
import math
import netrc
import os
import tempfile
import urllib.parse
import uuid

from maxlm import storage
from maxlm.errors import ConfigError

ID_FILE = "wandb.json"
NO_LOGIN_MODES = ("offline", "disabled", "dryrun")


def check(tracking) -> None:
    """Before anything compiles: the package, and a login unless W&B runs offline. One line each."""
    if "wandb" not in tracking:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("`tracking` names wandb, but the wandb package is not installed: pip install -r "
                          "requirements-wandb.txt, or drop wandb from `tracking`") from None
    if os.environ.get("WANDB_MODE", "online") in NO_LOGIN_MODES:
        return
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or _netrc_key():
        return
    raise ConfigError("`tracking` names wandb, but this machine is not logged in to W&B: run `wandb login`, set "
                      "WANDB_API_KEY, or set WANDB_MODE=offline and `wandb sync` the run later")


def _netrc_key() -> bool:
    # Where `wandb login` keeps the key: a .netrc entry for the W&B API host.
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Wandb:
    """One attempt's W&B run. `logged_through`: the last step a previous attempt logged (its metrics rows,
    before they were trimmed to the checkpoint); steps up to it are skipped."""

    def __init__(self, run_dir: str, start_step: int, logged_through: int, config: dict, log):
        import wandb

        run_dir = str(run_dir)
        saved = storage.read_text(storage.join(run_dir, ID_FILE)) if start_step else None
        run_id = json.loads(saved)["id"] if saved else uuid.uuid4().hex[:12]
        # W&B's files: in the run directory, or (gs://) a local directory whose run W&B itself uploads
        where = os.environ.get("WANDB_DIR") or (tempfile.mkdtemp(prefix="maxlm-wandb-") if storage.is_gcs(run_dir)
                                                else run_dir)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "maxlm"), id=run_id, resume="allow",
                              name=run_dir.rstrip("/").rsplit("/", 1)[-1], config=config, dir=where,
                              settings=wandb.Settings(console="off", quiet=True))
        if not saved:
            storage.write(storage.join(run_dir, ID_FILE), json.dumps({"id": run_id}) + "\n")
        # Online, W&B knows the run's last step; offline it does not, and the metrics rows stand in.
        self.through = max(logged_through, self.run.step - 1 if self.run.resumed else 0) if start_step else 0
        again = f"; steps {start_step + 1}-{self.through} were logged by the previous attempt" if self.through > start_step else ""
        log(f"wandb: run {run_id} ({'continued' if saved else 'new'}) in project {self.run.project}, "
            f"mode {self.run.settings.mode}{again}")

    def log(self, step: int, m: dict) -> None:
        if step <= self.through:
            return
        row = {}
        for k, v in m.items():
            for name, x in ([(f"{k}/{i}", x) for i, x in enumerate(v)] if isinstance(v, list) else [(k, v)]):
                if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                    row[name] = x
        self.run.log(row, step=step)

    def finish(self, png: bytes | None) -> None:
        """The loss plot (as the run ends), then the run's files are closed (and, online, uploaded)."""
        if png is not None:
            import wandb
            from PIL import Image

            self.run.log({"loss_plot": wandb.Image(Image.open(io.BytesIO(png)))})
        self.run.finish()
