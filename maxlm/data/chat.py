"""Chat (SFT) and preference (DPO) records: chat templates, rendering, and the assistant-only loss mask.

A record becomes token sequences with a per-token mask (1: trained). The text is the chat template's
rendering, encoded without added specials, exactly as transformers' `apply_chat_template(messages,
tokenize=True)` makes it (same jinja environment, variables and encoding). The mask covers each trained
assistant turn: its content and the template's end-of-turn token (`<|im_end|>`, `<|eot_id|>`), not the
assistant header and not the whitespace the template writes after the turn. A turn's characters are
found by rendering prefixes: messages[:i] with add_generation_prompt=True ends where the turn starts,
messages[:i+1] where it ends; the tokens whose characters overlap that span are trained.

- chat: `messages` (list of {role, content}; roles system, user, assistant, tool; an optional `tools`
  list goes to the template) or `prompt`/`completion` strings. Every assistant turn is trained.
- preference: `prompt` (a string: one user turn, or a messages list), `chosen` and `rejected` (a string:
  one assistant turn, or a messages list). Two sequences, prompt+chosen and prompt+rejected; only the
  response turns are trained.
"""

import difflib
import hashlib
import json
import signal
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from maxlm.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_VARS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases of a turn's reasoning

# The canonical ChatML template (as Hugging Face documents it).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
          "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Meta's Llama 3 Instruct template, with its BOS written out: a tokenizer without a tokenizer_config.json
# (no bos_token variable) still renders it whole.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = '<|begin_of_text|>' + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
NAMED = {"chatml": CHATML, "llama3": LLAMA3}

# The preflight's conversation: every role a plain template must handle, two assistant turns.
EXAMPLE = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
           {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
           {"role": "assistant", "content": "6"}]


def _environment():
    """The jinja environment transformers renders chat templates in (utils/chat_template_utils.py): sandboxed,
    trim/lstrip blocks, loop controls, its tojson, raise_exception, strftime_now, dict and namespace, and the
    `{% generation %}` tag (rendered as its body: the mask comes from prefix rendering here)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # noqa: N805 - jinja's own signature trick, so namespace(self=...) works
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with _: {name!r}")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=Dict(), namespace=Namespace)
    return env


def _first_line(e: Exception) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0][:200]


class Template:
    """A chat template and the special-token variables it is rendered with. Picklable (for worker
    processes): the compiled template is rebuilt in each process."""

    def __init__(self, source: str, name: str, variables: dict):
        self.source, self.name, self.variables = source, name, dict(variables)
        self._compiled = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_compiled": None}

    @property
    def sha256(self) -> str:
        """What renders the same text: the source and the special-token variables (prepared data records it)."""
        return hashlib.sha256(json.dumps([self.source, self.variables], sort_keys=True).encode()).hexdigest()

    def compiled(self):
        if self._compiled is None:
            try:
                self._compiled = _environment().from_string(self.source)
            except Exception as e:  # noqa: BLE001 - TemplateSyntaxError and kin: the template's fault
                line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
                raise ConfigError(f"data.chat_template {self.name} does not compile{line}: {_first_line(e)}; fix the "
                                  f"template or set data.chat_template=chatml|llama3|FILE.jinja") from None
        return self._compiled

    def render(self, messages: list, add_generation_prompt: bool = False, tools=None, where: str = "") -> str:
        """The template's text for `messages`, as transformers renders it; ConfigError naming the template
        and the record (`where`) if it does not render."""
        chat = [_alias_reasoning(m) for m in messages]
        try:
            return self.compiled().render(messages=chat, tools=tools, documents=None,
                                          add_generation_prompt=add_generation_prompt, **self.variables)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - raise_exception, undefined names, str + None: all say "does not render"
            at = f" at {where}" if where else ""
            raise ConfigError(f"data.chat_template {self.name} does not render the conversation{at}: {_first_line(e)}; "
                              f"fix the record or the template") from None


def _alias_reasoning(m: dict) -> dict:
    """transformers fills `thinking` and `reasoning_content` from any of the reasoning names a turn uses."""
    if not isinstance(m, dict):
        return m
    r = next((m[k] for k in REASONING if m.get(k) is not None), None)
    return m if r is None else {"thinking": r, **m, "reasoning_content": r}


def _token_content(v) -> str | None:
    """A tokenizer_config special token: a string, or an AddedToken dict (its `content`)."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def tokenizer_files(spec: str) -> tuple[str | None, str, dict]:
    """(the chat template beside the tokenizer file or None, where it was looked for, the special-token
    variables). As transformers loads a directory: chat_template.jinja wins over tokenizer_config.json's
    `chat_template` (a string, or a list of named templates whose `default` is used);
    special_tokens_map.json fills the special tokens tokenizer_config.json lacks."""
    if spec == "byte":
        return None, "the byte tokenizer", {}
    d = Path(spec).parent
    conf, smap = {}, {}
    for name, into in (("tokenizer_config.json", conf), ("special_tokens_map.json", smap)):
        if (d / name).is_file():
            try:
                into.update(json.loads((d / name).read_text(encoding="utf-8")))
            except (ValueError, UnicodeDecodeError) as e:
                raise ConfigError(f"data.tokenizer: {d / name} is not valid JSON ({_first_line(e)}); fix it") from None
    variables = {}
    for k in SPECIAL_VARS:
        v = _token_content(conf.get(k)) or _token_content(smap.get(k))
        if v is not None:
            variables[k] = v
    where = f"{d / 'chat_template.jinja'} or {d / 'tokenizer_config.json'}"
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8"), where, variables
    t = conf.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return (t if isinstance(t, str) and t.strip() else None), where, variables


