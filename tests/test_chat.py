"""Chat (SFT) and preference (DPO) data: templates render as transformers renders them, token for token;
the loss mask covers exactly the assistant turns; conversations are packed whole, cut or dropped when too
long (and counted); preference rows hold one pair; the loader resumes exactly; bad records and templates
fail in one line."""

import json
import signal
import time

import grain
import jax
import numpy as np
import pytest
from conftest import oracle

from maxlm import mesh as mesh_lib, sharding
from maxlm.config import ConfigError, load
from maxlm.data import chat, make_eval_loader, make_loader, preflight, tokenizer
from maxlm.data.stream import Packer, fit_pair

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
# The tokenizer's own template: a default system turn, tool turns in user turns, tools as JSON, and a
# raise_exception, like the templates shipped on the Hub.
OWN = ("{%- if tools %}{{- '<|im_start|>system\\nTools: ' + tools | tojson + '<|im_end|>\\n' }}"
       "{%- elif messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{%- endif %}\n"
       "{%- for message in messages %}\n"
       "{%- if message['role'] == 'system' and loop.index0 > 0 %}{{ raise_exception('system must come first') }}{% endif %}\n"
       "{%- if message['role'] == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
       "'\\n</tool_response><|im_end|>\\n' }}\n"
       "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}{%- endif %}\n"
       "{%- endfor %}\n{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n")
