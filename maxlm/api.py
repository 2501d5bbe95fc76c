"""The notebook API: `maxlm.from_pretrained(path)` -> a `Model` with `.config`, `.params`, `.logits` and
`.generate`.

    import maxlm
    m = maxlm.from_pretrained("path/to/hf_dir")       # or a maxlm run dir / checkpoints dir / step dir
    m.logits([[1, 2, 3]])                            # float32 [1, 3, vocab]
    m.generate([[1, 2, 3], [4, 5]], 20)              # greedy; a list of new tokens per prompt

`.config` is the full maxlm config (a FrozenConfigDict; the architecture is `.config.model`), `.recipe`
what it builds (maxlm.recipe: the family, the parameter specs, ...), `.params` a plain dict of float32 jax
arrays. With a `mesh`, the params are placed by the config's `sharding_rules` and every call runs under
them, as training does; a mesh with pipeline stages runs the layers through them.
"""

import contextlib
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from maxlm import checkpoint as ckpt, config, generate as gen, models, platforms, recipe as recipe_lib, schedules
from maxlm import sharding, transforms
from maxlm.errors import ConfigError
from maxlm.models import params as P_


class Model:
    """A model's config and parameters, with jitted logits and generation.

    `Model(cfg, params)` wraps parameters you already have; `Model.init(cfg)` initialises fresh ones.
    `dtype` is the activation/matmul dtype (params stay float32); `rules` overrides the config's
    sharding rule table when a `mesh` is given."""

    def __init__(self, cfg, params, mesh=None, dtype="float32", rules=None):
        self.config = cfg
        models.get(cfg.model.family)  # an unknown family is refused here, in one line
        self.recipe = recipe_lib.build(cfg, mesh)
        self.mesh = mesh
        self.rules = rule_table(cfg, mesh, rules)
        self.dtype = check_dtype(dtype)
        self.params = params if mesh is None else jax.device_put(params, self.shardings())

    @classmethod
    def init(cls, cfg, seed: int = 0, mesh=None, dtype="float32", rules=None) -> "Model":
        """A freshly initialised model (the trainer's init for `seed`), created directly in its sharding."""
        check_dtype(dtype)
        specs = recipe_lib.build(cfg, mesh).base_specs
        out = None if mesh is None else sharding.param_shardings(specs, mesh, rule_table(cfg, mesh, rules))
        params = jax.jit(lambda: P_.init(specs, jax.random.key(seed)), out_shardings=out)()
        return cls(cfg, params, mesh, dtype, rules)

    def shardings(self):
        """Each parameter's NamedSharding on the model's mesh under its rules."""
        return sharding.param_shardings(self.recipe.base_specs, self.mesh, self.rules)

    def _context(self):
        return contextlib.nullcontext() if self.mesh is None else sharding.use(self.mesh, self.rules)

    def logits(self, tokens_BL) -> jax.Array:
        """Float32 logits [B, L, V] of token rows [B, L] (a 1-D row is taken as B=1), each row one
        sequence starting at position 0."""
        m = self.config.model
        tokens_BL = np.atleast_2d(gen.token_ids(tokens_BL, "logits: tokens", m.vocab_size))
        if tokens_BL.ndim != 2:
            raise ValueError(f"logits: tokens must be [batch, length], got shape {tokens_BL.shape}")
        if tokens_BL.size == 0:
            raise ValueError(f"logits: tokens are empty (shape {tokens_BL.shape}); give at least one token per row")
        if tokens_BL.shape[1] > m.max_positions:
            raise ValueError(f"logits: length {tokens_BL.shape[1]} exceeds the model's max_positions={m.max_positions}")
        B = tokens_BL.shape[0]
        tokens_BL = np.concatenate([tokens_BL, np.zeros((self._batch_pad(B), tokens_BL.shape[1]), np.int32)])
        with self._context():
            return _logits(self.params, tokens_BL, m=m, dtype=self.dtype, rules=sharding.current_rules())[:B]

    def generate(self, prompt_tokens, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed=0, eos_id=None, pad_id: int = 0):
        """New tokens for each prompt, with a KV cache, all prompts in one batch (ragged allowed).

        `prompt_tokens` is a list of token-id lists (returns a list of lists) or one list of ids
        (returns one list). temperature=0 is greedy; otherwise sampling from softmax(logits/T) after
        optional top-k and top-p filtering, reproducible for a given `seed` (int or jax key). A row
        stops after `eos_id` (included): one id, or a list (a chat template's end-of-turn tokens, e.g. from
        `maxlm.data.chat.stop_ids`). See `maxlm.generate`."""
        try:
            n = None if isinstance(prompt_tokens, (str, bytes)) else len(prompt_tokens)
        except TypeError:  # an int, a 0-d array
            n = None
        if n is None:
            raise ValueError(f"generate: prompt_tokens must be a list of token ids or a list of such lists, "
                             f"got {type(prompt_tokens).__name__}")
        single = n > 0 and not isinstance(prompt_tokens[0], (list, tuple)) and np.ndim(prompt_tokens[0]) == 0
        prompts = [prompt_tokens] if single else list(prompt_tokens)
        B = len(prompts)
        with self._context():
            out = gen.generate(self.params, self.config.model, prompts + [[pad_id]] * self._batch_pad(B), max_new_tokens,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_id=eos_id,
                               pad_id=pad_id, dtype=self.dtype)
        return out[0] if single else out[:B]

    def _batch_pad(self, B: int) -> int:
        """Rows to add so that a batch of B divides over the mesh axes `batch` is sharded on (then
        dropped): an uneven batch would be replicated and resharded, which XLA warns about."""
        if self.mesh is None:
            return 0
        axes = sharding.spec(("batch",), self.rules)[0] or ()
        n = int(np.prod([self.mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes)]))
        return -B % n

    def __repr__(self) -> str:
        m = self.config.model
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))
        where = "one device" if self.mesh is None else " x ".join(f"{k}={v}" for k, v in self.mesh.shape.items())
        return (f"Model({m.family}, {n:,} params, d_model={m.d_model}, n_layers={m.n_layers}, vocab={m.vocab_size}, "
                f"dtype={self.dtype.name}, {where})")


