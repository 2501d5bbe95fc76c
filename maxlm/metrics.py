"""FLOPs, MFU, and the run's outputs: metrics.jsonl, TensorBoard scalars, a progress bar, loss.png.

FLOPs per token (training = forward + backward = 3x forward, remat recompute not counted):
    6 * N_matmul                      N_matmul = every weight used in a matmul (all layers + unembedding;
                                      the input embedding is a lookup and is excluded)
  + 12 * n_layers * n_heads * head_dim * seq_len     attention scores and values, non-causal
    (the causal convention counts half of that: 6 * n_layers * n_heads * head_dim * seq_len; a sliding
    window of w counts its layers' w - w^2 / (2 seq_len) keys per query instead of seq_len / 2)
MFU = achieved model FLOP/s per device / the device's peak dense bf16 FLOP/s. We report MFU with the
causal count (the work a causal kernel must do); `flops_per_token(..., causal=False)` gives PaLM's.
"""

import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from maxlm import models, storage

# Peak dense bf16 FLOP/s per chip, from vendor datasheets (no sparsity).
PEAK_BF16 = {
    "H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12,
    "TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
    "TPU v6 lite": 918e12, "TPU v6e": 918e12,
}


def matmul_params(m) -> int:
    """N_matmul of the formula above, as the family counts it (maxlm.models.decoder.matmul_params)."""
    return models.get(m.family).matmul_params(m)


def flops_per_token(m, seq_len: int, causal: bool = True) -> float:
    def keys(window):  # keys per query, averaged over the sequence
        w = min(window or seq_len, seq_len)
        # causal: about the mean of min(i + 1, w); exactly seq_len / 2 when w = seq_len, as without a window
        return w - w * w / (2 * seq_len) if causal else w
    local = models.get(m.family).windowed_layers(m)  # layers whose queries see model.sliding_window keys
    # q.k over head_dim, p.v over the value width (MLA's v_dim may be narrower): 6 FLOPs per weight each
    width = m.head_dim + (m.mla.v_dim or m.head_dim)
    attn = 6 * m.n_heads * width * (local * keys(m.sliding_window) + (m.n_layers - local) * keys(0))
    return 6 * matmul_params(m) + attn


