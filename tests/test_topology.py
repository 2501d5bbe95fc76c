"""The TPU slice table: every row checked against the public Cloud TPU pages (typed here by hand, not
derived from the table's own arithmetic) and against libtpu's own layout of the topology."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT, cli_env

from maxlm import topology
from maxlm.config import ConfigError

# accelerator type: (physical shape, chips, hosts = VMs = pods), from cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}
DOCS = {
    "v4-8": ("2x2x1", 4, 1), "v4-16": ("2x2x2", 8, 2), "v4-32": ("2x2x4", 16, 4), "v4-64": ("2x4x4", 32, 8),
    "v4-128": ("4x4x4", 64, 16), "v4-256": ("4x4x8", 128, 32), "v4-512": ("4x8x8", 256, 64),
    "v4-1024": ("8x8x8", 512, 128), "v4-2048": ("8x8x16", 1024, 256), "v4-4096": ("8x16x16", 2048, 512),
    "v5p-8": ("2x2x1", 4, 1), "v5p-16": ("2x2x2", 8, 2), "v5p-32": ("2x2x4", 16, 4), "v5p-64": ("2x4x4", 32, 8),
    "v5p-128": ("4x4x4", 64, 16), "v5p-256": ("4x4x8", 128, 32), "v5p-512": ("4x8x8", 256, 64),
    "v5p-1024": ("8x8x8", 512, 128), "v5p-2048": ("8x8x16", 1024, 256), "v5p-4096": ("8x16x16", 2048, 512),
    "v5p-8192": ("16x16x16", 4096, 1024), "v5p-12288": ("16x16x24", 6144, 1536),
    "v5litepod-1": ("1x1", 1, 1), "v5litepod-4": ("2x2", 4, 1), "v5litepod-8": ("2x4", 8, 1), "v5litepod-16": ("4x4", 16, 4),
    "v5litepod-32": ("4x8", 32, 8), "v5litepod-64": ("8x8", 64, 16), "v5litepod-128": ("8x16", 128, 32), "v5litepod-256": ("16x16", 256, 64),
    "v6e-1": ("1x1", 1, 1), "v6e-4": ("2x2", 4, 1), "v6e-8": ("2x4", 8, 1), "v6e-16": ("4x4", 16, 4),
    "v6e-32": ("4x8", 32, 8), "v6e-64": ("8x8", 64, 16), "v6e-128": ("8x16", 128, 32), "v6e-256": ("16x16", 256, 64),
}


def test_the_table_is_exactly_the_documented_slices():
    assert sorted(topology.SLICES) == sorted(DOCS)


@pytest.mark.parametrize("name", sorted(DOCS))
def test_every_row(name):
    s = topology.lookup(name)
    assert (s.shape, s.chips, s.hosts) == DOCS[name]
    assert s.chips_per_host in ((1, 4, 8) if s.generation in ("v5e", "v6e") else (4,))
    assert s.name.startswith({"v5e": "v5litepod-"}.get(s.generation, s.generation + "-"))
    assert s.machine_type.endswith(f"-{s.chips_per_host}t")


LAYOUT = """
import json
from jax.experimental import topologies
from maxlm import platforms, topology
platforms.compile_only_tpu("v5p-8")
out = {}
for s in topology.SLICES.values():
    name, kwargs = s.compile_args
    devices = topologies.get_topology_desc(name, "tpu", **kwargs).devices
    out[s.name] = [len(devices), len({d.process_index for d in devices})]
print(json.dumps(out))
"""


def test_libtpu_lays_out_every_row_with_its_chips_and_hosts():
    """libtpu's compile-only topology for each row has one device per chip and one process per host. In a
    subprocess: only one process at a time may hold libtpu, and the dry-run tests start their own."""
    r = subprocess.run([sys.executable, "-c", LAYOUT], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {name: [s.chips, s.hosts] for name, s in topology.SLICES.items()}


@pytest.mark.parametrize("alias, name", [("v5e-16", "v5litepod-16"), ("V6E-256", "v6e-256"), ("v5p:2x4x4", "v5p-64"),
                                         ("v6e:2x4", "v6e-8"), ("v5litepod:2x2", "v5litepod-4"), ("v5e:2x2", "v5litepod-4")])
def test_aliases(alias, name):
    assert topology.lookup(alias).name == name


@pytest.mark.malformed
@pytest.mark.parametrize("bad, message", [
    ("v5p-6", r"TPU `v5p-6` is not a v5p slice maxlm knows \(v5p names count TensorCores, two per chip\); use one of v5p-8,"),
    ("v6e-2", r"v6e names count chips"),
    ("v5p-4", r"not a v5p slice"),
    ("v7x-8", r"unknown generation `v7x`; maxlm knows v4, v5e, v5p, v6e"),
    ("v5p:3x3x3", r"not a v5p slice"),
    ("tpu", r"unknown generation `tpu`"),
])
def test_unknown_slices_are_errors_never_guesses(bad, message):
    with pytest.raises(ConfigError, match=message):
        topology.lookup(bad)


def test_gke_labels():
    s = topology.lookup("v6e-256")
    assert (s.gen.gke_accelerator, s.shape, s.machine_type, s.chips_per_host) == ("tpu-v6e-slice", "16x16", "ct6e-standard-4t", 4)
    s = topology.lookup("v5litepod-8")
    assert (s.gen.gke_accelerator, s.machine_type, s.hosts) == ("tpu-v5-lite-podslice", "ct5lp-hightpu-8t", 1)
    assert topology.lookup("v5p-64").gen.gke_accelerator == "tpu-v5p-slice"
