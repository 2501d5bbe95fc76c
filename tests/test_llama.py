import jax
import jax.numpy as jnp
import numpy as np

from maxlm import models
from maxlm.config import load
from maxlm.models import llama, params as P_

CFG = load("configs/tiny.yml", ["model.n_layers=2"])


def _params(cfg=CFG):
    return P_.init(llama.param_specs(cfg.model), jax.random.key(0))


def _fwd(params, tokens, pos, seg, cfg=CFG, dtype=jnp.float32):
    return models.apply(params, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg), cfg.model, dtype).logits


def test_forward_shape_and_float32_logits():
    p = _params()
    t = np.arange(16, dtype=np.int32).reshape(2, 8)
    pos = np.tile(np.arange(8, dtype=np.int32), (2, 1))
    for dtype in (jnp.float32, jnp.bfloat16):
        out = _fwd(p, t, pos, np.ones_like(t), dtype=dtype)
        assert out.shape == (2, 8, 256) and out.dtype == jnp.float32
        assert np.isfinite(np.asarray(out)).all()


def test_tied_embeddings_share_the_table():
    cfg = load("configs/tiny.yml", ["model.n_layers=1", "model.tie_embeddings=true"])
    specs = llama.param_specs(cfg.model)
    assert "unembed" not in specs
    p = _params(cfg)
    t = np.zeros((1, 4), np.int32)
    ones = np.ones((1, 4), np.int32)
    base = _fwd(p, t, np.arange(4)[None], ones, cfg)
    p2 = dict(p, embed=p["embed"].at[200].add(1.0))  # a row never looked up, used only as an output
    assert not np.allclose(_fwd(p2, t, np.arange(4)[None], ones, cfg)[..., 200], base[..., 200])


def test_param_count_matches_the_llama_formula():
    m = CFG.model
    D, F, L, H, K, Dh, V = m.d_model, m.d_ff, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.vocab_size
    want = 2 * V * D + L * (2 * D + D * H * Dh * 2 + D * K * Dh * 2 + 3 * D * F) + D
    assert P_.count(llama.param_specs(m)) == want
