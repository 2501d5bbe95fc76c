"""Tokenizers from local files: tests train their own tiny BPE and SentencePiece models."""

import io

import numpy as np
import pytest

from maxlm.config import ConfigError
from maxlm.data import tokenizer

TEXT = ["hello world, this is a tiny corpus.", "the quick brown fox jumps over the lazy dog"] * 20


def make_hf(path, specials=("<unk>", "<s>", "</s>")):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


def make_sp(path):
    import sentencepiece

    out = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_writer=out, vocab_size=32,
                                             unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    path.write_bytes(out.getvalue())
    return path


def test_byte():
    tok = tokenizer.load("byte")
    ids = tokenizer.document_ids(tok, "héllo", add_bos=True, add_eos=True)
    assert ids.tolist() == [256, *"héllo".encode(), 257] and ids.dtype == np.int32
    assert tok.decode(ids) == "héllo"
    assert tokenizer.ids_needed(tok, False, False) == 256 and tokenizer.ids_needed(tok, False, True) == 258


def test_hugging_face_file(tmp_path):
    tok = tokenizer.load(str(make_hf(tmp_path / "tokenizer.json")))
    ids = tokenizer.document_ids(tok, "hello fox", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id == 1 and ids[-1] == tok.eos_id == 2
    assert tok.decode(ids[1:-1]) == "hello fox" and tok.vocab_size == 300


def test_sentencepiece_file(tmp_path):
    tok = tokenizer.load(str(make_sp(tmp_path / "sp.model")))
    ids = tokenizer.document_ids(tok, "hello fox", add_bos=True, add_eos=False)
    assert ids[0] == tok.bos_id == 1 and tok.decode(ids[1:]) == "hello fox" and tok.vocab_size == 32


@pytest.mark.malformed
def test_missing_bos_is_an_error(tmp_path):
    tok = tokenizer.load(str(make_hf(tmp_path / "t.json", specials=("<unk>",))))
    assert tokenizer.document_ids(tok, "hello", False, False).size > 0
    with pytest.raises(ConfigError, match=r"`data.add_bos`: tokenizer .* has no BOS token \(looked for "):
        tokenizer.document_ids(tok, "hello", True, False)


@pytest.mark.malformed
@pytest.mark.parametrize("name, content, message", [
    ("nope.json", None, "no file"),
    ("vocab.txt", "a b c", "neither a Hugging Face tokenizer.json nor a SentencePiece .model"),
    ("broken.json", '{"model": 3}', "does not load as a Hugging Face tokenizer: "),
    ("broken.model", "not a protobuf", "does not load as a SentencePiece tokenizer: "),
])
def test_files_that_do_not_load_fail_in_one_line(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as e:
        tokenizer.load(str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def loader(overrides):
    import jax

    from maxlm import mesh as mesh_lib, sharding
    from maxlm.config import load
    from maxlm.data import make_loader

    cfg = load("configs/tiny.yml", ["seq_len=32", "global_batch_size=8", *overrides])
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 8), jax.devices())
    return make_loader(cfg, sharding.named(m, ("batch", "length"), sharding.rules(cfg)))


def test_pipeline_uses_the_tokenizer_and_its_specials(tmp_path):
    path = make_hf(tmp_path / "tokenizer.json")
    batch = next(loader([f"data.tokenizer={path}", "data.add_bos=true", "data.add_eos=true", "model.vocab_size=300"]))
    inputs = np.asarray(batch["inputs"])
    assert inputs.max() < 300 and inputs.min() >= 0
    assert (inputs > 255).any()  # ids a byte tokenizer never makes: the file is in use


def test_model_vocab_too_small_for_the_tokenizer(tmp_path):
    path = make_hf(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"produces ids up to 299 but `model.vocab_size`=256; set model.vocab_size=300"):
        loader([f"data.tokenizer={path}"])
    with pytest.raises(ConfigError, match=r"set model.vocab_size=258"):
        loader(["data.add_eos=true"])  # byte EOS is id 257


@pytest.mark.slow  # 13 s CLI run; tokenizer loading and errors stay in the fast tests
def test_cli_trains_and_samples_with_a_tokenizer_file(tmp_path):
    from conftest import run_cli

    path = make_hf(tmp_path / "tokenizer.json")
    r = run_cli("configs/tiny.yml", f"data.tokenizer={path}", "data.add_eos=true", "model.vocab_size=300",
                "model.n_layers=2", "seq_len=32", "global_batch_size=8", "steps=2", "sample_tokens=4",
                f"run_dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"; tokenizer {path} (Hugging Face)" in r.stdout and "greedy sample:\nThe " in r.stdout


@pytest.mark.malformed
def test_empty_directory_and_binary_tokenizer_settings_fail_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^`data.tokenizer` is empty; set it to byte, a tokenizer.json or a "
                                          r"SentencePiece .model$"):
        tokenizer.load("")  # was "no file .": Path("") is the current directory
    make_hf(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match=rf"^`data.tokenizer`: {tmp_path} is a directory; name the tokenizer.json or "
                                          rf"SentencePiece .model file in it: data.tokenizer={tmp_path}/tokenizer.json$"):
        tokenizer.load(str(tmp_path))
    for name in ("bin.json", "bin.model"):
        (tmp_path / name).write_bytes(np.random.default_rng(0).bytes(1024))
        with pytest.raises(ConfigError, match=rf"^`--tokenizer`: {tmp_path}/{name} does not load as a ") as e:
            tokenizer.load(str(tmp_path / name), "--tokenizer")
        assert "\n" not in str(e.value)
