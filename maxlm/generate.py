"""Batched autoregressive generation with a KV cache, in one jitted call.

The prompts are left-padded into one [B, P] batch: pad slots get segment id 0, which no real token
(segment 1) attends to, and each row's real tokens take positions 0, 1, ..., so padding shifts neither
RoPE nor learned positions. One forward call over the whole batch fills the cache (prefill) and gives
the first new token; a `lax.while_loop` then feeds one token per step, writing its K/V at the cache
index, until `max_new_tokens` or until every row has emitted `eos_id` (one id, or several: a chat
template's end-of-turn tokens and the tokenizer's EOS). Nothing is retraced per token:
a new trace happens only for a new batch shape (prompt lengths are rounded up to a multiple of 8),
`max_new_tokens`, dtype or sampling mode (greedy, sampling, or sampling with top-k/top-p filtering;
temperature, top_k, top_p, seed and eos_id are traced values).

Sampling: temperature 0 is greedy argmax. Otherwise tokens are drawn from softmax(logits / T), after
keeping only the `top_k` largest logits and then the smallest set of tokens whose probability reaches
`top_p` (nucleus). Row i's draw at step t uses `fold_in(fold_in(key(seed), t), i)`: a seed reproduces
a batch exactly, whatever the other rows hold.
"""

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import models, sharding
from maxlm.models import decoder

PROMPT_MULTIPLE = 8  # prompt batches are left-padded to a multiple of this, so new lengths rarely retrace


class Generation(NamedTuple):
    tokens: np.ndarray          # [B, N] int32 new tokens; after a row's eos_id, eos_id again (pad_id without eos)
    lengths: np.ndarray         # [B] new tokens per row, up to and including its first eos_id
    logits: np.ndarray | None   # [B, N, V] float32 logits each new token was chosen from (return_logits=True)
    logps: np.ndarray | None = None  # [B, N] float32 log-probability of each new token under softmax(logits /
                                     # temperature), before top-k/top-p (return_logps=True)
    routes: np.ndarray | None = None  # [B, N, MoE layers] uint32 (return_routes=True, MoE models; else None):
                                      # the experts chosen, per layer, for the input token whose logits drew
                                      # new token t (t = 0: the last prompt token, in the prefill; else new
                                      # token t - 1), as moe.fingerprint names the set; the trainer's forward
                                      # gives the same at position len(prompt) - 1 + t (forward.Scored.routes)
    entropy: np.ndarray | None = None  # [B, N] float32 entropy of softmax(logits / temperature), the distribution
                                       # each new token was drawn from before top-k/top-p (return_logps=True)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0, multiple: int = 1, length: int | None = None):
    """(tokens_BP, seg_BP, pos_BP) int32 for ragged prompts: right-aligned, pads with segment 0, and
    each row's positions counting from 0 at its first real token. P is `length` when given, else the
    longest prompt rounded up to `multiple`."""
    rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
    if not rows:
        raise ValueError("generate: no prompts given")
    if any(len(r) == 0 for r in rows):
        raise ValueError(f"generate: prompt {next(i for i, r in enumerate(rows) if len(r) == 0)} is empty; "
                         f"every row needs at least one token (e.g. a BOS id)")
    length = length or -(-max(len(r) for r in rows) // multiple) * multiple
    tokens = np.full((len(rows), length), pad_id, np.int32)
    seg = np.zeros((len(rows), length), np.int32)
    pos = np.zeros((len(rows), length), np.int32)
    for i, r in enumerate(rows):
        tokens[i, length - len(r):] = r
        seg[i, length - len(r):] = 1
        pos[i, length - len(r):] = np.arange(len(r))
    return tokens, seg, pos


def filter_logits(logits_BV, top_k=None, top_p=None):
    """Logits with everything outside the top-k, then outside the top-p nucleus (the fewest tokens
    whose probability reaches top_p), set to -inf. Either may be traced; top_k >= V and top_p >= 1
    filter nothing. Ties at a threshold are kept (as in HF)."""
    if top_k is None and top_p is None:
        return logits_BV
    B, V = logits_BV.shape
    sorted_BV = -jnp.sort(-logits_BV, axis=-1)  # descending
    if top_k is not None:
        kth_B1 = jnp.take_along_axis(sorted_BV, jnp.full((B, 1), jnp.clip(top_k, 1, V) - 1), axis=-1)
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
        sorted_BV = jnp.where(sorted_BV < kth_B1, -jnp.inf, sorted_BV)
    if top_p is not None:
        p_BV = jax.nn.softmax(sorted_BV, axis=-1)
        before_BV = jnp.cumsum(p_BV, axis=-1) - p_BV  # mass of the tokens ranked above each one
        n_keep_B1 = jnp.maximum(jnp.sum(before_BV < top_p, axis=-1, keepdims=True), 1)  # a prefix: the top one stays
        cut_B1 = jnp.take_along_axis(sorted_BV, n_keep_B1 - 1, axis=-1)
        logits_BV = jnp.where((logits_BV < cut_B1) & (top_p < 1), -jnp.inf, logits_BV)
    return logits_BV


def sample(key, logits_BV, temperature, top_k=None, top_p=None):
    """One token per row from softmax(filtered logits / temperature); row i uses fold_in(key, i)."""
    x_BV = filter_logits(logits_BV.astype(jnp.float32) / temperature, top_k, top_p)
    keys_B = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(x_BV.shape[0]))
    return jax.vmap(jax.random.categorical)(keys_B, x_BV).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("m", "dtype", "n_new", "greedy", "filtered", "return_logits",
                                             "return_logps", "return_routes", "out_sharding", "rules"))