# ChatML with transformers' {% generation %} markers: its assistant mask is an independent check of ours.
CHATML_GEN = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}{% if message['role'] == 'assistant' %}"
              "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{% else %}"
              "{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is two plus two?"},
     {"role": "assistant", "content": "Four."}],
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi! how can I help?"},
     {"role": "user", "content": "tell me a joke"}, {"role": "assistant", "content": "  A dog walks into a bar.  "}],
    [{"role": "user", "content": "weather in Zürich?"}, {"role": "assistant", "content": "calling get_weather"},
     {"role": "tool", "content": '{"temp": 21}'}, {"role": "assistant", "content": "It is 21 °C 😀 in Zürich."}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def make_tokenizer(d, template=OWN):
    """A tiny byte-level BPE with chat special tokens, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ([m["content"] for c in CONVERSATIONS for m in c] * 20 + ["the quick brown fox jumps over the lazy dog"] * 20
            + ["system user assistant You are helpful. question answer"] * 40)
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d.mkdir(exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
            "pad_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}}
    if template is not None:
        conf["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    return d / "tokenizer.json"


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf(tok_path):
    transformers = oracle("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok_path.parent))


class D:  # the data config's keys that load_template reads
    def __init__(self, tokenizer, chat_template=""):
        self.tokenizer, self.chat_template = tokenizer, chat_template


def encode(tok_path, records, fmt="chat", template=""):
    t = chat.load_template(D(str(tok_path), template))
    return chat.Encoder(fmt, t)(tokenizer.load(str(tok_path)), [(r, f"x.jsonl:{i + 1}") for i, r in enumerate(records)])


class Raw:
    """Decodes with the special tokens shown (maxlm's HFTokenizer.decode leaves them out)."""

    def __init__(self, path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def decode(self, ids) -> str:
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=False)


def trained(tok, ids, mask) -> list[str]:
    """The masked tokens, decoded run by run (a run per trained turn)."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(int(t))
        elif cur:
            runs.append(cur)
            cur = []
    return [tok.decode(r) for r in runs + ([cur] if cur else [])]


# ---- rendering and masks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("template", ["", "chatml"])
def test_tokens_equal_transformers_apply_chat_template(tok_path, hf, template):
    source = OWN if template == "" else chat.CHATML
    recs = [{"messages": c} for c in CONVERSATIONS] + [{"messages": CONVERSATIONS[2], "tools": TOOLS}]
    got = encode(tok_path, recs, template=template)
    for rec, g in zip(recs, got):
        want = hf.apply_chat_template(rec["messages"], tools=rec.get("tools"), chat_template=source, tokenize=True,
                                      return_dict=False)
        assert g["tokens"].tolist() == list(want)
        assert g["tokens"].dtype == np.int32 and len(g["mask"]) == len(g["tokens"])


def test_mask_is_exactly_the_assistant_turns(tok_path):
    tok = Raw(tok_path)
    got = encode(tok_path, [{"messages": c} for c in CONVERSATIONS])
    want = [["Four.<|im_end|>"], ["hi! how can I help?<|im_end|>", "A dog walks into a bar.<|im_end|>"],
            ["calling get_weather<|im_end|>", "It is 21 °C 😀 in Zürich.<|im_end|>"]]
    assert [trained(tok, g["tokens"], g["mask"]) for g in got] == want
    t = encode(tok_path, [{"messages": CONVERSATIONS[1]}], template="llama3")[0]
    assert trained(tok, t["tokens"], t["mask"]) == ["hi! how can I help?<|eot_id|>", "A dog walks into a bar.<|eot_id|>"]
    assert tok.decode(t["tokens"][:1]) == "<|begin_of_text|>"


def test_mask_equals_transformers_generation_mask(tok_path, hf, tmp_path):
    (tmp_path / "gen.jinja").write_text(CHATML_GEN)
    for c, g in zip(CONVERSATIONS, encode(tok_path, [{"messages": c} for c in CONVERSATIONS], template=str(tmp_path / "gen.jinja"))):
        out = hf.apply_chat_template(c, chat_template=CHATML_GEN, return_assistant_tokens_mask=True, return_dict=True)
        assert g["tokens"].tolist() == out["input_ids"] and g["mask"].tolist() == out["assistant_masks"]


def test_byte_tokenizer_with_chatml():
    t = chat.load_template(D("byte", "chatml"))
    g = chat.Encoder("chat", t)(tokenizer.load("byte"), [({"prompt": "héllo", "completion": "wörld"}, "x:1")])[0]
    assert bytes(g["tokens"].astype(np.uint8)).decode() == t.render([{"role": "user", "content": "héllo"},
                                                                      {"role": "assistant", "content": "wörld"}])
    assert bytes(g["tokens"][g["mask"] == 1].astype(np.uint8)).decode() == "wörld<|im_end|>"


def test_prompt_completion_and_preference_records(tok_path):
    tok = Raw(tok_path)
    g = encode(tok_path, [{"prompt": "hello there", "completion": "hi!"}])[0]
    assert g["tokens"].tolist() == encode(tok_path, [{"messages": [{"role": "user", "content": "hello there"},
                                                                   {"role": "assistant", "content": "hi!"}]}])[0]["tokens"].tolist()
    assert trained(tok, g["tokens"], g["mask"]) == ["hi!<|im_end|>"]
    history = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi!"},
               {"role": "user", "content": "tell me a joke"}]
    p = encode(tok_path, [{"prompt": "tell me a joke", "chosen": "A dog walks into a bar.", "rejected": "no"},
                          {"prompt": history, "chosen": [{"role": "assistant", "content": "Four."}], "rejected": "nope"}],
               fmt="preference")
    assert trained(tok, p[0]["tokens"], p[0]["mask"]) == ["A dog walks into a bar.<|im_end|>"]
    assert trained(tok, p[0]["rejected"], p[0]["rejected_mask"]) == ["no<|im_end|>"]
    # Assistant turns of the prompt's history are context, not the response.
    assert trained(tok, p[1]["tokens"], p[1]["mask"]) == ["Four.<|im_end|>"]
    assert trained(tok, p[1]["rejected"], p[1]["rejected_mask"]) == ["nope<|im_end|>"]


def test_token_offsets_of_every_tokenizer_kind(tok_path, tmp_path):
    from test_tokenizer import make_sp

    text = "héllo wörld <|im_end|> the quick brown fox 😀"
    for tok in (tokenizer.load("byte"), tokenizer.load(str(tok_path)), tokenizer.load(str(make_sp(tmp_path / "sp.model")))):
        [(ids, off)] = tok.encode_offsets_batch([text])
        assert ids.tolist() == tok.encode(text).tolist() and off.shape == (len(ids), 2)
        assert (np.diff(off[:, 0]) >= 0).all() and (off[:, 0] <= off[:, 1]).all() and off.max() <= len(text)
    [(ids, off)] = tokenizer.load(str(tok_path)).encode_offsets_batch([text])
    assert "<|im_end|>" in [text[a:b] for a, b in off]


def test_stop_ids(tok_path):
    tok = Raw(tok_path)
    t = chat.load_template(D(str(tok_path), "llama3"))
    ids = chat.stop_ids(tokenizer.load(str(tok_path)), t)
    assert [tok.decode([i]) for i in ids] == ["<|eot_id|>", "<|im_end|>", "<|endoftext|>"]
    cfg = load("configs/tiny.yml", ["data.source=jsonl", "data.path=x.jsonl", "data.format=chat",
                                    f"data.tokenizer={tok_path}", "model.vocab_size=512"])
    assert [tok.decode([i]) for i in chat.stop_ids(cfg)] == ["<|im_end|>", "<|endoftext|>"]


# ---- refusals ------------------------------------------------------------------------------------------------

@pytest.mark.malformed
@pytest.mark.parametrize("record, fmt, match", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "chat", r"x.jsonl:1 has no assistant turn"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "chat", r"x.jsonl:1 has role 'robot' in messages\[0\]"),
    ({"text": "hi"}, "chat", r"x.jsonl:1 has neither `messages` nor `prompt` and `completion` strings \(keys: text\)"),
    ([1, 2], "chat", r"x.jsonl:1 is a JSON list"),
    ({"prompt": "hi", "chosen": "a"}, "preference", r"x.jsonl:1 needs `prompt`, `chosen` and `rejected`"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                   {"role": "assistant", "content": "c"}]}, "chat", r"does not render the conversation at x.jsonl:1: "
                                                                     r"system must come first"),
    ({"messages": [{"role": "tool", "content": None}, {"role": "assistant", "content": "c"}]}, "chat",
     r"x.jsonl:1 has content None \(NoneType\) in messages\[0\]; content is a string or a list of"),
    # The tokenizer's own template pipes content through `| trim`, which would train these as "None", "42" and
    # the list's repr.
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]}, "chat",
     r"x.jsonl:1 has content None \(NoneType\) in messages\[1\]"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 42}]}, "chat",
     r"x.jsonl:1 has content 42 \(int\) in messages\[1\]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                   {"role": "assistant", "content": "c"}]}, "chat",
     r"x.jsonl:1 has a content part of type 'image_url' in messages\[0\]"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "c"}]}, "chat", r"x.jsonl:1 has no content in messages\[0\]"),
    ({"prompt": "a", "chosen": [{"role": "assistant", "content": {"text": "b"}}], "rejected": "c"}, "preference",
     r"x.jsonl:1 has content \{'text': 'b'\} \(dict\) in chosen\[0\]"),
])
def test_bad_records_fail_in_one_line(tok_path, record, fmt, match):
    with pytest.raises(ConfigError, match=match) as e:
        encode(tok_path, [record], fmt=fmt)
    assert "\n" not in str(e.value) and "x.jsonl:1" in str(e.value)


def test_text_content_parts_train_as_the_joined_string(tok_path):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "hi!"}]}]}
    plain = {"messages": [{"role": "user", "content": "hello\nthere"}, {"role": "assistant", "content": "hi!"}]}
    (got,), (want,) = encode(tok_path, [parts]), encode(tok_path, [plain])
    assert np.array_equal(got["tokens"], want["tokens"]) and np.array_equal(got["mask"], want["mask"])
    calls = {"messages": [{"role": "user", "content": "a"},
                          {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
                          {"role": "assistant", "content": "b"}]}
    (row,) = encode(tok_path, [calls])  # the tokenizer's own template pipes content through `| trim`
    assert "None" not in tokenizer.load(str(tok_path)).decode(row["tokens"].tolist())


def test_a_template_that_runs_for_hours_is_stopped_at_the_preflight(tok_path, tmp_path):
    (tmp_path / "slow.jinja").write_text("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                         "{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}")
    before = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's, if on
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"slow.jinja takes over 0.5s to render the built-in 5-turn example "
                                          r"conversation, so it would stall the data pipeline"):
        chat.check_template(chat.load_template(D(str(tok_path), str(tmp_path / "slow.jinja"))), seconds=0.5)
    assert time.monotonic() - t0 < 5
    assert signal.getsignal(signal.SIGALRM) is before[0]
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (before[1] > 0)


@pytest.mark.malformed
def test_bad_templates_fail_in_one_line(tok_path, tmp_path):
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    (tmp_path / "raises.jinja").write_text("{{ raise_exception('this template refuses everything') }}")
    (tmp_path / "drops.jinja").write_text("{{ messages | length }}{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "empty.jinja").write_text("")
    (tmp_path / "users.jinja").write_text("{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}"
                                          "{% endfor %}")
    bad = {str(tmp_path / "broken.jinja"): r"broken.jinja does not compile \(line 1\)",
           str(tmp_path / "raises.jinja"): r"raises.jinja does not render .*built-in example.*: this template refuses",
           str(tmp_path / "drops.jinja"): r"drops.jinja renders the conversation at the built-in example .* not a prefix",
           # trained nothing (loss 0) or spun in the data stage before: no assistant token is ever found
           str(tmp_path / "empty.jinja"): r"empty.jinja renders nothing for assistant turn 2 of the conversation at "
                                          r"the built-in example .* so it would train on nothing",
           str(tmp_path / "users.jinja"): r"users.jinja renders nothing for assistant turn 2",
           "chatmll": r"data.chat_template=chatmll is not a named template .*did you mean chatml\?",
           str(tmp_path / "none.jinja"): r"data.chat_template: no file .*none.jinja"}
    for spec, match in bad.items():
        with pytest.raises(ConfigError, match=match) as e:
            chat.check_template(chat.load_template(D(str(tok_path), spec)))
        assert "\n" not in str(e.value)
    bare = make_tokenizer(tmp_path / "bare", template=None)
    with pytest.raises(ConfigError, match=r"data.chat_template='' reads the tokenizer's template, but .* has none"):
        chat.load_template(D(str(bare)))


# ---- the packer ----------------------------------------------------------------------------------------------

L = 16


def conv(n: int, start: int, prompt: int = 3) -> dict:
    """A conversation of n distinct tokens, the first `prompt` untrained."""
    return {"tokens": np.arange(start, start + n, dtype=np.int32), "mask": (np.arange(n) >= prompt).astype(np.int8),
            "skip": "", "where": f"c.jsonl:{start}"}


def packer(docs, packing=True, fmt="chat", too_long="truncate"):
    chunks = [docs[i:i + 3] for i in range(0, len(docs), 3)]
    return Packer(grain.MapDataset.source(chunks).to_iter_dataset(), L, packing, None, fmt, too_long)


def segments(row) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each segment's tokens (inputs + last target) and the loss mask of its pairs."""
    out = []
    for s in np.unique(row["segment_ids"][row["segment_ids"] > 0]):
        at = np.flatnonzero(row["segment_ids"] == s)
        assert (row["positions"][at] == np.arange(len(at))).all()
        out.append((np.r_[row["inputs"][at], row["targets"][at][-1]], row["loss_mask"][at]))
    assert (row["loss_mask"][row["segment_ids"] == 0] == 0).all()
    return out


LENGTHS = [5, 9, 17, 4, 30, 12, 8, 2 * L, 6]  # 17 = L + 1 tokens fits exactly; 30 and 32 do not


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("too_long", ["truncate", "drop"])
def test_conversations_are_packed_whole_and_too_long_ones_counted(packing, too_long):
    docs, at = [], 1000
    for n in LENGTHS:
        docs.append(conv(n, at))
        at += 100
    it = iter(packer(docs, packing, too_long=too_long))
    rows = list(it)
    seen = [seg for r in rows for seg in segments(r)]
    kept = [d for d in docs if len(d["tokens"]) <= L + 1 or too_long == "truncate"]
    # The last row, unfinished when the data ends, is dropped (as for text); the conversations before it come in order.
    assert len(kept) - (3 if packing else 0) <= len(seen) <= len(kept)
    for (toks, lm), d in zip(seen, kept):
        n = min(len(d["tokens"]), L + 1)
        assert toks.tolist() == d["tokens"][:n].tolist()  # whole, or its start when cut
        assert lm.tolist() == d["mask"][1:n].tolist()  # the mask of each pair's target token
    if not packing:
        assert all(len(segments(r)) == 1 for r in rows)
    else:
        assert any(len(segments(r)) > 1 for r in rows)
    skips = it.get_state()["skips"]
    assert (skips["too_long_truncated"], skips["too_long_dropped"]) == ((2, 0) if too_long == "truncate" else (0, 2))
    assert it.get_state()["first"][f"too_long_{'truncated' if too_long == 'truncate' else 'dropped'}"] == "c.jsonl:1400"


def test_a_cut_that_leaves_nothing_to_train_drops():
    it = iter(packer([conv(40, 1000, prompt=20), conv(5, 2000)], packing=False))
    rows = list(it)
    assert len(rows) == 1 and segments(rows[0])[0][0][0] == 2000
    assert it.get_state()["skips"]["too_long_dropped"] == 1


def test_packer_resumes_exactly_mid_stream():
    docs = [conv(n, 1000 + 100 * i) for i, n in enumerate(LENGTHS * 2)]
    ds = packer(docs)
    rows = list(iter(ds))
    for cut in range(len(rows)):
        it = iter(ds)
        for _ in range(cut):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        it2 = iter(ds)
        it2.set_state(state)
        rest = list(it2)
        assert len(rest) == len(rows) - cut
        assert all((a[k] == b[k]).all() for a, b in zip(rest, rows[cut:]) for k in a)


def pair(c: int, r: int, prompt: int = 4, start: int = 1000) -> dict:
    d = conv(prompt + c, start, prompt)
    rej = conv(prompt + r, start + 500, prompt)
    return {**d, "rejected": rej["tokens"], "rejected_mask": rej["mask"]}


def test_preference_rows_hold_one_pair_and_long_responses_are_cut_to_fit():
    docs = [pair(3, 5), pair(20, 3, start=2000), pair(20, 20, start=3000), pair(2, 2, prompt=9, start=4000)]
    it = iter(packer(docs, fmt="preference"))
    rows = list(it)
    assert len(rows) == 3  # the last pair's prompts alone fill the row: dropped
    (c, cm), (r, rm) = segments(rows[0])
    assert c.tolist() == list(range(1000, 1007)) and r.tolist() == list(range(1500, 1509))
    assert cm.tolist() == [0, 0, 0, 1, 1, 1] and rm.tolist() == [0, 0, 0] + [1] * 5
    for row in rows[1:]:  # cut: prompts whole, both responses kept as long as possible, 16 pairs in all
        (c, cm), (r, rm) = segments(row)
        assert len(c) + len(r) - 2 == L and cm[:3].sum() == rm[:3].sum() == 0
    assert [len(s[0]) - 4 for s in segments(rows[1])] == [7, 3] and [len(s[0]) - 4 for s in segments(rows[2])] == [5, 5]
    assert it.get_state()["skips"]["too_long_truncated"] == 2 and it.get_state()["skips"]["too_long_dropped"] == 1
    assert fit_pair(*(pair(20, 3)[k] for k in ("tokens", "mask", "rejected", "rejected_mask")), L, "drop")[0] is None


# ---- the loader ----------------------------------------------------------------------------------------------

def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make(tok_path, path, *overrides, eval_=False):
    cfg = load("configs/tiny.yml", ["data.source=jsonl", f"data.path={path}", "data.format=chat", f"data.tokenizer={tok_path}",
                                    "model.vocab_size=512", "seq_len=64", "global_batch_size=2", "data.seed=1", *overrides])
    m = mesh_lib.make_mesh(mesh_lib.mesh_shape(cfg, 1), jax.devices()[:1])
    s = sharding.named(m, ("batch", "length"), sharding.rules(cfg))
    return make_eval_loader(cfg, s) if eval_ else make_loader(cfg, s)


def rows_of(ld, n):
    return [{k: np.asarray(v)[i] for k, v in b.items()} for b in (next(ld) for _ in range(n)) for i in range(2)]


def test_loader_rows_train_only_assistant_tokens_and_resume(tok_path, tmp_path):
    tok = Raw(tok_path)
    recs = [{"messages": c} for c in CONVERSATIONS] + [{"prompt": f"question {i}?", "completion": f"answer {i}."} for i in range(9)]
    path = write_jsonl(tmp_path / "chat.jsonl", recs)
    ld = make(tok_path, path)
    assert "whole conversations per row" in ld.describe()
    rows = rows_of(ld, 3)
    state = ld.get_state()
    more = rows_of(ld, 2)
    runs = [t for r in rows for t in trained(tok, r["targets"], r["loss_mask"])]
    assert len(runs) >= 6 and any(t.startswith("answer") for t in runs)
    assert all(t.endswith("<|im_end|>") and "<|im_start|>" not in t and "question" not in t for t in runs)
    ld2 = make(tok_path, path)
    ld2.set_state(state)
    assert all((a[k] == b[k]).all() for a, b in zip(rows_of(ld2, 2), more) for k in a)
    ld.close(), ld2.close()
    ev = make(tok_path, path, "eval.every=1", f"eval.path={write_jsonl(tmp_path / 'held.jsonl', recs[:4])}", eval_=True)
    r = rows_of(ev, 1)[0]
    assert trained(tok, r["targets"], r["loss_mask"])[-1].endswith("<|im_end|>")
    assert 0 < r["loss_mask"].sum() < (r["segment_ids"] > 0).sum()
    ev.close()


def test_loader_counts_too_long_and_makes_preference_rows(tok_path, tmp_path):
    long = {"prompt": "tell me a joke", "completion": "the quick brown fox jumps over the lazy dog " * 8}
    path = write_jsonl(tmp_path / "c.jsonl", [long] + [{"prompt": "hi", "completion": "hello"}] * 3)
    ld = make(tok_path, path, "data.too_long=drop")
    rows_of(ld, 2)
    assert ld.skips["too_long_dropped"] >= 1 and ld.first_skip["too_long_dropped"] == f"{path}:1"
    assert any("longer than seq_len=64 pairs are dropped" in m and "data_skipped_too_long_dropped" in m for m in ld.messages)
    ld.close()
    prefs = [{"prompt": f"q{i}", "chosen": f"good answer {i}", "rejected": "bad"} for i in range(4)]
    ld = make(tok_path, write_jsonl(tmp_path / "p.jsonl", prefs), "data.format=preference", "objective=dpo")
    assert "one preference pair per row (data.packing does not apply)" in ld.describe()
    tok = Raw(tok_path)
    for r in rows_of(ld, 2):
        assert sorted(set(r["segment_ids"].tolist())) == [0, 1, 2]
        [c] = trained(tok, r["targets"][r["segment_ids"] == 1], r["loss_mask"][r["segment_ids"] == 1])
        assert c.startswith("good answer") and c.endswith("<|im_end|>")
        assert trained(tok, r["targets"][r["segment_ids"] == 2], r["loss_mask"][r["segment_ids"] == 2]) == ["bad<|im_end|>"]
    ld.close()


@pytest.mark.malformed
def test_loader_and_preflight_refusals(tok_path, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "hi", "completion": "yo"}, {"messages": [{"role": "user", "content": "x"}]}])
    ld = make(tok_path, path, "data.packing=false")
    with pytest.raises(ConfigError, match=rf"data.format=chat: the record at {path}:2 has no assistant turn"):
        rows_of(ld, 2)
    ld.close()
    base = ["data.source=jsonl", f"data.path={path}", "data.format=chat", f"data.tokenizer={tok_path}", "model.vocab_size=512"]
    with pytest.raises(ConfigError, match=r"data.add_bos/add_eos with data.format=chat: .*set data.add_bos=false"):
        preflight(load("configs/tiny.yml", [*base, "data.add_eos=true"]))
    (tmp_path / "t.jinja").write_text("{{ raise_exception('no') }}")
    with pytest.raises(ConfigError, match=r"t.jinja does not render"):
        preflight(load("configs/tiny.yml", [*base, f"data.chat_template={tmp_path}/t.jinja"]))
    preflight(load("configs/tiny.yml", base))
    mixture = f"data.mixture={{a: {{source: jsonl, path: '{path}'}}, b: {{source: pydoc}}}}"
    with pytest.raises(ConfigError, match=r"data.format=chat reads JSONL records \(or data prepared from them\), but data.mixture.b.source=pydoc"):
        preflight(load("configs/tiny.yml", [*base[2:], "data.source=mixture", mixture]))


# ---- prepared records (python -m maxlm.data.prepare --format chat|preference) --------------------------------

SEQ = 64  # make()'s seq_len


def prep(tok_path, tmp_path, monkeypatch, records, fmt="chat", *extra) -> tuple:
    """`records` prepared in blocks of 8 documents and shards of ~600 bytes of JSONL (so rows cross both)."""
    from maxlm.data import prepare

    monkeypatch.setattr(prepare, "BLOCK_DOCS", 8)
    path = write_jsonl(tmp_path / f"{fmt}.jsonl", records)
    out = tmp_path / f"prep-{fmt}"
    assert prepare.main([str(path), "--tokenizer", str(tok_path), "--out", str(out), "--format", fmt, "--workers", "1",
                         "--chunk-mb", "0.0006", *extra]) == 0
    return path, out


def epoch_rows(ld) -> list[dict]:
    """Every row of epoch 0 of an indexed loader, in order."""
    return [ld.rows(g) for g in range(ld.rows.rows_in_epoch(0))]


def test_prepared_chat_rows_hold_whole_conversations_once_an_epoch(tok_path, tmp_path, monkeypatch):
    """Tokens and masks on disk are the streaming encoder's, record for record. Every conversation of an epoch
    is in exactly one row, whole (one longer than seq_len cut to its first seq_len + 1 tokens), with the loss
    on its assistant tokens; rows hold several with packing and one without; the data position resumes."""
    from maxlm.data.sources import PreparedSource

    recs = ([{"messages": c} for c in CONVERSATIONS] * 3 +
            [{"prompt": f"question {i}?", "completion": "answer " * (i % 5) + f"{i}."} for i in range(30)] +
            [{"prompt": "tell me a joke", "completion": "the quick brown fox jumps over the lazy dog " * 6}])
    path, out = prep(tok_path, tmp_path, monkeypatch, recs)
    src = PreparedSource([str(out)])
    assert src.records == "chat" and len(src._shards) > 2 and len(src.blocks) > len(src._shards)
    want = encode(tok_path, recs)
    got = src.masked_spans([(i, len(w["tokens"]), 0, len(w["tokens"])) for i, w in enumerate(want)])
    for (ids, mask), w in zip(got, want, strict=True):
        np.testing.assert_array_equal(ids, w["tokens"])
        np.testing.assert_array_equal(mask, w["mask"])

    whole = {}
    for w in want:  # what a row must hold of each conversation: all of it, or its first L + 1 tokens
        key = tuple(w["tokens"][:SEQ + 1].tolist())
        whole[key] = whole.get(key, 0) + 1
    for packing in (True, False):
        ld = make(tok_path, out, "data.source=prepared", f"data.packing={str(packing).lower()}", "data.epochs=1")
        long = sum(len(w["tokens"]) - 1 > SEQ for w in want)
        assert long and any("whole conversations per row" in m and f"{long} longer than seq_len=64 pairs are truncated"
                            in m for m in ld.messages)
        seen, per_row = {}, []
        for r in epoch_rows(ld):
            segs = segments(r)
            per_row.append(len(segs))
            for ids, loss in segs:
                seen[tuple(ids.tolist())] = seen.get(tuple(ids.tolist()), 0) + 1
                w = next(x for x in want if tuple(x["tokens"][:len(ids)].tolist()) == tuple(ids.tolist()))
                np.testing.assert_array_equal(loss, w["mask"][1:len(ids)])
        assert seen == whole
        assert max(per_row) > 1 if packing else set(per_row) == {1}
        ld.close()

    ld = make(tok_path, out, "data.source=prepared")
    rows_of(ld, 3)
    state = ld.get_state()
    more = rows_of(ld, 2)
    ld2 = make(tok_path, out, "data.source=prepared")
    ld2.set_state(state)
    assert all((a[k] == b[k]).all() for a, b in zip(rows_of(ld2, 2), more) for k in a)
    ld.close(), ld2.close()


