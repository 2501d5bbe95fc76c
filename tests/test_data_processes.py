"""Streaming data on two processes: when one process's share of the documents is unusable, both stop at
the same step, in one line each, rather than one looping forever or waiting at a collective."""

import json

import numpy as np
import pytest
from test_distributed import two_processes

from maxlm.data import sources
from maxlm.data.pipeline import Component, _Plan


@pytest.mark.slow  # two processes; the packer's check itself is in the fast suite (test_packing)
def test_one_process_with_only_unusable_documents_stops_both(tmp_path):
    n = 40
    lines = [json.dumps({"text": f"doc {i} " + "lorem ipsum dolor sit amet " * 8}) for i in range(n)]
    # The plan's epoch 0: process 1 reads its odd places. Empty those documents, keep process 0's.
    comp = Component("jsonl", sources.InMemorySource([np.zeros(2, np.int32)] * n), 1.0, "c")
    _, doc = _Plan([comp], seed=0).epoch(0)
    for m in range(1, n, 2):
        lines[doc[m]] = json.dumps({"text": ""})
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    outs = two_processes(tmp_path / "run", tmp_path, "data.source=jsonl", f"data.path={tmp_path}/c.jsonl",
                         "data.epochs=1", "steps=20", "sample_tokens=0", codes=(2, 2))
    assert ("maxlm: error: data: process 1 stopped on bad data in its share of the documents (its log names the "
            "problem); stopping with it") in outs[0]
    assert ("maxlm: error: data: no usable document in a whole epoch of process 1's 20 documents (empty: 20; first: "
            f"{tmp_path}/c.jsonl:") in outs[1]
