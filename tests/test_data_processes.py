"""Streaming data on two processes: when one process's share of the documents is unusable, both stop at
the same step, in one line each, rather than one looping forever or waiting at a collective."""

import json

import pytest
from test_distributed import two_processes

from maxlm.data import sources
from maxlm.data.order import Order


@pytest.mark.slow  # two processes; the packer's check itself is in the fast suite (test_packing)
def test_one_process_with_only_unusable_documents_stops_both(tmp_path):
    # Two 1 MiB units of JSONL; epoch 0 gives unit order[1] to process 1. Empty every line of that one.
    line = json.dumps({"text": "lorem ipsum dolor sit amet " * 8})
    n = 2 * sources.UNIT_BYTES // (len(line) + 1)
    lines = [line] * n
    bad = Order(2, 0, 0)[1]
    for i in range(n):
        if (i * (len(line) + 1)) // sources.UNIT_BYTES == bad:
            lines[i] = json.dumps({"text": ""}) + " " * (len(line) - 12)  # the same length: the units stay put
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    n_bad = sum(x.startswith('{"text": ""}') for x in lines)
    outs = two_processes(tmp_path / "run", tmp_path, "data.source=jsonl", f"data.path={tmp_path}/c.jsonl",
                         "data.epochs=1", "steps=20", "sample_tokens=0", codes=(2, 2))
    assert ("maxlm: error: data: process 1 stopped on bad data in its share of the documents (its log names the "
            "problem); stopping with it") in outs[0]
    assert (f"maxlm: error: data: no usable document in a whole epoch of process 1's {n_bad} documents (empty: "
            f"{n_bad}; first: {tmp_path}/c.jsonl:") in outs[1]