def test_prepared_preference_rows_hold_one_pair_once_an_epoch(tok_path, tmp_path, monkeypatch):
    """A preference record is two documents on disk and one row: segment 1 prompt+chosen, segment 2
    prompt+rejected, each record once an epoch; too long ones dropped (data.too_long=drop), counted at start."""
    prefs = [{"prompt": f"q{i}", "chosen": f"good answer {i}", "rejected": "bad " * (i % 3 + 1)} for i in range(21)]
    prefs.append({"prompt": "q", "chosen": "the quick brown fox jumps over the lazy dog " * 6, "rejected": "no"})
    _, out = prep(tok_path, tmp_path, monkeypatch, prefs, "preference")
    want = encode(tok_path, prefs, "preference")
    fits = [len(w["tokens"]) + len(w["rejected"]) - 2 <= SEQ for w in want]
    assert fits[:3] == [True] * 3 and not fits[-1]
    ld = make(tok_path, out, "data.source=prepared", "data.format=preference", "objective=dpo", "data.too_long=drop")
    assert any("whole preference pairs per row" in m and f"0 longer than seq_len=64 pairs are truncated and "
               f"{fits.count(False)} dropped" in m for m in ld.messages)
    got = []
    for r in epoch_rows(ld):
        (c, cm), (x, xm) = segments(r)
        got.append((tuple(c.tolist()), tuple(x.tolist())))
        w = next(w for w in want if tuple(w["tokens"].tolist()) == got[-1][0])
        np.testing.assert_array_equal(x, w["rejected"])
        np.testing.assert_array_equal(cm, w["mask"][1:]), np.testing.assert_array_equal(xm, w["rejected_mask"][1:])
    assert sorted(got) == sorted((tuple(w["tokens"].tolist()), tuple(w["rejected"].tolist())) for w, f in zip(want, fits)
                                 if f)
    ld.close()


