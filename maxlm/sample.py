"""Greedy text sampling from a trained model (no KV cache: a fixed window, recomputed per token)."""

import jax
import jax.numpy as jnp
import numpy as np

from maxlm import models


def greedy(params, cfg, prompt: list[int], n_new: int) -> list[int]:
    model, L = models.get(cfg.model.family), cfg.seq_len

    @jax.jit
    def next_token(params, window_1L, t):
        pos_1L = jnp.arange(L, dtype=jnp.int32)[None]
        logits_1LV = model.forward(params, window_1L, pos_1L, jnp.ones_like(window_1L), cfg.model,
                                   jnp.dtype(cfg.dtype)).logits
        return jnp.argmax(logits_1LV[0, t])

    tokens = list(prompt)
    for _ in range(n_new):
        ctx = tokens[-L:]
        window = np.zeros((1, L), np.int32)
        window[0, :len(ctx)] = ctx  # causal: what follows position t cannot change its logits
        tokens.append(int(next_token(params, window, len(ctx) - 1)))
    return tokens[len(prompt):]