def load_template(d, required: bool = True) -> Template | None:
    """data.chat_template as a compiled Template: '' the tokenizer's own, a named one, or a .jinja file.
    With `required` False, None where the tokenizer has no template and none is named."""
    spec = d.chat_template
    own, where, variables = tokenizer_files(d.tokenizer)
    if not spec:
        if own is None:
            if not required:
                return None
            raise ConfigError(f"data.chat_template='' reads the tokenizer's template, but {where} has none; set "
                              f"data.chat_template=chatml, llama3 or a .jinja file")
        t = Template(own, f"'' (the chat_template of {where.split(' or ')[-1]})", variables)
    elif spec in NAMED:
        t = Template(NAMED[spec], spec, variables)
    elif spec.endswith(".jinja"):
        if not Path(spec).is_file():
            raise ConfigError(f"data.chat_template: no file {spec} (use chatml, llama3, a .jinja file, or '' for the "
                              f"tokenizer's own template)")
        t = Template(Path(spec).read_text(encoding="utf-8"), spec, variables)
    else:
        near = difflib.get_close_matches(spec, list(NAMED), n=1)
        hint = f"did you mean {near[0]}? " if near else ""
        raise ConfigError(f"data.chat_template={spec} is not a named template or a .jinja file; {hint}use chatml, "
                          f"llama3, a path ending in .jinja, or '' for the tokenizer's own template")
    t.compiled()
    return t


# ---- records -> messages ------------------------------------------------------------------------------------

def _bad(fmt: str, where: str, what: str) -> ConfigError:
    return ConfigError(f"data.format={fmt}: the record at {where} {what}")


def _check_messages(msgs, fmt: str, where: str, key: str) -> list:
    if not isinstance(msgs, list) or not msgs:
        raise _bad(fmt, where, f"has `{key}` that is not a non-empty list of {{role, content}} messages; fix the record")
    for k, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            shown = f"role {role!r}" if isinstance(m, dict) else f"{type(m).__name__} {str(m)[:40]!r}"
            raise _bad(fmt, where, f"has {shown} in {key}[{k}]; messages are {{role, content}} objects with role "
                                   f"{', '.join(ROLES)}; fix the record")
    return [_with_text_content(m, fmt, where, f"{key}[{k}]") for k, m in enumerate(msgs)]


def _with_text_content(m: dict, fmt: str, where: str, at: str) -> dict:
    """The message with string content. A list of text parts (OpenAI's content parts) is joined by newlines,
    as serving stacks join them; an assistant turn that only calls tools may have none, and gets "" (falsy,
    as None is to the templates that test it, but never rendered as "None" by one that pipes it through
    `| trim`). Anything else would reach the template as its Python repr, and be trained as such."""
    c = m.get("content")
    if isinstance(c, str):
        return m
    if c is None and m["role"] == "assistant" and m.get("tool_calls"):
        return {**m, "content": ""}
    parts = c if isinstance(c, list) and c else None
    if parts and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        return {**m, "content": "\n".join(p["text"] for p in parts)}
    if parts:
        other = next(p for p in parts if not (isinstance(p, dict) and p.get("type") == "text"))
        shown = f"a content part of type {other.get('type')!r}" if isinstance(other, dict) else f"content part {other!r:.40}"
    else:
        shown = f"content {c!r:.40} ({type(c).__name__})" if "content" in m else "no content"
    raise _bad(fmt, where, f"has {shown} in {at}; content is a string or a list of {{type: text, text}} parts; "
                           f"fix the record")