def _generate(params, tokens_BP, seg_BP, pos_BP, seed, temperature, top_k, top_p, eos_id, fill_id, *, m, dtype,
              n_new, greedy, filtered, return_logits, return_logps, return_routes, out_sharding, rules):
    del rules  # the sharding rules in effect when traced: part of the cache key, since `constrain` reads them
    family = models.get(m.family)
    forward = functools.partial(family.forward, routes=True) if return_routes else family.forward
    B, Pn = tokens_BP.shape
    key = jax.random.key(seed)

    def pick(logits_BV, t):
        if greedy:
            return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        return sample(jax.random.fold_in(key, t), logits_BV, temperature, top_k if filtered else None,
                      top_p if filtered else None)

    def logp(logits_BV, tok_B):  # the sampled token's log-probability at the sampling temperature, and the entropy
        lp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32) / temperature, axis=-1)  # of what it was drawn from
        return jnp.take_along_axis(lp_BV, tok_B[:, None], axis=-1)[:, 0], -jnp.sum(jnp.exp(lp_BV) * lp_BV, axis=-1)

    cache = decoder.init_cache(m, B, Pn + n_new, dtype)
    out = forward(params, tokens_BP, pos_BP, seg_BP, m, dtype, cache=cache)  # prefill
    logits_BV = family.unembed(params, out.x_BLD, m)[:, -1]
    tok_B = pick(logits_BV, 0)
    toks_BN = jnp.full((B, n_new), fill_id, jnp.int32).at[:, 0].set(tok_B)
    logits_BNV = (jnp.zeros((B, n_new, logits_BV.shape[-1]), jnp.float32).at[:, 0].set(logits_BV)
                  if return_logits else None)
    logps_BN, ents_BN = ((jnp.zeros((B, n_new), jnp.float32).at[:, 0].set(v) for v in logp(logits_BV, tok_B))
                         if return_logps else (None, None))
    routes_BNM = (jnp.zeros((B, n_new, out.routes.shape[-1]), jnp.uint32).at[:, 0].set(out.routes[:, -1])
                  if return_routes else None)
    ones_B1 = jnp.ones((B, 1), jnp.int32)

    def cond(s):
        t, _, done_B, *_ = s
        return (t < n_new) & ~jnp.all(done_B)

    def body(s):
        t, tok_B, done_B, pos_B, cache, toks_BN, logits_BNV, logps_BN, routes_BNM, ents_BN = s
        o = forward(params, tok_B[:, None], pos_B[:, None], ones_B1, m, dtype, cache=cache)
        logits_BV = family.unembed(params, o.x_BLD, m)[:, 0]
        new_B = jnp.where(done_B, fill_id, pick(logits_BV, t))
        toks_BN = jax.lax.dynamic_update_slice(toks_BN, new_B[:, None], (0, t))
        if return_logits:
            logits_BNV = jax.lax.dynamic_update_slice(logits_BNV, logits_BV[:, None], (0, t, 0))
        if return_logps:
            lp_B, ent_B = logp(logits_BV, new_B)
            logps_BN = jax.lax.dynamic_update_slice(logps_BN, lp_B[:, None], (0, t))
            ents_BN = jax.lax.dynamic_update_slice(ents_BN, ent_B[:, None], (0, t))
        if return_routes:  # the routes of the token fed in, whose logits drew new token t
            routes_BNM = jax.lax.dynamic_update_slice(routes_BNM, o.routes, (0, t, 0))
        return (t + 1, new_B, done_B | jnp.isin(new_B, eos_id), pos_B + 1, o.cache, toks_BN, logits_BNV, logps_BN,
                routes_BNM, ents_BN)

    state = (jnp.int32(1), tok_B, jnp.isin(tok_B, eos_id), pos_BP[:, -1] + 1, out.cache, toks_BN, logits_BNV, logps_BN,
             routes_BNM, ents_BN)
    outs = jax.lax.while_loop(cond, body, state)[5:]
    if out_sharding is not None:  # every process can read the result
        outs = tuple(None if a is None else jax.lax.with_sharding_constraint(a, out_sharding) for a in outs)
    return outs


