"""Generation and the notebook API: KV-cache decoding equals full recomputation, a ragged batch equals
its rows run alone, sampling filters do what they say, and `maxlm.from_pretrained` loads a maxlm
checkpoint (on one device or a mesh) and a Hugging Face directory (greedy tokens equal transformers')."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import oracle, params_checkpoint

import maxlm
from maxlm import api, config, generate as G, mesh as mesh_lib, models, sharding
from maxlm.api import Model
from maxlm.config import ConfigError, load
from maxlm.models import params as P_

# init_std 0.3 makes the logits of a random model peaked, so greedy paths are far from ties.
TINY = ["model.vocab_size=128", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.head_dim=8", "model.d_ff=64", "model.init_std=0.3", "dtype=float32"]
VARIANTS = {"gqa": [], "gqa_window3_qknorm": ["model.sliding_window=3", "model.qk_norm=true"],
            # learned positions: left padding that shifted them would change every logit
            "gpt2": ["model.family=gpt2", "model.n_kv_heads=4", "model.tie_embeddings=true", "model.max_positions=64",
                     "seq_len=32"]}
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [11, 2, 70]]
N = 12  # new tokens; one length throughout, so the tests share compiled functions


def tiny(overrides=(), seed=0):
    cfg = load(None, TINY + list(overrides))
    return cfg, P_.init(models.get(cfg.model.family).param_specs(cfg.model), jax.random.key(seed))


@functools.partial(jax.jit, static_argnames="m")
def _forward(params, tokens_BL, seg_BL, m):
    pos_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1], dtype=jnp.int32), tokens_BL.shape)
    return models.apply(params, tokens_BL, pos_BL, seg_BL, m, jnp.float32).logits


def full_logits(params, m, rows) -> list[np.ndarray]:
    """Logits [L, V] of each sequence computed from scratch, without a cache (right-padded to 32 in one
    batch: causal, so the padding changes nothing before it)."""
    tokens, seg = np.zeros((len(rows), 32), np.int32), np.zeros((len(rows), 32), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)], seg[i, :len(r)] = r, 1
    out = np.asarray(_forward(params, tokens, seg, m))
    return [out[i, :len(r)] for i, r in enumerate(rows)]


def rel(got, ref) -> float:
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module")
def llama():
    return tiny()


# ---- KV cache ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_kv_cache_decoding_equals_full_recomputation(variant):
    cfg, params = tiny(VARIANTS[variant])
    m = cfg.model
    g = G.decode(params, m, PROMPTS, N, return_logits=True)
    assert g.tokens.shape == (2, N) and g.logits.shape == (2, N, m.vocab_size) and list(g.lengths) == [N, N]
    seqs = [p + g.tokens[i, :-1].tolist() for i, p in enumerate(PROMPTS)]
    for i, (prompt, full) in enumerate(zip(PROMPTS, full_logits(params, m, seqs))):
        ref = full[len(prompt) - 1:]  # the logits each new token was chosen from
        assert rel(g.logits[i], ref) < 1e-5, variant
        # Greedy against recomputed logits: by induction, the same tokens a cache-free loop would pick.
        assert (ref.argmax(-1) == g.tokens[i]).all(), variant
    if m.sliding_window:  # the window really matters here: full attention gives other logits
        unwindowed = full_logits(params, load(None, TINY + ["model.qk_norm=true"]).model, seqs)
        assert rel(unwindowed[0], full_logits(params, m, seqs)[0]) > 1e-2


def test_ragged_batch_rows_equal_rows_alone(llama):
    cfg, params = llama
    batch = G.generate(params, cfg.model, PROMPTS, N)  # lengths 7 and 3: the second row has 5 pads
    for i, p in enumerate(PROMPTS):
        assert batch[i] == G.generate(params, cfg.model, [p], N)[0], i
    # Left padding must not shift positions: the first new token equals a plain forward's next token.
    assert [b[0] for b in batch] == [f[-1].argmax() for f in full_logits(params, cfg.model, PROMPTS)]


def test_eos_stops_each_row_and_the_lists_end_at_it(llama):
    cfg, params = llama
    free = G.decode(params, cfg.model, PROMPTS, N)
    eos = int(free.tokens[0, 3])
    out = Model(cfg, params).generate(PROMPTS, N, eos_id=eos)
    for row, got in zip(free.tokens.tolist(), out):
        want = row[:row.index(eos) + 1] if eos in row else row
        assert got == want
    assert out[0][-1] == eos and len(out[0]) <= 4
    g = G.decode(params, cfg.model, PROMPTS, N, eos_id=eos)
    assert (g.tokens[0, g.lengths[0]:] == eos).all()  # a finished row keeps emitting eos


def test_any_of_several_stop_ids_ends_a_row(llama):
    """A chat template's end-of-turn token and the tokenizer's EOS: whichever comes first ends the row."""
    cfg, params = llama
    free = G.decode(params, cfg.model, PROMPTS, N)
    a, b = int(free.tokens[0, 2]), int(free.tokens[1, 1])
    out = G.generate(params, cfg.model, PROMPTS, N, eos_id=[a, b])
    for row, got in zip(free.tokens.tolist(), out):
        end = next((j for j, t in enumerate(row) if t in (a, b)), len(row) - 1)
        assert got == row[:end + 1]
    assert out[0][-1] in (a, b) and out[1][-1] in (a, b)


# ---- Sampling ------------------------------------------------------------------------------------------
def test_top_k_1_and_tiny_top_p_are_greedy(llama):
    cfg, params = llama
    m = Model(cfg, params)
    greedy = m.generate(PROMPTS, N)
    assert m.generate(PROMPTS, N, temperature=1.5, top_k=1, seed=3) == greedy
    assert m.generate(PROMPTS, N, temperature=1.5, top_p=1e-6, seed=3) == greedy


def test_sampling_is_reproducible_and_stays_in_the_top_k(llama):
    cfg, params = llama
    m = Model(cfg, params)
    a, b, c = (m.generate(PROMPTS, N, temperature=3.0, top_k=5, seed=s) for s in (7, 7, 8))
    assert a == b and a != c
    seqs = [p + t[:-1] for p, t in zip(PROMPTS, a)]
    for p, t, full in zip(PROMPTS, a, full_logits(params, cfg.model, seqs)):
        logits = full[len(p) - 1:]
        rank = (logits > np.take_along_axis(logits, np.array(t)[:, None], -1)).sum(-1)  # tokens ranked above the pick
        assert rank.max() < 5 and rank.max() > 0  # inside the top 5, and not simply greedy


def test_filter_logits_top_k_and_nucleus():
    logits = jnp.log(jnp.asarray([[0.15, 0.5, 0.05, 0.3]]))
    kept = lambda **kw: np.isfinite(np.asarray(G.filter_logits(logits, **kw)))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [False, True, False, True]
    assert kept(top_p=0.7) == [False, True, False, True]   # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert kept(top_p=0.8) == [False, True, False, True]   # exactly reached by two
    assert kept(top_p=0.81) == [True, True, False, True]
    assert kept(top_p=0.9, top_k=2) == [False, True, False, True]  # top-k first, then the nucleus
    assert kept(top_p=1e-9) == [False, True, False, False]


@pytest.mark.malformed
def test_refusals_are_one_line(llama):
    cfg, params = llama
    m = Model(cfg, params)
    for call, msg in [(lambda: m.generate([[1, 2]], cfg.model.max_positions), "exceeds the model's max_positions"),
                      (lambda: m.generate([[1], []], 3), "prompt 1 is empty"),
                      (lambda: m.generate([[1, 128]], 3), "outside the vocabulary"),
                      (lambda: m.generate([[1]], 3, temperature=1.0, top_p=0.0), "top_p must be in (0, 1]")]:
        with pytest.raises(ValueError) as e:
            call()
        assert msg in str(e.value) and "\n" not in str(e.value)
    gpt2 = Model(*tiny(VARIANTS["gpt2"]))  # 64 learned positions: 60 + 5 would index past the table
    with pytest.raises(ValueError, match=r"= 65 exceeds the model's max_positions=64"):
        gpt2.generate([[1] * 60], 5)


ARG_MISTAKES = [  # (call on a llama Model with vocab 128, the one line it gives)
    (lambda m: m.generate([[1.5, 2.0]], 3), "generate: prompt 0 must be integer token ids, got 1.5 (float64)"),
    (lambda m: m.generate([1.0, 2.0], 3), "generate: prompt 0 must be integer token ids, got 1.0 (float64)"),
    (lambda m: m.generate([["a", "b"]], 3), "generate: prompt 0 must be integer token ids, got 'a'"),
    (lambda m: m.generate([[1, -2]], 3), "generate: prompt 0: token id -2 is outside the vocabulary 0..127"),
    (lambda m: m.generate([[1], [999]], 3), "generate: prompt 1: token id 999 is outside the vocabulary 0..127"),
    (lambda m: m.generate([[[1, 2]]], 3), "generate: prompt 0 must be a flat list of token ids, got shape (1, 2)"),
    (lambda m: m.generate([[1, [2, 3]]], 3), "generate: prompt 0 is not a rectangular array of integer ids"),
    (lambda m: m.generate([], 3), "generate: no prompts given"),
    (lambda m: m.generate([[]], 3), "generate: prompt 0 is empty"),
    (lambda m: m.generate("hello", 3), "generate: prompt_tokens must be a list of token ids or a list of such lists"),
    (lambda m: m.generate(7, 3), "generate: prompt_tokens must be a list of token ids or a list of such lists, got int"),
    (lambda m: m.generate([[1, 2]], -1), "generate: max_new_tokens must be an integer >= 0, got -1"),
    (lambda m: m.generate([[1, 2]], 2.5), "generate: max_new_tokens must be an integer >= 0, got 2.5"),
    (lambda m: m.generate([[1, 2]], "3"), "generate: max_new_tokens must be an integer >= 0, got '3'"),
    (lambda m: m.generate([[1, 2]], 3, eos_id=128), "generate: eos_id must be a token id in 0..127, a non-empty list of them, or None; got 128"),
    (lambda m: m.generate([[1, 2]], 3, eos_id=-1), "generate: eos_id must be a token id in 0..127, a non-empty list of them, or None; got -1"),
    (lambda m: m.generate([[1, 2]], 3, eos_id=2.0), "generate: eos_id must be a token id in 0..127, a non-empty list of them, or None; got 2.0"),
    (lambda m: m.generate([[1, 2]], 3, eos_id=[]), "generate: eos_id must be a token id in 0..127, a non-empty list of them, or None; got []"),
    (lambda m: m.generate([[1, 2], [3]], 3, pad_id=500), "generate: pad_id must be a token id in 0..127, got 500"),
    (lambda m: m.generate([[1]], 3, temperature=float("nan")), "generate: temperature must be a finite number >= 0"),
    (lambda m: m.generate([[1]], 3, temperature=1.0, top_k=2.5), "generate: top_k must be an integer >= 1"),
    (lambda m: m.generate([[1]], 3, temperature=1.0, seed="x"), "generate: seed must be an integer or a jax.random.key"),
    (lambda m: m.logits([[1.5, 2.0]]), "logits: tokens must be integer token ids, got 1.5 (float64)"),
    (lambda m: m.logits(np.array([[1.0, 2.0]])), "logits: tokens must be integer token ids, got 1.0 (float64)"),
    (lambda m: m.logits([[True, False]]), "logits: tokens must be integer token ids, got True (bool)"),
    (lambda m: m.logits([[1, 128]]), "logits: tokens: token id 128 is outside the vocabulary 0..127"),
    (lambda m: m.logits([[1, 2], [3]]), "logits: tokens is not a rectangular array of integer ids"),
    (lambda m: m.logits([]), "logits: tokens are empty"),
]


@pytest.mark.malformed
@pytest.mark.parametrize("call, message", ARG_MISTAKES, ids=[m for _, m in ARG_MISTAKES])
def test_argument_mistakes_name_the_argument(llama, call, message):
    """Nothing is cast silently (1.5 is not token 1) and no mistake reaches numpy or jit."""
    with pytest.raises(ValueError) as e:
        call(Model(*llama))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_generate_takes_numpy_and_jax_values(llama):
    m = Model(*llama)
    want = m.generate([[1, 2]], 3, eos_id=127)
    assert m.generate(np.array([[1, 2]]), np.int64(3), eos_id=np.int32(127)) == want
    assert m.generate(jnp.array([1, 2]), 3, eos_id=jnp.int32(127)) == want[0]


@pytest.mark.parametrize("make", [lambda cfg, p: Model(cfg, p, dtype="float17"),
                                  lambda cfg, p: Model(cfg, p, dtype="int32"),
                                  lambda cfg, p: Model.init(cfg, dtype="float16")])
def test_model_dtype_is_checked(llama, make):
    with pytest.raises(ConfigError, match=r"^dtype='\w+' is not supported; use one of float32, bfloat16$"):
        make(*llama)


# ---- from_pretrained: a maxlm checkpoint -------------------------------------------------------------
@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with one checkpoint laid out as the trainer writes it: `state/params/...` and the
    run's config in `meta` (the optimizer state, which from_pretrained never reads, is left out)."""
    cfg, params = tiny(seed=3)
    d = params_checkpoint(tmp_path_factory.mktemp("run"), cfg, params)
    return d, cfg, jax.tree.map(np.asarray, jax.device_get(params))