@pytest.mark.malformed
def test_prepared_records_refusals(tok_path, tmp_path, monkeypatch, capsys):
    """One line each: prepare's flags and inputs, and a config that reads the records as something else."""
    from maxlm.data import prepare

    recs = [{"prompt": "hi", "completion": "yo"}] * 4
    path, out = prep(tok_path, tmp_path, monkeypatch, recs)
    capsys.readouterr()
    bad = [(["--format", "jsonl", "--chat-template", "chatml"], "--chat-template renders chat and preference records; add "
                                                                 "--format chat or preference"),
           (["--format", "chat", "--add-bos"], "--add-bos/--add-eos with --format chat: the chat template writes"),
           (["--format", "chat", "--chat-template", "chatm"], "--chat-template=chatm is not a named template"),
           (["--format", "preference"], f"data.format=preference: the record at {path}:1 needs `prompt`, `chosen` and "
                                        f"`rejected`")]
    for args, msg in bad:
        assert prepare.main([str(path), "--tokenizer", str(tok_path), "--out", str(tmp_path / "o"), "--workers", "1",
                             *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("maxlm: error: ") and msg in err and "\n" not in err, (msg, err)
    (tmp_path / "t.txt").write_text("plain text")
    assert prepare.main([str(tmp_path / "t.txt"), "--tokenizer", str(tok_path), "--out", str(tmp_path / "o"),
                         "--format", "chat"]) == 2
    assert f"--format chat reads JSONL records (one JSON object per line), but {tmp_path}/t.txt is not" in capsys.readouterr().err

    with pytest.raises(ConfigError, match=r"holds chat records, not data.format=text; set data.format=chat"):
        make(tok_path, out, "data.source=prepared", "data.format=text")
    with pytest.raises(ConfigError, match=r"rendered with chat template '' \(the chat_template of .*\), not "
                                          r"data.chat_template=chatml; set data.chat_template to the template"):
        make(tok_path, out, "data.source=prepared", "data.chat_template=chatml")
    assert prepare.main([str(tmp_path / "t.txt"), "--tokenizer", str(tok_path), "--out", str(tmp_path / "text")]) == 0
    with pytest.raises(ConfigError, match=r"holds text records, not data.format=chat; set data.format=text, or "
                                          r"prepare it again with --format chat"):
        make(tok_path, tmp_path / "text", "data.source=prepared")
    mixture = f"data.mixture={{a: {{source: jsonl, path: '{path}'}}, b: {{source: prepared, path: '{out}'}}}}"
    with pytest.raises(ConfigError, match=r"with both jsonl and prepared components: .*prepare the jsonl ones too"):
        preflight(load("configs/tiny.yml", ["data.format=chat", f"data.tokenizer={tok_path}", "model.vocab_size=512",
                                            "data.source=mixture", mixture]))


def test_prepared_records_written_to_a_bucket_read_as_on_disk(tok_path, tmp_path, monkeypatch, gcs):
    """prepare --format preference --out gs://... (the GCS emulator): the same masks and rows as on disk."""
    from maxlm.data import prepare
    from maxlm.data.sources import PreparedSource

    prefs = [{"prompt": f"q{i}", "chosen": f"good answer {i}", "rejected": "bad " * (i % 3 + 1)} for i in range(12)]
    path, out = prep(tok_path, tmp_path, monkeypatch, prefs, "preference")
    assert prepare.main([str(path), "--tokenizer", str(tok_path), "--out", f"{gcs}/prep", "--format", "preference",
                         "--workers", "1", "--chunk-mb", "0.0006"]) == 0
    disk, bucket = PreparedSource([str(out)]), PreparedSource([f"{gcs}/prep"])
    assert bucket.records == "preference" and len(bucket) == 2 * len(prefs)
    want = [(i, n, 0, n) for i, n in enumerate(np.concatenate([disk.block_lengths(b) for b in range(len(disk.blocks))]))]
    for (a, am), (b, bm) in zip(disk.masked_spans(want), bucket.masked_spans(want), strict=True):
        np.testing.assert_array_equal(a, b), np.testing.assert_array_equal(am, bm)
    ld = make(tok_path, f"{gcs}/prep", "data.source=prepared", "data.format=preference", "objective=dpo")
    ref = make(tok_path, out, "data.source=prepared", "data.format=preference", "objective=dpo")
    assert all((a[k] == b[k]).all() for a, b in zip(rows_of(ld, 3), rows_of(ref, 3)) for k in a)
    ld.close(), ref.close()
