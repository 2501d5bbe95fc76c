"""Hugging Face checkpoints in and out: config.json plus safetensors, one file or sharded with
`model.safetensors.index.json`. The per-family names and conversions are the adapters in
maxlm/convert/adapters/ (one per family, found through `adapters.get`); this module only reads, places
and writes. Nothing here touches the network.

Import places one HF tensor at a time: each layer's slice is converted on the host and put straight
onto its devices, and the layer slices are stacked there, so a process holds at most one layer of one
tensor in host memory and no device ever holds more than its own shard of a parameter (plus, for one
parameter at a time, the per-layer pieces being stacked).
"""

import functools
import json
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from maxlm import config, models, sharding
from maxlm.errors import ConfigError
from maxlm.log import log
from maxlm.convert import adapters, tables as T

# Buffers some checkpoints carry that are recomputed, not learned.
IGNORED = re.compile(r".*(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")
# Model keys that are training choices, not architecture: the user's value stands.
USER_KEYS = ("init_std", "router_aux_loss", "router_z_loss", "router_bias_rate", "capacity_factor")
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def read_config(path: str | Path) -> dict:
    d = Path(path)
    if d.name == "config.json" and d.is_file():
        raise ConfigError(f"{d} is the config file; give its directory: init_from=hf:{d.parent}")
    if not (d / "config.json").is_file():
        raise ConfigError(f"{d}: not a Hugging Face model directory (no config.json); expected config.json + *.safetensors")
    try:
        hf = json.loads((d / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{d}/config.json cannot be read: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{d}/config.json holds a {type(hf).__name__}, not the JSON object of a model config")
    return hf


def model_keys(hf: dict, where: str = "config.json") -> dict:
    """maxlm `model.*` values for an HF config.json, or a one-line error naming what is unsupported (and
    `where`, the config.json it came from)."""
    arch = None
    try:
        archs = hf.get("architectures")
        known = adapters.architectures()
        if not isinstance(archs, list):
            raise ConfigError(f"config.json: architectures={archs!r} must be a list of class names, e.g. "
                              f"[\"LlamaForCausalLM\"]")
        arch = next((a for a in archs if isinstance(a, str) and a in known), None)
        if arch is None:
            raise ConfigError(f"config.json: architectures={archs} is not supported; maxlm imports {', '.join(sorted(known))}")
        family = known[arch]
        kind = hf.get("model_type")  # e.g. qwen3_moe or gemma3_text for the qwen3 and gemma3 families
        if isinstance(kind, str) and family not in (kind, kind.removesuffix("_text"), kind.removesuffix("_moe")):
            raise ConfigError(f"config.json: model_type={kind!r} contradicts architectures={archs} (maxlm's {family} "
                              f"family); one of them was edited: fix it")
        adapter = adapters.get(family)
        check_quantization(hf, family, getattr(adapter, "QUANT_METHODS", ()))
        return {"family": family, **adapter.config_from_hf(hf)}
    except KeyError as e:
        raise ConfigError(f"{where} ({arch}) lacks the field {e}") from None
    except ConfigError as e:  # the adapters name the field as `config.json: ...`; name the file
        msg = str(e)
        if where == "config.json" or not msg.startswith("config.json"):
            raise
        raise ConfigError(where + msg[len("config.json"):]) from None


def check_quantization(hf: dict, family: str, methods) -> None:
    """Refuse a quantization_config whose weights maxlm cannot dequantize (AWQ, GPTQ, bitsandbytes, ...),
    before any tensor is read: its packed integer tensors would be missing or cast and trained on."""
    q = hf.get("quantization_config")
    if q is None:
        return
    if not isinstance(q, dict):  # a bare "fp8" would pass as its method, its block size unread
        raise T.unsupported("quantization_config", q, "expected an object holding quant_method")
    method = q.get("quant_method")
    if method not in methods:
        reads = f"its {family} import dequantizes {' and '.join(methods)} only" if methods else \
            "its weights cannot be dequantized"
        raise T.unsupported("quantization_config.quant_method", method, f"{reads}; import the unquantized (float) "
                                                                         f"checkpoint")


def import_note(path: str | Path) -> str | None:
    """What importing this checkpoint leaves out, in one line to log (Gemma 3's vision tower), or None."""
    c = read_config(path)
    note = getattr(adapters.get(model_keys(c)["family"]), "import_note", None)
    return note(c) if note else None


def with_hf_model(cfg, path: str | Path, explicit=()):
    """`cfg` with its model section taken from an HF directory's config.json. A model key the user set
    to something else (neither the default nor the checkpoint's value, or any value for a key named in
    `explicit`, the command line's `model.*` keys) is an error, not overridden. `seq_len` left at its
    default is capped at the checkpoint's max_positions."""
    keys = model_keys(read_config(path), str(Path(path) / "config.json"))
    d = config.to_dict(cfg)
    base = config.to_dict(config.load(None))
    default = base["model"]
    model = {}
    for k, v in keys.items():
        user = d["model"][k]
        chosen = user != default[k] or f"model.{k}" in explicit
        if k in USER_KEYS and chosen:
            continue
        if chosen and user != v:
            raise ConfigError(f"model.{k}={user!r} contradicts {path}/config.json ({v!r}); the architecture comes "
                              f"from the checkpoint: remove the override")
        model[k] = v
    changes = {"model": model}
    # base.yml's seq_len (1024) is nobody's choice for a checkpoint with fewer positions (a 64-position
    # GPT-2 would be refused for inference, which never uses it): cap it there. A seq_len the user set
    # above max_positions is still refused by validate, for the learned-position families.
    if d["seq_len"] == base["seq_len"] > keys.get("max_positions", d["model"]["max_positions"]):
        changes["seq_len"] = keys.get("max_positions", d["model"]["max_positions"])
    return config.replace(cfg, changes)


def load_config(path: str | Path, overrides: list[str] = ()):
    """A full maxlm config (base.yml defaults + `overrides`) whose model is the HF checkpoint's."""
    return with_hf_model(config.load(None, list(overrides), model_pending=True), path)


class SafeTensors:
    """The tensors of an HF directory by name, read lazily (safetensors memory-maps each file)."""

    def __init__(self, path: str | Path, prefix: str = "", rename=None, derive=None):
        from safetensors import SafetensorError, safe_open
        self.dir = Path(path)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"{index} cannot be read as a safetensors index ({type(e).__name__}: {e}); "
                                  f"expected {{\"weight_map\": {{tensor: file}}}}") from None
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise ConfigError(f"{self.dir}: no *.safetensors files (maxlm does not read pytorch_model.bin; save the model "
                              f"with save_pretrained(safe_serialization=True))")
        self.files = {}
        for name in files:
            if not (self.dir / name).is_file():
                raise ConfigError(f"{index}: names {name}, which is missing from {self.dir}")
            try:
                self.files[name] = safe_open(str(self.dir / name), framework="np")
            except (OSError, SafetensorError) as e:  # truncated, not safetensors, unreadable
                raise ConfigError(f"{self.dir / name} cannot be read as safetensors: {e}") from None
        if weight_map is None:  # without an index, a name in two files would be read from either
            self.where = {}
            for name, f in self.files.items():
                for k in f.keys():
                    if self.where.setdefault(k, name) != name:
                        raise ConfigError(f"{self.dir}: tensor `{k}` is in both {self.where[k]} and {name}, and no "
                                          f"model.safetensors.index.json says which to read; remove the stale file")
        else:
            self.where = weight_map
        self.stored: dict = {}  # name -> name in the file, where they differ
        if prefix and not any(n.startswith(prefix) for n in self.where):
            # Saved from the bare base model (GPT-2's files on the hub): its names lack the LM class's prefix.
            self.stored = {prefix + n: n for n in self.where}
            self.where = {prefix + n: f for n, f in self.where.items()}
        if rename is not None:  # the adapter's checkpoint_names: stored name -> its name, or None to drop
            names = rename(list(self.where))
            self.stored = {names[n]: n for n in self.where if names[n] is not None}
            self.where = {names[n]: f for n, f in self.where.items() if names[n] is not None}
        self._file = dict(self.where)  # every stored tensor's file, derived sources included
        self.derived = derive(set(self.where)) if derive is not None else {}  # the adapter's derived_tensors
        for name, (_, sources) in self.derived.items():  # a derived tensor replaces the ones it is made of
            f = self.where[sources[0]]
            for s in sources:
                del self.where[s]
            self.where[name] = f

    def get(self, name: str) -> np.ndarray:
        if name in self.derived:
            fn, sources = self.derived[name]
            arrays = [self._read(s) for s in sources]
            try:
                return fn(*arrays)
            except (ValueError, TypeError) as e:  # sources of the wrong shapes or types
                parts = ", ".join(f"`{s}` {a.dtype} {list(a.shape)}" for s, a in zip(sources, arrays))
                raise ConfigError(f"{self.dir}: tensor `{name}` cannot be made from {parts}: "
                                  f"{' '.join(str(e).split())}") from None
        return self._read(name)

    def header(self, name: str) -> tuple[str, list[int]] | None:
        """A stored tensor's safetensors dtype ("F32", "I32", ...) and shape, from the file's header (no
        data read); None for a derived tensor."""
        if name in self.derived:
            return None
        s = self.files[self._file[name]].get_slice(self.stored.get(name, name))
        return s.get_dtype(), list(s.get_shape())

    def _read(self, name: str) -> np.ndarray:
        f, stored = self.files[self._file[name]], self.stored.get(name, name)
        kind = f.get_slice(stored).get_dtype()
        if kind in FP8:  # numpy has no FP8 type, so safetensors' numpy reader refuses these: map the bytes
            return _fp8_tensor(self.dir / self._file[name], stored, FP8[kind])
        return f.get_tensor(stored)


FP8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _fp8_tensor(path: Path, name: str, dtype) -> np.ndarray:
    """A tensor of a safetensors file read from its header's offsets (8-byte header size, JSON header,
    then the data) as the ml_dtypes FP8 type."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(n))[name]
    return np.memmap(path, dtype, "r", offset=8 + n + entry["data_offsets"][0], shape=tuple(entry["shape"]))


def _expand(t, m) -> list[tuple[str, tuple[int, ...]]]:
    """(name, index in its stack) for every layer {i} and expert {j} a tensor's name template stands for."""
    first, count = t.layers or (0, m.n_layers)
    if "{j}" in t.hf:
        return [(t.hf.format(i=first + i, j=j), (i, j)) for i in range(count) for j in range(m.n_experts)]
    if "{i}" in t.hf:
        return [(t.hf.format(i=first + i), (i,)) for i in range(count)]
    return [(t.hf, ())]


def _lookup(tree: dict, path: str):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _assign(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def check_names(st: SafeTensors, tensors, m) -> None:
    expected = {name for t in tensors for name, _ in _expand(t, m)}
    missing = sorted(expected - set(st.where))
    if missing:
        raise ConfigError(f"{st.dir}: tensor `{missing[0]}` is missing ({len(missing)} missing in all); the checkpoint "
                          f"does not match its config.json")
    extra = set(st.where) - expected
    unplaced = sorted(n for n in extra if not IGNORED.match(n) and not (m.tie_embeddings and n == "lm_head.weight"))
    if m.tie_embeddings and "lm_head.weight" in extra:  # transformers ignores it too, aloud here
        log(f"{st.dir}: tensor `lm_head.weight` is not read: this {m.family} model ties its output layer to the "
            f"embedding (tie_word_embeddings), as transformers does; set tie_word_embeddings false in config.json "
            f"to train it as its own")
    if unplaced:
        raise ConfigError(f"{st.dir}: tensor `{unplaced[0]}` has no place in maxlm's {m.family} model ({len(unplaced)} "
                          f"unused in all); refusing to drop weights silently")


def hf_shape(t, slice_shapes) -> tuple[int, ...]:
    """The shape of one HF tensor of `t` (one layer's, one expert's) that fills `slice_shapes`: what `to_hf`
    makes of them, computed on zero-stride arrays (nothing of their size is allocated but what a stack or
    concatenation copies: one layer's slice, in bytes)."""
    zero = np.zeros((), np.int8)
    return t.to_hf(*(np.broadcast_to(zero, s) for s in slice_shapes)).shape


def check_tensor(d, name: str, dtype: str, integer: bool, shape, want) -> None:
    """Refuse an HF tensor maxlm would cast or reshape into something else: integers (a quantized export's
    packed weights), or a shape other than `want`, the one its config.json implies."""
    if integer:
        raise ConfigError(f"{d}: tensor `{name}` holds {dtype} integers, not weights: maxlm reads float tensors "
                          f"(a quantized export's packed weights? import the unquantized checkpoint)")
    if tuple(shape) != tuple(want):
        raise ConfigError(f"{d}: tensor `{name}` has the shape {list(shape)}, expected {list(want)} from its "
                          f"config.json; the checkpoint does not match its config.json")


INTEGER = ("I", "U", "BOOL")  # the prefixes of safetensors' integer dtypes (I32, U8, BOOL, ...)


def load_params(path: str | Path, cfg, mesh=None, rule_table=None) -> dict:
    """The checkpoint's parameters as float32 jax arrays, sharded by the rule table over `mesh` (or on
    the default device when no mesh is given)."""
    m = cfg.model
    specs = models.get(m.family).param_specs(m)
    adapter = adapters.get(m.family)
    tensors = adapter.hf_tensors(m)
    rename = getattr(adapter, "checkpoint_names", None)
    st = SafeTensors(path, getattr(adapter, "HF_PREFIX", ""), rename and (lambda n: rename(n, read_config(path), m)),
                     getattr(adapter, "derived_tensors", None))
    check_names(st, tensors, m)
    plan = []  # per tensor: its maxlm specs, one layer's slice shapes, and the shape of one HF tensor
    for t in tensors:
        stacked = 2 if "{j}" in t.hf else 1 if "{i}" in t.hf else 0
        spec_of = [_lookup(specs, p) for p in t.paths]
        slice_shapes = [s.shape[stacked:] for s in spec_of]
        plan.append((t, stacked, spec_of, slice_shapes, hf_shape(t, slice_shapes)))
    for t, _, _, _, want in plan:  # every stored tensor's dtype and shape, from the headers, before reading any
        for name, _ in _expand(t, m):
            if (h := st.header(name)) is not None:
                check_tensor(st.dir, name, h[0], h[0].startswith(INTEGER), h[1], want)
    if mesh is None:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
        rule_table = ()
    params: dict = {}
    for t, stacked, spec_of, slice_shapes, want in plan:
        pieces: list[list] = [[] for _ in t.paths]
        names = _expand(t, m)
        per_layer = m.n_experts if stacked == 2 else 1
        for start in range(0, len(names), per_layer):  # one layer (all its experts) at a time
            group = [t.to_maxlm(_read(st, name, want), slice_shapes) for name, _ in names[start:start + per_layer]]
            for k, s in enumerate(spec_of):
                host = np.stack([g[k] for g in group]) if stacked == 2 else group[0][k]
                pieces[k].append(_place(host, s.axes[1 if stacked else 0:], mesh, rule_table))
        for k, (p, s) in enumerate(zip(t.paths, spec_of)):
            full = _place_spec(s.shape, s.axes, mesh, rule_table)
            value = pieces[k][0] if not stacked else _stacker(full)(*pieces[k])
            if value.shape != s.shape:
                raise ConfigError(f"{st.dir}: `{t.hf}` gives {p} the shape {value.shape}, expected {s.shape}")
            _assign(params, p, value)
    return params


def _read(st: SafeTensors, name: str, want) -> np.ndarray:
    """One HF tensor as float32, checked (a derived one's dtype and shape are known only once it is made)."""
    a = st.get(name)
    check_tensor(st.dir, name, str(a.dtype), a.dtype.kind in "biu", a.shape, want)
    a = a.astype(np.float32)
    if not np.isfinite(a).all():  # else "non-finite loss at step 1", exit 3, naming nothing
        bad = int(np.size(a) - np.isfinite(a).sum())
        raise ConfigError(f"{st.dir}: tensor `{name}` holds {bad} NaN or infinite value(s) of {a.size}; the "
                          f"checkpoint is damaged")
    return a


@functools.lru_cache
def _stacker(out: NamedSharding):
    """One compiled stack per output sharding: parameters (and checkpoints) of one shape then share it."""
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=out)


def _place_spec(shape, axes, mesh, rule_table) -> NamedSharding:
    """As the train state lays the parameter out (sharding.param_shardings)."""
    return NamedSharding(mesh, sharding.param_spec(shape, axes, rule_table) if rule_table else P())


def _place(host: np.ndarray, axes, mesh, rule_table) -> jax.Array:
    sh = _place_spec(host.shape, axes, mesh, rule_table)
    return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx])