def _replicated(params):
    """A replicated sharding on the params' mesh when they live on several devices (else None)."""
    sh = getattr(jax.tree.leaves(params)[0], "sharding", None)
    if isinstance(sh, NamedSharding) and sh.mesh.size > 1:
        return NamedSharding(sh.mesh, P())
    return None


def is_int(x) -> bool:
    """A Python, numpy or 0-d jax integer (not a bool, not an integral float)."""
    return np.ndim(x) == 0 and np.issubdtype(np.asarray(x).dtype, np.integer)


def is_number(x) -> bool:
    return np.ndim(x) == 0 and np.issubdtype(np.asarray(x).dtype, np.number) and bool(np.isfinite(x))


def token_ids(x, what: str, vocab_size: int) -> np.ndarray:
    """`x` as an int32 array of token ids, or one line naming `what`: floats, strings, bools and ids
    outside the vocabulary are refused, never cast (1.5 would silently become token 1)."""
    try:
        a = np.asarray(x)
    except ValueError:  # numpy refuses ragged nesting
        a = np.empty(0, object)
    if a.dtype == object:
        raise ValueError(f"{what} is not a rectangular array of integer ids (rows of different lengths?)")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{what} must be integer token ids, got {a.flat[0].item()!r} ({a.dtype})")
    bad = (a < 0) | (a >= vocab_size)
    if bad.any():
        raise ValueError(f"{what}: token id {int(a[bad][0])} is outside the vocabulary 0..{vocab_size - 1}")
    return a.astype(np.int32)


