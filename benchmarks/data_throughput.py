"""Host data throughput, in tokens/s per host, of what the train loop sees (`next(loader)`: read, pack,
batch, and hand to jax as a global array). Builds its own corpus: English-like JSONL documents cut from
Python's docs, and a byte-level BPE tokenizer.json trained on them.

    python benchmarks/data_throughput.py [--docs 20000] [--seconds 20] [--workers 2]

Measures:
  (a) prepared tokens (maxlm.data.prepare), packed rows: target >= 5M tokens/s;
  (b) JSONL tokenized on the fly with the BPE tokenizer.json, in worker processes: target >= 0.5M tokens/s.
Also prints prepare's own throughput. Record runs in benchmarks/RESULTS.md.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from maxlm import cli  # noqa: E402


def corpus(d: Path, n_docs: int) -> Path:
    """n_docs JSONL documents of 200..6000 characters, cut at random from Python's docs."""
    import numpy as np
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    rng = np.random.default_rng(0)
    path = d / "corpus.jsonl"
    with open(path, "w") as f:
        for _ in range(n_docs):
            n = int(rng.integers(200, 6000))
            a = int(rng.integers(0, len(text) - n))
            f.write(json.dumps({"text": text[a:a + n]}) + "\n")
    return path


def bpe(d: Path, data: Path, vocab: int = 8192) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((json.loads(line)["text"] for line in open(data)), trainer)
    path = d / "tokenizer.json"
    tok.save(str(path))
    return path


def measure(overrides: list[str], seconds: float) -> tuple[float, float, int]:
    """(tokens/s, data wait per step in s, steps) of next(loader) on one device, after one warm-up batch."""
    import jax

    from maxlm import mesh as mesh_lib, sharding
    from maxlm.config import load
    from maxlm.data import make_loader

    cfg = load("configs/tiny.yml", overrides)
    mesh = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 1), jax.devices()[:1])
    ld = make_loader(cfg, sharding.named(mesh, ("batch", "length"), sharding.rules(cfg)))
    jax.block_until_ready(next(ld))
    t0, steps = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        jax.block_until_ready(next(ld))
        steps += 1
    dt = time.perf_counter() - t0
    ld.close()
    return steps * cfg.global_batch_size * cfg.seq_len / dt, dt / steps, steps


def main() -> int:
    ap = cli.Parser()
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    a = ap.parse_args()
    from maxlm.data import prepare

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        t = time.perf_counter()
        data = corpus(d, a.docs)
        tok = bpe(d, data)
        print(f"corpus: {a.docs:,} JSONL documents, {data.stat().st_size / 2**20:.1f} MiB; BPE vocab 8192 trained "
              f"({time.perf_counter() - t:.1f}s)", flush=True)
        t = time.perf_counter()
        assert prepare.main([str(data), "--tokenizer", str(tok), "--out", str(d / "prep"), "--add-eos",
                             "--workers", str(a.workers), "--chunk-mb", "4"]) == 0
        meta = json.loads((d / "prep" / "dataset.json").read_text())
        n_tok = meta["stats"]["tokens"]
        print(f"prepare: {n_tok:,} tokens in {time.perf_counter() - t:.1f}s with {a.workers} workers "
              f"({n_tok / (time.perf_counter() - t):,.0f} tokens/s, including worker start-up)", flush=True)
        common = [f"seq_len={a.seq_len}", f"global_batch_size={a.batch}", "model.vocab_size=8192",
                  f"data.tokenizer={tok}", "data.add_eos=true"]
        cases = [("(a) prepared, packed, in-process threads", ["data.source=prepared", f"data.path={d / 'prep'}"], 5e6),
                 (f"(a) prepared, packed, {a.workers} workers", ["data.source=prepared", f"data.path={d / 'prep'}",
                                                                     f"data.workers={a.workers}"], 5e6),
                 ("(b) jsonl + BPE, in-process threads", ["data.source=jsonl", f"data.path={data}"], 5e5),
                 (f"(b) jsonl + BPE, {a.workers} workers", ["data.source=jsonl", f"data.path={data}",
                                                             f"data.workers={a.workers}"], 5e5)]
        for name, over, target in cases:
            tps, wait, steps = measure(common + over, a.seconds)
            verdict = "meets" if tps >= target else "MISSES"
            print(f"{name}: {tps:,.0f} tokens/s over {steps} batches of {a.batch}x{a.seq_len} "
                  f"({wait * 1e3:.1f} ms per batch; {verdict} the {target:,.0f} target)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.exit(cli.run(main))
