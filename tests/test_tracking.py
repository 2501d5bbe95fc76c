"""Weights & Biases, offline (no network), read back from the run files W&B itself writes: the metrics rows,
the resolved config and the loss plot reach it; a resume continues the same W&B run and logs each step once;
a missing package or login is one line before anything compiles."""

import json
import shutil
import sys
from pathlib import Path

import pytest
from conftest import oracle

import train
from maxlm import config

TINY = ["configs/tiny.yml", "model.n_layers=1", "seq_len=32", "sample_tokens=0", "log_every=1", "checkpoint.every=2"]


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (run-ID.wandb): a 7-byte header (":W&B", magic, version), then LevelDB's
    log format (32 KiB blocks of records with a 7-byte header: crc, length, type), each a Record protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, part, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        n, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:
            pos += left
            continue
        part += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # FULL or LAST: the record is whole
            r = pb.Record()
            r.ParseFromString(part)
            out.append(r)
            part = b""
    return out


def _items(items) -> dict:
    """A record's items (a key, or a nested key path, and a JSON value) as a nested dict."""
    out = {}
    for i in items:
        *path, last = [i.key] if i.key else list(i.nested_key)
        d = out
        for k in path:
            d = d.setdefault(k, {})
        d[last] = json.loads(i.value_json)
    return out


def attempts(run_dir: Path) -> list[dict]:
    """Per W&B attempt (offline-run-* directory, in order): the run id, history rows by step, and the config."""
    out = []
    for d in sorted((run_dir / "wandb").glob("offline-run-*")):
        (f,) = d.glob("run-*.wandb")
        rows, cfg, run_id = {}, {}, None
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
                cfg.update(_items(r.run.config.update))
            elif kind == "config":
                cfg.update(_items(r.config.update))
            elif kind == "history":
                rows.setdefault(r.history.step.num, {}).update(_items(r.history.item))
        out.append(dict(id=run_id, rows=rows, config=cfg))
    return out


def test_a_resumed_run_continues_the_same_wandb_run_and_logs_each_step_once(tmp_path, monkeypatch):
    oracle("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    run = tmp_path / "run"
    args = [*TINY, f"run_dir={run}", "tracking=wandb"]
    assert train.main([*args, "steps=4"]) == 0
    first = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert not (run / "tb").exists()  # tracking names only wandb
    # A crash after step 4 was logged but before its checkpoint: the resume re-trains steps 3 and 4
    shutil.rmtree(run / "checkpoints" / "4")
    assert train.main([*args, "steps=6"]) == 0

    a, b = attempts(run)
    assert a["id"] == b["id"] == json.loads((run / "wandb.json").read_text())["id"]
    resolved = lambda steps: json.loads(json.dumps(config.to_dict(config.load(args[0], [*args[1:], f"steps={steps}"]))))  # noqa: E731
    assert {k: v for k, v in a["config"].items() if k != "_wandb"} == resolved(4)
    assert {k: v for k, v in b["config"].items() if k != "_wandb"} == resolved(6)
    trained = lambda rows: sorted(s for s, r in rows.items() if "loss" in r)  # noqa: E731
    assert trained(a["rows"]) == [1, 2, 3, 4] and trained(b["rows"]) == [5, 6]
    for row in first:  # the metrics.jsonl fields, as logged
        assert a["rows"][row["step"]]["loss"] == row["loss"] and a["rows"][row["step"]]["lr"] == row["lr"]
    # the re-trained steps are the logged ones, bit for bit
    again = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in again[:4]] == [r["loss"] for r in first]
    for att in (a, b):  # each attempt ends with the loss plot
        assert any(r.get("loss_plot", {}).get("_type") == "image-file" for r in att["rows"].values())


def test_starting_over_is_a_new_wandb_run(tmp_path, monkeypatch):
    oracle("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    args = [*TINY, f"run_dir={run}", "tracking=[tensorboard,wandb]", "steps=2"]
    assert train.main(args) == 0
    old = json.loads((run / "wandb.json").read_text())["id"]
    assert train.main([*args, "resume=never"]) == 0
    assert json.loads((run / "wandb.json").read_text())["id"] != old
    assert (run / "tb").exists()


@pytest.mark.malformed
@pytest.mark.parametrize("case", ["no-package", "no-login"])
def test_a_missing_package_or_login_is_one_line_before_anything_compiles(capfd, tmp_path, monkeypatch, case):
    for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "netrc").write_text("machine example.com login user password x\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    if case == "no-package":
        monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    rc = train.main([*TINY, f"run_dir={tmp_path / 'run'}", "tracking=[tensorboard,wandb]", "steps=2"])
    out, err = capfd.readouterr()
    lines = [x for x in err.splitlines() if x.strip()]
    assert rc == 2 and len(lines) == 1, err
    want = "wandb package is not installed: pip install -r requirements-wandb.txt" if case == "no-package" else \
        "not logged in to W&B: run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline"
    assert want in lines[0] and "compiled" not in out and not (tmp_path / "run" / "checkpoints").exists()
    if case == "no-login":  # the key `wandb login` leaves in .netrc is enough
        oracle("wandb")
        (tmp_path / "netrc").write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
        from maxlm import tracking
        monkeypatch.setattr(tracking, "_reach", lambda url: None)  # no network here: the probe has tests of its own
        tracking.check(["wandb"])