def save(params, m, out_dir: str | Path, dtype: str = "float32", max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write config.json and safetensors (split at `max_shard_bytes`, with an index when split) that
    `transformers` loads as is, replacing a previous export's weight files in `out_dir`. Returns the
    files written; a file that cannot be written is a one-line ConfigError naming it and the cause."""
    adapter = adapters.get(m.family)
    hf_cfg = {**adapter.config_to_hf(m), "torch_dtype": dtype}  # first: it refuses what HF cannot express
    out = Path(out_dir)
    checked_io(out, lambda: out.mkdir(parents=True, exist_ok=True))
    params = jax.tree.map(np.asarray, jax.device_get(params))
    shards: list[dict] = [{}]
    size = 0
    for t in getattr(adapter, "export_tensors", adapter.hf_tensors)(m):
        for name, idx in _expand(t, m):
            arr = np.ascontiguousarray(t.to_hf(*[_lookup(params, p)[idx] for p in t.paths]).astype(DTYPES[dtype]))
            if size and size + arr.nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = arr
            size += arr.nbytes
    written = []
    if len(shards) == 1:
        written.append(save_file(shards[0], out / "model.safetensors"))
    else:
        weight_map = {}
        for n, shard in enumerate(shards, 1):
            fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            written.append(save_file(shard, out / fname))
            weight_map.update({k: fname for k in shard})
        total = sum(a.nbytes for s in shards for a in s.values())
        written.append(write_text(out / "model.safetensors.index.json",
                                   json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)))
    written.append(write_text(out / "config.json", json.dumps(hf_cfg, indent=2, sort_keys=True)))
    # A previous export's other shards or index would be read with (or instead of) these: remove them.
    for stale in out.glob("model*.safetensors*"):
        ours = re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", stale.name)
        if ours and stale not in written:
            checked_io(stale, stale.unlink, "remove the stale")
    return written


def checked_io(path: Path, act, what: str = "write"):
    """`act()`, with an OS error turned into one line naming `path` and the cause."""
    try:
        return act()
    except OSError as e:
        raise ConfigError(f"cannot {what} {path}: {e.strerror or e}") from None


def write_text(path: Path, text: str) -> Path:
    checked_io(path, lambda: path.write_text(text))
    return path


def save_file(tensors: dict, path: Path) -> Path:
    """safetensors' save_file, which writes a temporary file (mode 0600) and renames it: the file then
    gets the mode any new file gets (0666 less the umask), as config.json does, so others can read it."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as e:  # its message names the temporary file; keep only the cause
        cause = re.sub(r"^Error while serializing: |\s*at path .*$", "", str(e))
        raise ConfigError(f"cannot write {path}: {cause}") from None
    checked_io(path, lambda: path.chmod(0o666 & ~_umask()))
    return path


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask
