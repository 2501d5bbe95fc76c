"""Tokenizers from local files only: raw bytes, a Hugging Face `tokenizer.json`, or a SentencePiece
`.model`. Nothing is ever downloaded.

Every tokenizer encodes a document to plain ids *without* special tokens; maxlm adds BOS/EOS itself
(`data.add_bos`, `data.add_eos`), so a tokenizer whose post-processor also adds them can never double
them silently.
"""

import hashlib
from pathlib import Path

import numpy as np

from maxlm.errors import ConfigError

# Candidate names of the begin/end-of-document tokens in Hugging Face vocabularies, most specific first.
HF_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")
HF_EOS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")


class Tokenizer:
    """encode(str) -> int32 ids (no specials); decode(ids) -> str; vocab_size; bos_id/eos_id (or None)."""

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_offsets_batch(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """encode_batch's ids, each with its [start, end) character span in the text ([n, 2]): chat data maps
        the template's assistant characters to the tokens that train (maxlm.data.chat)."""
        raise NotImplementedError


def _char_of_byte(text: str) -> np.ndarray:
    """The character index of each UTF-8 byte of `text`, and one past the end."""
    b = np.frombuffer(text.encode("utf-8"), np.uint8)
    return np.r_[np.cumsum((b & 0xC0) != 0x80) - 1, len(text)].astype(np.int64)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0-255. BOS is 256 and EOS 257, beyond the 256 a plain byte model needs."""

    name, vocab_size, bos_id, eos_id = "byte", 256, 256, 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(int(t) for t in ids if 0 <= int(t) < 256).decode("utf-8", errors="replace")

    def encode_offsets_batch(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for t in texts:
            c = _char_of_byte(t)[:-1]
            out.append((self.encode(t), np.stack([c, c + 1], 1)))
        return out


class HFTokenizer(Tokenizer):
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _HF

        self._tok = _HF.from_file(str(path))
        self.name, self.vocab_size = f"{path} (Hugging Face)", self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.bos_id = next((vocab[t] for t in HF_BOS if t in vocab), None)
        self.eos_id = next((vocab[t] for t in HF_EOS if t in vocab), None)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(t) for t in ids])

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets_batch(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(np.asarray(e.ids, np.int32), np.asarray(e.offsets, np.int64).reshape(-1, 2))
                for e in self._tok.encode_batch(texts, add_special_tokens=False)]


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: Path):
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.name, self.vocab_size = f"{path} (SentencePiece)", self._sp.vocab_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids) -> str:
        return self._sp.decode([int(t) for t in ids])

    def encode_offsets_batch(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for t in texts:
            try:
                pieces = self._sp.encode(t, return_type="proto").pieces
            except (TypeError, ValueError):  # sentencepiece before 0.2.1 names it out_type
                pieces = self._sp.encode(t, out_type="immutable_proto").pieces
            c = _char_of_byte(t)  # piece offsets are UTF-8 byte offsets into the text
            ids = np.array([p.id for p in pieces], np.int32)
            off = np.array([(c[p.begin], c[p.end - 1] + 1 if p.end > p.begin else c[p.begin]) for p in pieces], np.int64)
            out.append((ids, off.reshape(-1, 2)))
        return out


def load(spec: str, key: str = "data.tokenizer") -> Tokenizer:
    """`byte`, or a path: `*.json` is a Hugging Face tokenizer, `*.model` a SentencePiece model. `key` names
    the setting in errors (the prepare CLI's is --tokenizer)."""
    if spec == "byte":
        return ByteTokenizer()
    if not str(spec).strip():  # Path("") is ".": "no file ." would hide that the setting is empty
        raise ConfigError(f"`{key}` is empty; set it to byte, a tokenizer.json or a SentencePiece .model")
    path = Path(spec)
    if path.is_dir():
        inside = sorted(str(p) for p in path.iterdir() if p.name == "tokenizer.json" or p.suffix == ".model")
        hint = f": {key}={inside[0]}" if inside else ""
        raise ConfigError(f"`{key}`: {path} is a directory; name the tokenizer.json or SentencePiece .model file "
                          f"in it{hint}")
    if not path.is_file():
        raise ConfigError(f"`{key}`: no file {path} (use `byte`, a tokenizer.json or a SentencePiece .model)")
    kind, what = {".json": (HFTokenizer, "Hugging Face"), ".model": (SentencePieceTokenizer, "SentencePiece")}.get(
        path.suffix, (None, None))
    if kind is None:
        raise ConfigError(f"`{key}`: {path} is neither a Hugging Face tokenizer.json nor a SentencePiece "
                          f".model (judged by its suffix)")
    try:
        return kind(path)
    except ImportError as e:
        raise ConfigError(f"`{key}`: {path} needs the `{e.name}` package: pip install {e.name}") from None
    except Exception as e:  # noqa: BLE001 - any failure to load is the file's fault; say which file
        first = (str(e).strip() or type(e).__name__).splitlines()[0][:200]
        raise ConfigError(f"`{key}`: {path} does not load as a {what} tokenizer: {first}") from None


def fingerprint(spec: str) -> str:
    """What identifies a tokenizer across machines: `byte`, or the sha256 of its file."""
    if spec == "byte":
        return "byte"
    return hashlib.sha256(Path(spec).read_bytes()).hexdigest()


def _special(tok: Tokenizer, which: str) -> list[int]:
    tid = tok.bos_id if which == "bos" else tok.eos_id
    if tid is None:
        names = HF_BOS if which == "bos" else HF_EOS
        raise ConfigError(f"`data.add_{which}`: tokenizer {tok.name} has no {which.upper()} token "
                          f"(looked for {', '.join(names)}); set data.add_{which}=false")
    return [tid]


def ids_needed(tok: Tokenizer, add_bos: bool, add_eos: bool) -> int:
    """The smallest model vocabulary that holds every id this tokenizer can produce here."""
    return max([tok.vocab_size] + [t + 1 for want, t in ((add_bos, tok.bos_id), (add_eos, tok.eos_id))
                                   if want and t is not None])


def document_ids(tok: Tokenizer, text: str, add_bos: bool, add_eos: bool) -> np.ndarray:
    """One document's ids with the configured BOS/EOS around them."""
    return document_ids_batch(tok, [text], add_bos, add_eos)[0]


def document_ids_batch(tok: Tokenizer, texts: list[str], add_bos: bool, add_eos: bool) -> list[np.ndarray]:
    """document_ids of many documents; a Hugging Face tokenizer encodes them on all cores at once."""
    bos = np.array(_special(tok, "bos") if add_bos else [], np.int32)
    eos = np.array(_special(tok, "eos") if add_eos else [], np.int32)
    return [np.concatenate([bos, ids, eos]) for ids in tok.encode_batch(texts)]