def test_from_pretrained_maxlm_checkpoint(run_dir):
    d, cfg, params = run_dir
    m = maxlm.from_pretrained(d)
    assert config.to_dict(m.config) == config.to_dict(cfg)
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(params)):
        assert np.asarray(a).tobytes() == b.tobytes()
    toks = np.array([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])
    got = m.logits(toks)
    assert got.dtype == jnp.float32 and got.shape == (2, 8, 128)
    # Two float32 programs of the same function, fused differently (the suite compiles at -O0): CI saw 1.02e-6.
    assert rel(np.asarray(got)[0], full_logits(m.params, cfg.model, toks.tolist())[0]) < 1e-5
    step_dir = maxlm.from_pretrained(d / "checkpoints" / "4")  # the step's directory works too
    assert step_dir.generate(PROMPTS, N) == m.generate(PROMPTS, N)


def test_from_pretrained_on_a_mesh_matches_one_device(run_dir):
    d, cfg, _ = run_dir
    m = maxlm.from_pretrained(d)
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 2, "tensor": 2, "expert": 1}, jax.devices()[:4])
    ms = maxlm.from_pretrained(d, mesh=mesh)
    wq = ms.params["layers"]["wq"]
    assert wq.sharding.spec == sharding.spec(("layers", "embed", "heads", "head_dim"), ms.rules)
    assert len(wq.sharding.device_set) == 4
    toks = np.array([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])
    assert rel(np.asarray(ms.logits(toks)), np.asarray(m.logits(toks))) < 1e-5
    assert ms.generate(PROMPTS, N) == m.generate(PROMPTS, N)
    assert ms.generate(PROMPTS[1], N) == m.generate(PROMPTS, N)[1]  # one row: padded to divide over fsdp


