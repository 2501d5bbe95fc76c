"""Tokenizers from local files only: raw bytes, a Hugging Face `tokenizer.json`, or a SentencePiece
`.model`. Nothing is ever downloaded.

Every tokenizer encodes a document to plain ids *without* special tokens; maxlm adds BOS/EOS itself
(`data.add_bos`, `data.add_eos`), so a tokenizer whose post-processor also adds them can never double
them silently.

A long document is encoded in pieces (`PIECE_CHARS`), and at most `CALL_CHARS` characters go to the
tokenizer in one call, so its working memory follows the piece, not the document: one 50 MB line through a
byte-level BPE tokenizer peaked at 10.6 GB encoded whole. Seams fall at a space between two non-space
characters, where every tokenizer maxlm reads splits words anyway, and each tokenizer's seam rule is checked
when it loads (`_seam_rule`): the piece after a seam keeps its space (byte-level BPE: GPT-2, Llama 3, Qwen;
Metaspace), or drops it for the tokenizer's own word prefix (SentencePiece's dummy prefix, a Prepend("▁")
normalizer), whichever reproduces whole-text ids. The ids then equal whole-document tokenization; they can
differ only at a seam when a tokenizer merges across spaces (`seams_exact` False), or when a stretch of
PIECE_CHARS characters has no such space (CJK text, a minified blob) and the seam is cut between characters.
"""

import hashlib
from pathlib import Path

import numpy as np

from maxlm.errors import ConfigError

# A document longer than this is encoded in pieces of at most this many characters (seams at spaces).
PIECE_CHARS = 1 << 16
# At most this many characters (pieces, or whole short documents) go to the tokenizer in one call.
CALL_CHARS = 1 << 20
# Texts whose whole-text ids each seam rule must reproduce for the rule to be chosen (`_seam_rule`).
SEAM_PROBES = ("hello world", "The quick brown fox, jumps over 12 lazy dogs.", "a\nb c\td e", "über naïve café",
               "x  y z", "don't stop-me now!", "1234 5678 9")

# Candidate names of the begin/end-of-document tokens in Hugging Face vocabularies, most specific first.
HF_BOS = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]")
HF_EOS = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")


