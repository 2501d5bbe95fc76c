"""configs/finetune_example.yml end to end: fine-tune a tiny local HF model, export it, load it back."""

import json

import jax
import numpy as np
import pytest

from conftest import run_cli
from hf_parity import make_hf, maxlm_logits, rel_err, tokens, torch, transformers, TOL
from maxlm import config
from maxlm.convert import hf
from maxlm.data import make_loader

ARCH = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


@pytest.mark.slow  # ~11 s; HF init_from + export + transformers reload are in test_lora (fast)
def test_finetune_from_hf_then_export(tmp_path):
    src, run_dir, out = tmp_path / "hf", tmp_path / "run", tmp_path / "export"
    model = make_hf(transformers.LlamaConfig(**ARCH), src)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"example {i}: " + "fine tuning text " * (i % 5 + 1)}) + "\n"
                            for i in range(64)))
    args = [f"init_from=hf:{src}", f"data.path={data}", "data.tokenizer=byte", "data.packing=false", "steps=3",
            "global_batch_size=8", "seq_len=32", "dtype=float32", "remat=none", "log_every=1", "optim.lr=1e-2",
            "optim.warmup_steps=0", f"run_dir={run_dir}"]
    r = run_cli("configs/finetune_example.yml", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"initialised parameters from the Hugging Face checkpoint {src}" in r.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    # Step 1's loss is the HF model's own cross-entropy on the first batch: the weights really came in.
    cfg = hf.with_hf_model(config.load("configs/finetune_example.yml", args), src)
    loader = make_loader(cfg, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    batch = jax.tree.map(np.asarray, next(loader))
    loader.close()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.as_tensor(batch["inputs"], dtype=torch.long)).logits, -1).numpy()
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    mask = batch["loss_mask"].astype(np.float64)
    assert abs(rows[0]["loss"] - (nll * mask).sum() / mask.sum()) < 1e-4 * rows[0]["loss"]

    # Export: transformers loads it unmodified, it computes what maxlm computes, and training moved it.
    r = run_cli_module("maxlm.convert.to_hf", "--checkpoint", str(run_dir), "--out", str(out))
    assert r.returncode == 0 and "wrote llama from" in r.stdout, r.stderr[-2000:]
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    toks = tokens(300)
    with torch.no_grad():
        ref = tuned(torch.as_tensor(toks)).logits.numpy()
    assert rel_err(maxlm_logits(out, toks), ref) <= TOL
    before = model.model.layers[0].mlp.up_proj.weight.detach().numpy()
    assert not np.allclose(tuned.model.layers[0].mlp.up_proj.weight.detach().numpy(), before)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 64


def run_cli_module(module: str, *args: str):
    import subprocess
    import sys
    from conftest import ROOT, cli_env
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=cli_env(1), capture_output=True,
                          text=True, timeout=300)