def test_import_maxlm_is_cheap_and_lazy():
    import subprocess
    import sys
    code = "import sys, maxlm; assert 'jax' not in sys.modules; print(maxlm.__version__)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=config.BASE.parent.parent)
    assert r.returncode == 0, r.stderr
    assert maxlm.from_pretrained is api.from_pretrained and maxlm.Model is Model


@pytest.mark.malformed
def test_from_pretrained_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        maxlm.from_pretrained(tmp_path / "nope")
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ConfigError, match="neither a Hugging Face directory"):
        maxlm.from_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="notes.txt is a file; name a directory"):
        maxlm.from_pretrained(tmp_path / "notes.txt")
    with pytest.raises(ConfigError, match="path must be a str or a path, got int"):
        maxlm.from_pretrained(3)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match=r"config.json cannot be read: Expecting property name"):
        maxlm.from_pretrained(hf_dir)
    (hf_dir / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"config.json holds a list, not the JSON object"):
        maxlm.from_pretrained(hf_dir)


@pytest.mark.malformed
def test_from_pretrained_refuses_a_bad_dtype_mesh_or_rules(run_dir):
    d = run_dir[0]
    mesh = mesh_lib.make_mesh({"data": 1, "fsdp": 2, "tensor": 1, "expert": 1}, jax.devices()[:2])
    lone_x = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    for kw, message in [
        (dict(dtype="float17"), "dtype='float17' is not supported; use one of float32, bfloat16"),
        (dict(mesh="fsdp"), "mesh must be a jax.sharding.Mesh (e.g. from maxlm.mesh.make_mesh) or None, got str"),
        (dict(mesh=lone_x), "use the mesh axes 'context', 'data', 'expert', 'fsdp', 'stage', 'tensor', which mesh ('x',) lacks"),
        (dict(rules=[("embed", "fsdp")]), "rules only apply with a mesh; pass mesh= too"),
        (dict(mesh=mesh, rules=5), "rules must be (logical_axis, mesh_axis | (mesh_axes...) | None) pairs, got 5"),
        (dict(mesh=mesh, rules=[("embed", 3)]), "rules must be (logical_axis, mesh_axis | (mesh_axes...) | None) pairs"),
        (dict(mesh=mesh, rules=[("embed", "nope")]), "use the mesh axes 'nope', which mesh ('stage', 'data', 'fsdp', 'tensor', "),
    ]:
        with pytest.raises(ConfigError) as e:
            maxlm.from_pretrained(d, **kw)
        assert message in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))