@functools.partial(jax.jit, static_argnames=("m", "dtype", "rules"))
def _logits(params, tokens_BL, *, m, dtype, rules):
    del rules  # the sharding rules in effect when traced: part of the cache key, since `constrain` reads them
    B, L = tokens_BL.shape
    pos_BL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    return models.apply(params, tokens_BL, pos_BL, jnp.ones((B, L), jnp.int32), m, dtype,
                        stack=schedules.inference_stack()).logits


def from_pretrained(path, mesh=None, dtype: str = "float32", rules=None) -> Model:
    """A `Model` from a Hugging Face directory (config.json + *.safetensors) or a maxlm checkpoint: a
    run directory holding `checkpoints/`, a checkpoints directory (its newest step) or one step's
    directory. The config of a maxlm checkpoint is the one its run saved; an HF model's is base.yml's
    defaults with the architecture from config.json."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"from_pretrained: path must be a str or a path, got {type(path).__name__}")
    check_dtype(dtype)  # every argument is checked before a (long) load
    platforms.skip_absent_tpu()  # a notebook's first jax use: libtpu on a machine without a TPU says nothing
    p = epath.Path(path)
    if not p.exists():
        raise ConfigError(f"from_pretrained: {path} does not exist")
    if not p.is_dir():
        raise ConfigError(f"from_pretrained: {path} is a file; name a directory: a Hugging Face model's (config.json + "
                          f"*.safetensors) or a maxlm run, checkpoints or step directory")
    if (p / "config.json").exists():
        from maxlm.convert import hf
        cfg = hf.load_config(path)
        if note := hf.import_note(path):
            print(f"maxlm: {note}")
        table = rule_table(cfg, mesh, rules)
        params = hf.load_params(path, cfg, mesh, table if mesh is not None else None)
        return Model(cfg, params, mesh, dtype, rules)
    directory = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    is_step = directory.name.isdigit() and (directory / "state").exists()
    if not is_step and not (directory.is_dir() and any(c.name.isdigit() for c in directory.iterdir())):
        raise ConfigError(f"from_pretrained: {path} is neither a Hugging Face directory (config.json + *.safetensors) "
                          f"nor a maxlm checkpoint (a run dir with checkpoints/, a checkpoints dir, or one step dir)")
    ck, step = ckpt.resolve_init_from(str(directory), "from_pretrained")
    try:
        cfg = config.from_saved(ck.meta(step)["config"], f"{ck.step_path(step)}", log=lambda m: print(f"maxlm: {m}"))
        if transforms.router_bias_in(ck.meta(step)["config"]):
            raise ConfigError(f"from_pretrained: {ck.step_path(step)} was trained with model.router_bias_rate > 0; its "
                              f"MoE router bias is train state that Model does not load yet, and without it the "
                              f"experts would be chosen differently. Evaluate it with train.py (eval.every)")
        table = rule_table(cfg, mesh, rules)
        specs = recipe_lib.build(cfg, mesh).base_specs
        from maxlm.convert import peft
        if cfg.lora.rank:  # the checkpoint holds the adapters: merged onto the run's base
            placement = jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) if mesh is None else \
                (lambda s: sharding.param_shardings(s, mesh, table))
            return Model(cfg, peft.restore(ck, step, cfg, specs, placement, mesh, table), mesh, dtype, rules)
        abstract = P_.abstract(specs)
        if mesh is None:
            one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            shardings = jax.tree.map(lambda _: one, abstract)
        else:
            shardings = sharding.param_shardings(specs, mesh, table)
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        params = peft.params_of(ck, step, abstract)
    finally:
        ck.close()
    return Model(cfg, params, mesh, dtype, rules)


def check_dtype(dtype) -> jnp.dtype:
    """The activation dtype, or one line naming those the models support."""
    try:
        d = jnp.dtype(dtype)
    except TypeError:  # not a dtype at all ("float17")
        d = None
    if d is None or d.name not in config.DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {', '.join(config.DTYPES)}")
    return d


def rule_table(cfg, mesh, rules) -> tuple:
    """The sharding rule table for `mesh`: the config's, or `rules` given as (logical_axis, mesh_axis |
    (mesh_axes...) | None) pairs. A mistake in either argument is one line, not a failure deep in jit."""
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise ConfigError(f"mesh must be a jax.sharding.Mesh (e.g. from maxlm.mesh.make_mesh) or None, "
                          f"got {type(mesh).__name__}")
    targets = lambda t: t if isinstance(t, tuple) else (t,)  # noqa: E731  (one mesh axis or several)
    if rules is None:
        table = sharding.rules(cfg)
    elif mesh is None:  # without a mesh nothing is sharded: rules would be ignored
        raise ConfigError("rules only apply with a mesh; pass mesh= too, or drop rules")
    else:
        try:
            table = tuple((name, tuple(t) if isinstance(t, (list, tuple)) else t) for name, t in rules)
        except (TypeError, ValueError):  # not iterable, or not pairs
            table = None
        if table is None or not all(isinstance(n, str) and all(a is None or isinstance(a, str) for a in targets(t))
                                    for n, t in table):
            raise ConfigError(f"rules must be (logical_axis, mesh_axis | (mesh_axes...) | None) pairs, got {rules!r}")
    if mesh is not None:
        used = {a for _, t in table for a in targets(t) if a is not None}
        missing = sorted(used - set(mesh.axis_names))
        if missing:
            raise ConfigError(f"the sharding rules use the mesh axes {', '.join(map(repr, missing))}, which mesh "
                              f"{tuple(mesh.axis_names)} lacks; build the mesh with maxlm.mesh.make_mesh, or pass "
                              f"rules= for its axes")
    return table