def peak_flops(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s for a device kind, or None when unknown (CPU, unlisted chips)."""
    for name in sorted(PEAK_BF16, key=len, reverse=True):
        if name.lower() in device_kind.lower():
            return PEAK_BF16[name]
    return None


class ExpertLoad:
    """MoE load, from each step's `moe_load` [n_layers, n_experts] (assignments per expert): per-layer min,
    max and coefficient of variation (std / mean, 0 when perfectly even) for the metrics row, and a log
    line, once per expert, when one has received no tokens for `idle_steps` steps in a row."""

    def __init__(self, idle_steps: int = 100):
        self.idle_steps, self.idle, self.said = idle_steps, None, set()

    def __call__(self, load_LE) -> tuple[dict, list[str]]:
        load_LE = np.asarray(load_LE, np.float64)
        cv_L = load_LE.std(-1) / np.maximum(load_LE.mean(-1), 1e-9)
        fields = {"moe_load_min": load_LE.min(-1).tolist(), "moe_load_max": load_LE.max(-1).tolist(),
                  "moe_load_cv": cv_L.round(4).tolist(), "moe_load_cv_max": float(cv_L.max())}
        self.idle = np.where(load_LE == 0, (0 if self.idle is None else self.idle) + 1, 0)
        lines = []
        for layer, e in zip(*np.nonzero(self.idle >= self.idle_steps)):
            if (layer, e) not in self.said:
                self.said.add((layer, e))
                lines.append(f"moe: expert {e} of layer {layer} has received no tokens for {self.idle_steps} steps "
                             f"(a dead expert; router_bias_rate or router_aux_loss balance the load)")
        return fields, lines


def summaries() -> dict:
    """What the loop makes of a step's metrics that are arrays, by name: fields for the row, and log lines."""
    return {"moe_load": ExpertLoad()}


METRICS, CHUNKS = "metrics.jsonl", "metrics"
# A gs:// run writes its rows as chunk objects metrics/FIRST-LAST.jsonl (never appending to an object),
# at most this often, and at every checkpoint and at the end; a local run appends to metrics.jsonl.
FLUSH_S = 30.0


def _chunk_name(first: int, last: int) -> str:
    return f"{first:09d}-{last:09d}.jsonl"


def _chunks(run_dir: str) -> list[tuple[int, int, str]]:
    """(first step, last step, name) of a gs:// run's metrics chunks, in step order."""
    out = []
    for name in storage.listdir(storage.join(run_dir, CHUNKS)):
        first, _, last = name.removesuffix(".jsonl").partition("-")
        if name.endswith(".jsonl") and first.isdigit() and last.isdigit():
            out.append((int(first), int(last), name))
    return sorted(out)


def _parse(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # the half-written last line of a killed run
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def read_rows(run_dir) -> list[dict]:
    """Every logged step's metrics row, once, in step order: a local run's metrics.jsonl, or a gs:// run's
    chunks joined (where chunks overlap, the later-written one's row wins)."""
    run_dir = str(run_dir)
    if storage.is_gcs(run_dir):
        texts = [_chunk_text(storage.join(run_dir, CHUNKS, name)) for *_, name in _chunks(run_dir)]
    else:
        texts = [storage.read_text(storage.join(run_dir, METRICS)) or ""]
    by_step = {}
    for text in texts:
        for row in _parse(text):
            by_step[row["step"]] = row
    return [by_step[k] for k in sorted(by_step)]


_warned: set[str] = set()  # damaged chunks already named (the trainer reads the rows twice at a resume)


def _chunk_text(url: str) -> str:
    """A gs:// metrics chunk's text. A chunk is written whole, so a line that is not a row (or bytes that are not
    UTF-8) means it was damaged after: its good rows are kept, and a warning names it and what was lost."""
    raw = storage.read_bytes(url) or b""
    try:
        text, utf8 = raw.decode("utf-8"), True
    except UnicodeDecodeError:
        text, utf8 = raw.decode("utf-8", errors="replace"), False
    lines = [line for line in text.splitlines() if line.strip()]
    bad = [i for i, line in enumerate(lines, 1) if not _parse(line)]
    if (bad or not utf8) and url not in _warned:
        _warned.add(url)
        what = f"{len(bad)} of its {len(lines)} line(s) are not metrics rows (first: line {bad[0]})" if bad else \
            "it holds bytes that are not UTF-8"
        print(f"maxlm: warning: metrics chunk {url} is damaged: {what}; those steps' rows are missing from the "
              f"run's history (the loss plot, resume's rows), the rest are kept", file=sys.stderr, flush=True)
    return text


def trim_history(run_dir, start_step: int) -> str | None:
    """Make the run's metrics (and tb/) describe the run that continues from `start_step`.

    Resuming from step N drops rows after N: those steps run again and write them again. Starting from
    step 0 moves a local run's old outputs aside instead of deleting them; a gs:// run cannot rename, and
    at step 0 has no checkpoint (resume=never refuses to discard gs:// checkpoints), so its old rows are
    those of an attempt that saved nothing, and are dropped. Returns what was done, for the log, or None."""
    run_dir = str(run_dir)
    if storage.is_gcs(run_dir):
        return _trim_chunks(run_dir, start_step)
    path = Path(run_dir) / METRICS
    if not path.exists() or not path.read_text().strip():
        return None
    if start_step == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        moved = [path.rename(path.with_name(f"metrics-replaced-{stamp}.jsonl")).name]
        tb = path.with_name("tb")
        if tb.exists():
            moved.append(tb.rename(tb.with_name(f"tb-replaced-{stamp}")).name)
        return f"starting at step 0: moved the previous run's {' and '.join(moved)} aside"
    lines = path.read_text().splitlines()
    kept = [line for line in lines if any(r["step"] <= start_step for r in _parse(line))]
    if len(kept) == len(lines):
        return None
    storage.write(path, "".join(line + "\n" for line in kept))
    return f"{METRICS}: dropped {len(lines) - len(kept)} row(s) after step {start_step} (those steps run again)"


def _trim_chunks(run_dir: str, start_step: int) -> str | None:
    dropped = 0
    for first, last, name in _chunks(run_dir):
        if last <= start_step:
            continue
        source = storage.join(run_dir, CHUNKS, name)
        rows = _parse(_chunk_text(source))
        kept = [r for r in rows if r["step"] <= start_step]
        dropped += len(rows) - len(kept)
        if kept:  # written before the old chunk goes, so no row is ever missing
            storage.write(storage.join(run_dir, CHUNKS, _chunk_name(kept[0]["step"], kept[-1]["step"])),
                          "".join(json.dumps(r) + "\n" for r in kept))
        storage.remove(source)
    if not dropped:
        return None
    return f"metrics: dropped {dropped} row(s) after step {start_step} (those steps run again)"


def _summary_writer():
    """tensorboardX's SummaryWriter, imported without torch. tensorboardX imports torch whenever it is
    installed, only to accept torch tensors (maxlm logs floats), and that import is ~2.5 s of every run's
    start in an environment that has torch (2.4 of 11.5 s for a tiny 4-step run; most test runs)."""
    if "torch" not in sys.modules and "tensorboardX" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX catches
        try:
            import tensorboardX
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter
    return SummaryWriter


class Logger:
    """Writes one JSON object per logged step (metrics.jsonl locally, chunks on gs://), the same scalars
    to TensorBoard and/or W&B (`tracking`; maxlm.tracking), and a progress bar (on a terminal) or plain
    lines (in a log file)."""

    def __init__(self, run_dir, total_steps: int, start_step: int, write: bool = True, tensorboard: bool = True,
                 wandb=None):
        # tensorboardX writes TensorBoard event files without TensorFlow. clu's metric_writers is the JAX
        # ecosystem's usual writer, but its TensorBoard writer imports TensorFlow (a ~500 MB dependency
        # maxlm avoids on purpose), and flax's own writer is the same clu code. For a gs:// run_dir the
        # events go to a local directory whose files are uploaded whole with each metrics chunk (tensorboardX's
        # own gs:// writer uploads again when garbage-collected, at exit, and hangs there if GCS is gone).
        from tqdm import tqdm

        SummaryWriter = _summary_writer()

        self.run_dir, self.write = str(run_dir), write  # write=False: another process writes the files
        self.gcs = storage.is_gcs(self.run_dir)
        rows = read_rows(self.run_dir) if write else []  # kept from before a resume
        self.start = start_step
        self.history: list[tuple[int, float]] = [(r["step"], r["loss"]) for r in rows]
        self.eval_history: list[tuple[int, float]] = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
        self.reward_history: list[tuple[int, float]] = [(r["step"], r["reward"]) for r in rows if "reward" in r]
        self.jsonl = open(Path(self.run_dir) / METRICS, "a") if write and not self.gcs else None
        self.pending, self.flushed = [], time.monotonic()
        # purge_step: TensorBoard hides the old events of the steps a resumed run writes again
        self.tb_dir = tempfile.mkdtemp(prefix="maxlm-tb-") if self.gcs else storage.join(self.run_dir, "tb")
        self.tb = (SummaryWriter(self.tb_dir, purge_step=start_step + 1 if start_step else None)
                   if write and tensorboard else None)
        self.wandb, self.png = wandb, None  # png: the loss plot, once made
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        disable=not (write and sys.stderr.isatty()), file=sys.stderr)

    def step(self, step: int, m: dict, log: bool, flush: bool = False) -> None:
        """Record step `step`'s row; `flush`: make every row so far durable now (a checkpoint was saved)."""
        self.history.append((step, m["loss"]))
        if "eval_loss" in m:
            self.eval_history.append((step, m["eval_loss"]))
        if "reward" in m:
            self.reward_history.append((step, m["reward"]))
        self.bar.update(1)
        mfu = f"{100 * m['mfu']:.1f}%" if m["mfu"] is not None else "n/a"
        ev = f" eval {self.eval_history[-1][1]:.4f}" if self.eval_history else ""
        ev += f" reward {m['reward']:.3f}" if "reward" in m else ""
        self.bar.set_postfix_str(f"loss {m['loss']:.4f}{ev} tok/s {m['tokens_per_sec']:.0f} mfu {mfu}", refresh=False)
        if not (log and self.write):
            if flush:
                self.flush()
            return
        row = json.dumps({"step": step, **m})
        if self.gcs:
            self.pending.append((step, row))
        else:
            self.jsonl.write(row + "\n")
            self.jsonl.flush()
        for k, v in m.items() if self.tb else ():
            for name, x in ([(f"{k}/{i}", x) for i, x in enumerate(v)] if isinstance(v, list) else [(k, v)]):
                if isinstance(x, (int, float)) and math.isfinite(x):
                    self.tb.add_scalar(name, x, step)
        if self.wandb:
            self.wandb.log(step, m)
        if flush or time.monotonic() - self.flushed >= FLUSH_S:
            self.flush()
        if self.bar.disable:
            ev = f" | eval_loss {m['eval_loss']:.4f} | eval_ppl {m['eval_ppl']:.3f}" if "eval_loss" in m else ""
            ev += f" | mtp_loss {m['mtp_loss']:.4f}" if "mtp_loss" in m else ""
            ev += f" | reward {m['reward']:.3f} | solved {m['solved']:.2f}" if "reward" in m else ""
            print(f"step {step:>6} | loss {m['loss']:.4f}{ev} | grad_norm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
                  f"{m['step_time_s'] * 1e3:.0f} ms | {m['tokens_per_sec']:.0f} tok/s | "
                  f"{m['tflops_per_device']:.3f} TFLOP/s/dev | MFU {mfu}", flush=True)

    def flush(self) -> None:
        """Write the rows held back (gs://: one new chunk object)."""
        self.flushed = time.monotonic()
        if not (self.write and self.pending):
            return
        (first, _), (last, _) = self.pending[0], self.pending[-1]
        storage.write(storage.join(self.run_dir, CHUNKS, _chunk_name(first, last)),
                      "".join(row + "\n" for _, row in self.pending))
        self.pending = []
        if self.tb:
            self.tb.flush()
            self._upload_tb()

    def _upload_tb(self) -> None:
        if self.gcs and self.tb:
            storage.upload(self.tb_dir, storage.join(self.run_dir, "tb"))

    def close(self) -> None:
        self.bar.close()
        if self.write:
            self.flush()
            if self.jsonl:
                self.jsonl.close()
            if self.tb:
                self.tb.close()
                self._upload_tb()
            if self.wandb:  # the plot goes with the run: a run stopped early has one too
                self.wandb.finish(self._png())
                self.wandb = None
        if self.gcs:  # the local staging of a gs:// run's events, uploaded above: not left behind in /tmp
            shutil.rmtree(self.tb_dir, ignore_errors=True)

    def attempt(self, history: list | None = None) -> list[tuple[int, float]]:
        """(step, loss) of the steps this process trained (after a resume: from the resumed step on); or
        (step, value) of `history`'s."""
        return [(s, v) for s, v in (self.history if history is None else history) if s > self.start]

    def plot(self) -> str | None:
        """loss.png in the run directory: its path, or None (no step logged, or not the writing process)."""
        png = self._png()
        if png is None:
            return None
        out = storage.join(self.run_dir, "loss.png")
        storage.write(out, png)
        return out

    def _png(self) -> bytes | None:
        if not (self.history and self.write):
            return None
        if self.png is not None:
            return self.png
        import io

        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps, losses = zip(*self.history)
        fig, axes = plt.subplots(1, 1 + bool(self.reward_history), figsize=(7 + 5 * bool(self.reward_history), 4))
        ax = axes[0] if self.reward_history else axes
        if self.reward_history:  # GRPO: its surrogate loss is near 0 by construction; the reward is the curve
            axes[1].plot(*zip(*self.reward_history), color="C2")
            axes[1].set(xlabel="step", ylabel="reward (rollout mean)", title="reward")
            axes[1].grid(alpha=0.3)
        ax.plot(steps, losses, label="train")
        if self.eval_history:
            ax.plot(*zip(*self.eval_history), "o-", label="eval (held-out)")
            ax.legend()
        ax.set(xlabel="step", ylabel="loss (nats/token)", title=self.run_dir.rstrip("/").rsplit("/", 1)[-1])
        ax.grid(alpha=0.3)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        self.png = png.getvalue()
        return self.png


class StepTimer:
    """Step time from consecutive completions: the loop reads step s-1's metrics right after dispatching
    step s, so the gap between two reads is one step of device time plus whatever host time is not
    hidden behind it."""

    def __init__(self):
        self.last = None

    def lap(self) -> float | None:
        now = time.perf_counter()
        dt = None if self.last is None else now - self.last
        self.last = now
        return dt