class Tokenizer:
    """encode(str) -> int32 ids (no specials); decode(ids) -> str; vocab_size; bos_id/eos_id (or None).
    A subclass gives `_encode_many` and `_offsets_many` (whole texts); long documents reach them in pieces."""

    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    drop_seam_space = False  # the piece after a seam starts past its space (the tokenizer prefixes words itself)
    seams_exact = True  # whether the seam rule reproduced whole-text ids on every probe

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [ids for ids, _ in self._pieced(texts, False)]

    def encode_offsets_batch(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """encode_batch's ids, each with its [start, end) character span in the text ([n, 2]): chat data maps
        the template's assistant characters to the tokens that train (maxlm.data.chat)."""
        return self._pieced(texts, True)

    def _encode_many(self, texts: list[str]) -> list[np.ndarray]:
        raise NotImplementedError

    def _offsets_many(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError

    def _pieced(self, texts: list[str], offsets: bool) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each text's ids (and offsets), its long ones encoded piece by piece, CALL_CHARS at a time."""
        return self._encode_pieces(texts, [pieces(t, self.drop_seam_space) for t in texts], offsets)

    def _encode_pieces(self, texts: list[str], spans: list[list[tuple[int, int, bool]]], offsets: bool,
                       call_chars: int | None = None) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """Each text's ids (and offsets) from its pieces `spans` ([start, end), after a dropped space), at most
        `call_chars` (CALL_CHARS) characters to the tokenizer at a time."""
        parts: list[list] = [[] for _ in texts]
        group, size, call_chars = [], 0, CALL_CHARS if call_chars is None else call_chars

        def flush():
            chunks = [texts[d][a:b] for d, a, b, _ in group]
            out = self._offsets_many(chunks) if offsets else [(ids, None) for ids in self._encode_many(chunks)]
            for (d, a, _, after_space), (ids, off) in zip(group, out):
                if off is not None and a:
                    off = off + a
                    if after_space and len(off) and off[0, 0] == a:  # whole, the dropped space is in this token
                        off[0, 0] = a - 1
                parts[d].append((ids, off))
            group.clear()

        for d, text_spans in enumerate(spans):
            for a, b, after_space in text_spans:
                if group and size + b - a > call_chars:
                    flush()
                    size = 0
                group.append((d, a, b, after_space))
                size += b - a
        if group:
            flush()
        return [(p[0][0], p[0][1]) if len(p) == 1 else
                (np.concatenate([ids for ids, _ in p]).astype(np.int32),
                 np.concatenate([off for _, off in p]) if offsets else None) for p in parts]


def pieces(text: str, drop_space: bool = False) -> list[tuple[int, int, bool]]:
    """[start, end) of the pieces a document is encoded in, each of at most PIECE_CHARS characters, and
    whether a dropped space precedes it. A seam is the last space between two non-space characters in the
    second half of a piece; with `drop_space` that space belongs to neither piece. A stretch with no such
    space is cut between characters (its ids can differ from whole-text ones at that seam)."""
    out, a, n = [], 0, len(text)
    after = False
    while n - a > PIECE_CHARS:
        hi = a + PIECE_CHARS
        lo = a + max(1, PIECE_CHARS // 2)
        i = text.rfind(" ", lo, hi)
        while i > 0 and (text[i - 1].isspace() or text[i + 1].isspace()):
            i = text.rfind(" ", lo, i)
        if i <= 0:
            out.append((a, hi, after))
            a, after = hi, False
        else:
            out.append((a, i, after))
            a, after = (i + 1, True) if drop_space else (i, False)
    out.append((a, n, after))
    return out


def _seam_rule(tok: Tokenizer) -> None:
    """Set `tok.drop_seam_space` to the seam rule whose pieces reproduce whole-text ids on SEAM_PROBES, each
    split at every seam, preferring one that reproduces the character offsets too (chat data reads them);
    `tok.seams_exact` is False when neither rule reproduces the ids (seams then keep their space). One text
    a call, so that loading starts no tokenizer thread pool (a process forked after it would warn)."""
    whole = [tok._offsets_many([text])[0] for text in SEAM_PROBES]
    ranked = []
    for drop in (False, True):
        spans = []
        for text in SEAM_PROBES:
            cuts = [i for i in range(1, len(text) - 1)
                    if text[i] == " " and not text[i - 1].isspace() and not text[i + 1].isspace()]
            spans.append([(a, b, drop and k > 0) for k, (a, b) in enumerate(zip([0] + [i + drop for i in cuts],
                                                                                 cuts + [len(text)]))])
        got = tok._encode_pieces(list(SEAM_PROBES), spans, True, call_chars=0)
        ids = all(g[0].tolist() == w[0].tolist() for g, w in zip(got, whole))
        offs = ids and all(g[1].tolist() == w[1].tolist() for g, w in zip(got, whole))
        ranked.append((not ids, not offs, drop))
    miss_ids, _, drop = min(ranked)
    tok.drop_seam_space, tok.seams_exact = (drop, True) if not miss_ids else (False, False)


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

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:  # linear in the text: no pieces needed
        return [self.encode(t) for t in texts]

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
        _seam_rule(self)

    def decode(self, ids) -> str:
        return self._tok.decode([int(t) for t in ids])

    def _encodings(self, texts: list[str]):
        if len(texts) == 1:  # one text: no thread pool (it would also mark parallelism used before a fork)
            return [self._tok.encode(texts[0], add_special_tokens=False)]
        return self._tok.encode_batch(texts, add_special_tokens=False)

    def _encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, np.int32) for e in self._encodings(texts)]

    def _offsets_many(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(np.asarray(e.ids, np.int32), np.asarray(e.offsets, np.int64).reshape(-1, 2))
                for e in self._encodings(texts)]


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: Path):
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        self.name, self.vocab_size = f"{path} (SentencePiece)", self._sp.vocab_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None
        _seam_rule(self)

    def decode(self, ids) -> str:
        return self._sp.decode([int(t) for t in ids])

    def _encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, np.int32) for ids in self._sp.encode(list(texts))]

    def _offsets_many(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
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
        if path.exists():  # a FIFO, a socket, a device
            raise ConfigError(f"`{key}`: {path} is not a regular file; name a tokenizer.json or SentencePiece .model file")
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