def check_args(m, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_id, pad_id) -> list[np.ndarray]:
    """The prompts as int32 rows, after checking every argument of `decode`: each mistake is one line
    naming the argument, before anything is traced."""
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not is_number(temperature) or temperature < 0:
        raise ValueError(f"generate: temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"generate: top_k must be an integer >= 1 (None: off), got {top_k!r}")
    if top_p is not None and (not is_number(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"generate: top_p must be in (0, 1] (None: off), got {top_p!r}")
    key = isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) and seed.ndim == 0
    if not (key or is_int(seed)):
        raise ValueError(f"generate: seed must be an integer or a jax.random.key, got {seed!r}")
    V = m.vocab_size
    stops = [] if eos_id is None else [eos_id] if is_int(eos_id) else list(eos_id) if isinstance(eos_id, Sequence) else None
    if stops is None or not all(is_int(e) and 0 <= e < V for e in stops) or (eos_id is not None and not stops):
        raise ValueError(f"generate: eos_id must be a token id in 0..{V - 1}, a non-empty list of them, or None; "
                         f"got {eos_id!r}")
    if not is_int(pad_id) or not 0 <= pad_id < V:
        raise ValueError(f"generate: pad_id must be a token id in 0..{V - 1}, got {pad_id!r}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray, jax.Array)):
        raise ValueError(f"generate: prompts must be a list of token-id lists, got {type(prompts).__name__}")
    rows = [token_ids(p, f"generate: prompt {i}", V) for i, p in enumerate(prompts)]
    if not rows:
        raise ValueError("generate: no prompts given")
    for i, r in enumerate(rows):
        if r.ndim != 1:
            raise ValueError(f"generate: prompt {i} must be a flat list of token ids, got shape {r.shape}")
        if r.size == 0:
            raise ValueError(f"generate: prompt {i} is empty; every row needs at least one token (e.g. a BOS id)")
    return rows


def decode(params, m, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, seed=0, eos_id: int | Sequence[int] | None = None,
           pad_id: int = 0, dtype="float32", return_logits: bool = False, return_logps: bool = False,
           prompt_len: int | None = None, return_routes: bool = False) -> Generation:
    """Generate `max_new_tokens` for each prompt (a list of token-id lists, ragged allowed) of the model
    `m` (a config's `model` section) with parameters `params`. Returns fixed-shape arrays; see
    `generate` for per-row lists. `seed` is an int or a `jax.random.key`. The prompts are left-padded to
    `prompt_len` tokens (one compiled program per value: a caller's fixed buckets), else to the longest
    rounded up to a multiple of 8. `return_routes`: Generation.routes, for an MoE model (a dense one: None)."""
    rows = check_args(m, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_id, pad_id)
    n_new = int(max_new_tokens)
    longest = max(len(r) for r in rows)
    if prompt_len is not None and (not is_int(prompt_len) or prompt_len < longest):
        raise ValueError(f"generate: prompt_len must be an integer >= the longest prompt ({longest}), got {prompt_len!r}")
    tokens_BP, seg_BP, pos_BP = left_pad(rows, pad_id, PROMPT_MULTIPLE, prompt_len)
    if longest + n_new > m.max_positions:
        raise ValueError(f"generate: the longest prompt ({longest} tokens) + max_new_tokens ({n_new}) = "
                         f"{longest + n_new} exceeds the model's max_positions={m.max_positions}")
    B = tokens_BP.shape[0]
    return_routes = bool(return_routes and m.n_experts)
    if n_new == 0:  # the MoE layers: all but an MLA family's dense first ones
        return Generation(np.zeros((B, 0), np.int32), np.zeros(B, np.int32),
                          np.zeros((B, 0, m.vocab_size), np.float32) if return_logits else None,
                          np.zeros((B, 0), np.float32) if return_logps else None,
                          np.zeros((B, 0, m.n_layers - m.dense_layers), np.uint32) if return_routes else None,
                          np.zeros((B, 0), np.float32) if return_logps else None)
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        seed = jax.random.randint(seed, (), 0, np.iinfo(np.int32).max)
    seed = int(seed) % 2**31
    eos = np.asarray([-1] if eos_id is None else [eos_id] if is_int(eos_id) else list(eos_id), np.int32)
    fill = pad_id if eos_id is None else int(eos[0])
    toks, logits, logps, routes, ents = _generate(
        params, tokens_BP, seg_BP, pos_BP, np.int32(seed), np.float32(temperature or 1.0),
        np.int32(top_k or m.vocab_size), np.float32(top_p or 1.0), eos, np.int32(fill),
        m=m, dtype=jnp.dtype(dtype), n_new=n_new, greedy=temperature == 0, filtered=top_k is not None or top_p is not None,
        return_logits=return_logits, return_logps=return_logps, return_routes=return_routes,
        out_sharding=_replicated(params),
        rules=sharding.current_rules())
    toks = np.asarray(jax.device_get(toks))
    hit = np.isin(toks, eos)
    lengths = np.where(hit.any(1), hit.argmax(1) + 1, n_new).astype(np.int32)
    host = lambda a: None if a is None else np.asarray(jax.device_get(a))  # noqa: E731
    return Generation(toks, lengths, host(logits), host(logps), host(routes), host(ents))


def generate(params, m, prompts: Sequence[Sequence[int]], max_new_tokens: int, **kw) -> list[list[int]]:
    """The new tokens of each prompt as a list, ending at (and including) `eos_id` when a row emits it.
    Keyword arguments as for `decode`."""
    g = decode(params, m, prompts, max_new_tokens, **kw)
    return [row[:n].tolist() for row, n in zip(g.tokens, g.lengths)]