# ---- from_pretrained: a Hugging Face directory -----------------------------------------------------
def test_greedy_generation_equals_transformers(tmp_path):
    torch = oracle("torch")
    oracle("transformers")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend (seconds per call on 2 busy cores)
    try:
        _greedy_generation_equals_transformers(tmp_path, torch)
    finally:
        torch.set_num_threads(threads)


def _greedy_generation_equals_transformers(tmp_path, torch):
    import transformers
    hf_cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                                      initializer_range=0.3, tie_word_embeddings=False,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(hf_cfg).eval()
    ref.save_pretrained(tmp_path)
    m = maxlm.from_pretrained(tmp_path)
    assert m.config.model.family == "llama" and m.config.model.max_positions == 64
    toks = np.array([[5, 17, 3, 88, 41, 9, 60], [11, 2, 70, 4, 4, 19, 33]])
    # Ragged prompts, left-padded for transformers with an attention mask (it derives positions from it).
    ids = torch.as_tensor([[0, 0, 0, 0, 11, 2, 70], toks[0].tolist()])
    mask = torch.as_tensor([[0, 0, 0, 0, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        ref_logits = ref(torch.as_tensor(toks)).logits.numpy()
        ref_out = ref.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert rel(np.asarray(m.logits(toks)), ref_logits) <= 1e-4
    want = ref_out[:, ids.shape[1]:].tolist()
    assert len(want[0]) == 20 and min(len(set(w)) for w in want) > 3  # not stopped early, not one repeated token
    assert m.generate([[11, 2, 70], toks[0].tolist()], 20) == want