def _as_turn(v, role: str, fmt: str, where: str, key: str) -> list:
    """A string as one turn of `role`, or a messages list, checked."""
    return [{"role": role, "content": v}] if isinstance(v, str) else _check_messages(v, fmt, where, key)


def chat_messages(rec, where: str) -> tuple[list, int]:
    """(messages, index of the first trained turn) of a chat record."""
    if not isinstance(rec, dict):
        raise _bad("chat", where, f"is a JSON {type(rec).__name__}, not an object with `messages`; fix the record")
    if "messages" in rec:
        msgs = _check_messages(rec["messages"], "chat", where, "messages")
    elif isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str):
        msgs = [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": rec["completion"]}]
    else:
        keys = ", ".join(map(str, rec)) or "none"
        raise _bad("chat", where, f"has neither `messages` nor `prompt` and `completion` strings (keys: {keys}); "
                                  f"write one of them")
    return msgs, 0


def preference_messages(rec, where: str) -> tuple[list, list, int]:
    """(prompt+chosen, prompt+rejected, index of the first trained turn) of a preference record."""
    need = ("prompt", "chosen", "rejected")
    if not isinstance(rec, dict) or any(k not in rec for k in need):
        keys = ", ".join(map(str, rec)) if isinstance(rec, dict) else f"a JSON {type(rec).__name__}"
        raise _bad("preference", where, f"needs `prompt`, `chosen` and `rejected` (has: {keys or 'none'}); fix the record")
    prompt = _as_turn(rec["prompt"], "user", "preference", where, "prompt")
    chosen = _as_turn(rec["chosen"], "assistant", "preference", where, "chosen")
    rejected = _as_turn(rec["rejected"], "assistant", "preference", where, "rejected")
    return prompt + chosen, prompt + rejected, len(prompt)


# ---- messages -> text, spans, tokens, mask ------------------------------------------------------------------

def assistant_spans(t: Template, msgs: list, train_from: int, tools=None, where: str = "",
                    fmt: str = "chat") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each trained assistant turn (from train_from on):
    from the end of messages[:i] rendered with the generation prompt (the header) to the end of
    messages[:i+1], less trailing whitespace (what the template writes after the end-of-turn token)."""
    full = t.render(msgs, tools=tools, where=where)
    spans = []
    for i in range(train_from, len(msgs)):
        if msgs[i]["role"] != "assistant":
            continue
        head = t.render(msgs[:i], add_generation_prompt=True, tools=tools, where=where)
        upto = t.render(msgs[:i + 1], tools=tools, where=where)
        if not (full.startswith(upto) and upto.startswith(head)):
            raise ConfigError(f"data.chat_template {t.name} renders the conversation at {where} differently in part "
                              f"(turn {i} rendered alone is not a prefix of the whole), so its assistant tokens cannot "
                              f"be found; use a template that renders earlier turns unchanged, e.g. data.chat_template=chatml")
        a = len(head)
        if len(upto.rstrip()) <= a:
            raise ConfigError(f"data.chat_template {t.name} renders nothing for assistant turn {i} of the conversation "
                              f"at {where}, so it would train on nothing; use a template that writes the assistant's "
                              f"turns, e.g. data.chat_template=chatml")
        spans.append((a, len(upto.rstrip())))
    if not spans:
        what = "response" if fmt == "preference" else "conversation"
        raise _bad(fmt, where, f"has no assistant turn in its {what}, so nothing would be trained; add one or remove "
                               f"the record")
    return full, spans


def token_mask(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose characters [start, end) overlap a span (so a token straddling the header and
    the content is trained, as transformers' assistant mask does); a zero-width token counts where it sits."""
    s, e = offsets[:, 0], offsets[:, 1]
    m = np.zeros(len(offsets), bool)
    for a, b in spans:
        m |= ((s < b) & (e > a)) | ((s == e) & (s >= a) & (s < b))
    return m.astype(np.int8)


class Encoder:
    """Records -> token sequences with masks, in stream.ReadChunk (worker processes too: picklable).
    chat: {"tokens", "mask"}; preference: also {"rejected", "rejected_mask"} (tokens: prompt+chosen)."""

    def __init__(self, fmt: str, template: Template):
        self.fmt, self.template = fmt, template

    def __call__(self, tok, records: list[tuple[object, str]]) -> list[dict]:
        texts, spans = [], []
        for rec, where in records:
            tools = rec.get("tools") if isinstance(rec, dict) and isinstance(rec.get("tools"), list) else None
            if self.fmt == "chat":
                msgs, k = chat_messages(rec, where)
                seqs = [msgs]
            else:
                chosen, rejected, k = preference_messages(rec, where)
                seqs = [chosen, rejected]
            for msgs in seqs:
                text, sp = assistant_spans(self.template, msgs, k, tools, where, self.fmt)
                texts.append(text)
                spans.append(sp)
        enc = [(ids, token_mask(off, sp)) for (ids, off), sp in zip(tok.encode_offsets_batch(texts), spans)]
        if self.fmt == "chat":
            return [{"tokens": ids, "mask": m} for ids, m in enc]
        return [{"tokens": c, "mask": cm, "rejected": r, "rejected_mask": rm}
                for (c, cm), (r, rm) in zip(enc[0::2], enc[1::2])]


PREFLIGHT_S = 10  # rendering the 5-turn example 7 times takes milliseconds with any real template


def check_template(t: Template, seconds: float = PREFLIGHT_S) -> None:
    """The preflight: the template renders the built-in conversation, and both assistant turns are found,
    within `seconds` (jinja's sandbox bounds each range, not nested loops, so a template can run for hours)."""
    def too_slow(signum, frame):
        raise ConfigError(f"data.chat_template {t.name} takes over {seconds:g}s to render the built-in 5-turn "
                          f"example conversation, so it would stall the data pipeline; fix the template's loops or "
                          f"set data.chat_template=chatml|llama3|FILE.jinja")

    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        return assistant_spans(t, EXAMPLE, 0, where="the built-in example conversation (maxlm.data.chat.EXAMPLE)")
    previous, t0 = signal.signal(signal.SIGALRM, too_slow), time.monotonic()
    outer = signal.setitimer(signal.ITIMER_REAL, seconds)  # someone else's alarm (a test runner's) is put back
    try:
        assistant_spans(t, EXAMPLE, 0, where="the built-in example conversation (maxlm.data.chat.EXAMPLE)")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer[0]:
            signal.setitimer(signal.ITIMER_REAL, max(outer[0] - (time.monotonic() - t0), 1e-3), outer[1])


def stop_ids(cfg_or_tok, template: Template | None = None) -> list[int]:
    """The token ids that end an assistant turn, for generation to stop at: the template's end-of-turn token
    (what it writes right after an assistant message's content: `<|im_end|>` for ChatML, `<|eot_id|>` for
    Llama 3) where that is a single token, then the template's `eos_token` and the tokenizer's EOS.
    `cfg_or_tok`: a config (its data.tokenizer and data.chat_template; a text-format config uses the
    tokenizer's own template if it has one), or a Tokenizer with an optional Template."""
    from maxlm.data import tokenizer as tokenizer_lib

    if isinstance(cfg_or_tok, tokenizer_lib.Tokenizer):
        tok = cfg_or_tok
    else:
        d = cfg_or_tok.data
        tok = tokenizer_lib.load(d.tokenizer)
        template = template or load_template(d, required=d.format != "text")
    texts = []
    if template is not None:
        marker = "\x00maxlm-end\x00"
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
        text, [(a, b)] = assistant_spans(template, msgs, 0, where="the stop-token probe")
        at = text.find(marker, a)
        if at >= 0:
            texts.append(text[at + len(marker):b].strip())
        texts.append(template.variables.get("eos_token") or "")
    out = []
    for s in texts:
        ids = tok.encode(s) if s else []
        if len(ids) == 1:
            out.append(int(ids[0]))
    if tok.eos_id is not None:
        out.append(int(tok.eos_id))
    return list(dict.fromkeys(out))
