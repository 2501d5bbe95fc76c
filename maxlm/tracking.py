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
MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")  # what wandb.Settings(mode=) accepts
DEFAULT_URL = "https://api.wandb.ai"
PROBE_S = 10  # the W&B server must answer within this long, before anything compiles


def check(tracking) -> None:
    """Before anything compiles: the package, WANDB_MODE, and (unless W&B runs offline) a login and a W&B
    server that answers. One line each: exit 2 for a mistake, 4 (StorageError) for a server out of reach."""
    if "wandb" not in tracking:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("`tracking` names wandb, but the wandb package is not installed: pip install -r "
                          "requirements-wandb.txt, or drop wandb from `tracking`") from None
    mode = os.environ.get("WANDB_MODE", "online")
    if mode not in MODES:
        raise ConfigError(f"WANDB_MODE={mode!r} is not a W&B mode: set it to one of {', '.join(MODES)} (offline: "
                          f"`wandb sync` the run later), or unset it")
    if mode in NO_LOGIN_MODES:
        return
    if not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or _netrc_key()):
        raise ConfigError("`tracking` names wandb, but this machine is not logged in to W&B: run `wandb login`, set "
                          "WANDB_API_KEY, or set WANDB_MODE=offline and `wandb sync` the run later")
    _reach(os.environ.get("WANDB_BASE_URL", DEFAULT_URL))


def _reach(url: str) -> None:
    """Any HTTP answer from the W&B server will do (a 404 is an answer); no answer within PROBE_S is a
    StorageError (exit 4: the launchers retry it), not W&B's own CommError after the compile."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=PROBE_S).close()
    except urllib.error.HTTPError:
        return
    except ValueError:
        raise ConfigError(f"WANDB_BASE_URL={url!r} is not a URL: set it to the W&B server's address "
                          f"(default {DEFAULT_URL})") from None
    except OSError as e:  # URLError (DNS, refused, TLS), a timeout
        why = getattr(e, "reason", None) or e
        raise storage.StorageError(f"`tracking` names wandb, but the W&B server {url} did not answer ({why}); check "
                                   f"the network or WANDB_BASE_URL, or set WANDB_MODE=offline and `wandb sync` the run "
                                   f"later") from None


def _first_line(e) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


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
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "maxlm"), id=run_id, resume="allow",
                                  name=run_dir.rstrip("/").rsplit("/", 1)[-1], config=config, dir=where,
                                  settings=wandb.Settings(console="off", quiet=True))
        except wandb.errors.AuthenticationError as e:
            raise ConfigError(f"W&B refused the login: {_first_line(e)}; run `wandb login` again or fix "
                              f"WANDB_API_KEY") from None
        except wandb.errors.CommError as e:  # the server stopped answering since check() reached it
            raise storage.StorageError(f"W&B: {_first_line(e)}; check the network or WANDB_BASE_URL, or set "
                                       f"WANDB_MODE=offline and `wandb sync` the run later") from None
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
