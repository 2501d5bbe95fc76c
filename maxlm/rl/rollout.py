"""Rollouts: the batch source of objective=grpo. Each rollout samples `rl.group_size` completions of each of
global_batch_size / group_size prompts with the policy as it is now (maxlm's own decoder, on the training
mesh, with the training params: no second engine and no weight copy), scores them with the run's rewards,
normalises each group's rewards into advantages, and adds the trainer's own log-probabilities of every
completion token, the "old" ones of the update. One rollout feeds `rl.updates_per_batch` optimizer steps.

The sampler's random key is the rollout's number folded into the run's seed, and the prompts come in a fixed
order from data.seed, so a resumed run samples the same completions. Each step's row reports the rewards,
the completions' lengths and the sampler-to-trainer log-probability gap (docs/rl.md).
"""

import collections
import threading
import time
import zlib
from typing import Callable, NamedTuple

import jax
import numpy as np

from maxlm import generate, sharding
from maxlm.data import order as order_lib, sources
from maxlm.errors import ConfigError
from maxlm.rl import rewards as rewards_lib


class Prompt(NamedTuple):
    record: dict
    where: str
    ids: np.ndarray  # the prompt's token ids, as the model sees them before its completion


def prompt_messages(record, where: str):
    """A record's prompt: `prompt` as text or a messages list, or `messages`; (text or None, messages or None)."""
    p = record.get("prompt", record.get("messages")) if isinstance(record, dict) else None
    if isinstance(p, str) and p.strip():
        return p, None
    if isinstance(p, list) and p and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in p):
        return None, p
    raise ConfigError(f"data.format=prompt: the record at {sources.locate(where)} has no `prompt` (text or a messages "
                      f"list) nor `messages`; every record needs one")


class Prompts:
    """The prompt records of data.path (JSONL), endlessly, each pass over the file's units in a fresh order
    (data.seed): `take(n)` the next n. The position is a count of records taken, so a resume is exact."""

    def __init__(self, cfg, tok, template):
        d = cfg.data
        self.src = sources.JsonlSource(sources.resolve(d.path, "data.path", sources.SUFFIXES["jsonl"]), d.field, records=True)
        self.order = order_lib.Order(len(self.src), d.seed, 0)
        self.tok, self.template, self.add_bos = tok, template, d.add_bos
        self.limit = cfg.rl.max_prompt_tokens
        self.taken, self._unit, self._records = 0, -1, []  # position; the unit in memory and its good records
        self._starts = [0]  # records before each unit taken so far, in the sequence's order

    def _unit_records(self, k: int) -> list:
        out = []
        for rec, skip, where in self.src.read_unit(self.order[k]):
            if skip == "empty":
                continue
            if skip:
                raise ConfigError(f"data.format=prompt: the line at {sources.locate(where)} is not a JSON record ({skip})")
            out.append((rec, where))
        return out

    def _seek(self, i: int) -> tuple[dict, str]:
        """The i-th record of the endless sequence: units are counted in order as the position reaches them (a
        resume counts the ones before it again), and the one holding it is kept in memory."""
        while self._starts[-1] <= i:
            k = len(self._starts) - 1
            self._unit, self._records = k, self._unit_records(k)
            self._starts.append(self._starts[-1] + len(self._records))
            if k + 1 >= len(self.src) and self._starts[-1] == 0:
                raise ConfigError("data.format=prompt: data.path holds no prompt records")
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        if k != self._unit:
            self._unit, self._records = k, self._unit_records(k)
        return self._records[i - self._starts[k]]

    def encode(self, record, where: str) -> np.ndarray:
        text, messages = prompt_messages(record, where)
        if self.template is not None:
            msgs = messages or [{"role": "user", "content": text}]
            ids = self.tok.encode(self.template.render(msgs, add_generation_prompt=True, where=sources.locate(where)))
        elif messages is not None:
            raise ConfigError(f"data.format=prompt: the record at {sources.locate(where)} holds messages, and no chat "
                              f"template renders them; set data.chat_template")
        else:
            ids = self.tok.encode(text)
            if self.add_bos:
                ids = np.r_[self.tok.bos_id, ids]
        if len(ids) > self.limit:
            raise ConfigError(f"data.format=prompt: the prompt at {sources.locate(where)} is {len(ids)} tokens, more than "
                              f"rl.max_prompt_tokens={self.limit}; raise it (and seq_len) or shorten the prompt")
        return np.asarray(ids, np.int32)

    def take(self, n: int) -> list[Prompt]:
        out = []
        for i in range(self.taken, self.taken + n):
            rec, where = self._seek(i)
            out.append(Prompt(rec, where, self.encode(rec, where)))
        self.taken += n
        return out


def advantages(total_BG: np.ndarray, scale: bool) -> np.ndarray:
    """Each completion's reward less its group's mean, over the group's standard deviation (Bessel-corrected,
    + 1e-4) when `scale`: TRL's GRPOTrainer computes them so."""
    a = total_BG - total_BG.mean(1, keepdims=True)
    return a / (total_BG.std(1, ddof=1, keepdims=True) + 1e-4) if scale else a


class Rollouts:
    """The batch source of objective=grpo (see the module's docstring). `policy()` gives the params the model
    runs with now (natural layer order, transforms attached): the Trainer's state, read when a rollout starts."""

    def __init__(self, cfg, recipe, ss, tok, template, policy: Callable, log):
        r = cfg.rl
        self.cfg, self.rl, self.recipe, self.ss, self.tok, self.policy, self.log = cfg, r, recipe, ss, tok, policy, log
        self.tokenizer = tok
        self.G, self.B, self.L = r.group_size, cfg.global_batch_size, cfg.seq_len
        self.prompts = Prompts(cfg, tok, template)
        self.rewards = rewards_lib.build(r.rewards)
        self.stops = generate_stops(tok, template)
        self.rollouts, self.uses, self.batch = 0, 0, None
        self.wait_s, self.skips, self.steps_per_epoch, self.epochs = 0.0, {}, None, cfg.data.epochs
        self._reports = collections.deque()
        T = r.temperature
        old = lambda p, b: -recipe.forward.token_losses(p, b, temperature=T).tok_BL  # noqa: E731
        self._old = jax.jit(old, out_shardings=ss.abstract_batch["old_logp"].sharding)

    def describe(self) -> str:
        names = ", ".join(f"{x.name} x {x.weight:g}" for x in self.rewards)
        return (f"rollouts of {self.B // self.G} prompts x {self.G} completions (up to {self.rl.max_new_tokens} tokens, "
                f"temperature {self.rl.temperature:g}) from {len(self.prompts.src.files)} JSONL file(s), each feeding "
                f"{self.rl.updates_per_batch} update(s); rewards {names}")

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        t = time.perf_counter()
        if self.batch is None or self.uses >= self.rl.updates_per_batch:
            self._roll()
        self.uses += 1
        self._reports.append(self._report)
        self.wait_s += time.perf_counter() - t
        return self.batch

    def metrics(self) -> dict:
        """The report of the batch of the step being collected (the loop collects steps in order, each once)."""
        return self._reports.popleft() if self._reports else {}

    # ---- one rollout ----

    def _roll(self) -> None:
        # The policy is the previous update's output: wait for it first, so that rollout_s is the sampling's
        # own time and not also the update's still running on the device.
        params = jax.block_until_ready(self.policy())
        t0 = time.perf_counter()
        prompts = self.prompts.take(self.B // self.G)
        seed = zlib.crc32(f"{self.cfg.seed}/rollout/{self.rollouts}".encode())
        rows = [p.ids for p in prompts for _ in range(self.G)]
        with sharding.use(self.ss.mesh, self.ss.rule_table):
            g = generate.decode(params, self.recipe.model, rows, self.rl.max_new_tokens, temperature=self.rl.temperature,
                                top_k=self.rl.top_k or None, top_p=self.rl.top_p if self.rl.top_p < 1 else None, seed=seed,
                                eos_id=self.stops, dtype=self.cfg.dtype, return_logps=True)
        t1 = time.perf_counter()
        scores = self._score(prompts, g)
        t2 = time.perf_counter()
        host = self._rows(rows, g, scores)
        batch = {k: jax.make_array_from_callback(a.shape, self.ss.abstract_batch[k].sharding, lambda i, a=a: a[i])
                 for k, a in host.items()}
        with sharding.use(self.ss.mesh, self.ss.rule_table):
            batch["old_logp"] = self._old(params, batch)
        old = np.asarray(jax.device_get(batch["old_logp"]))
        self._report = self._summary(rows, g, scores, host, old) | {"rollout_s": t1 - t0, "reward_s": t2 - t1,
                                                                    "rollout_logp_s": time.perf_counter() - t2}
        self.batch, self.uses = batch, 0
        self.rollouts += 1

    def _score(self, prompts: list[Prompt], g) -> dict[str, np.ndarray]:
        """Each reward of each completion, [B] by name, run on a watched thread: a reward that outlasts
        rl.reward_timeout_s is named, and the run stops."""
        out = {r.name: np.zeros(self.B, np.float64) for r in self.rewards}
        state = {"at": None, "done": threading.Event(), "error": None}

        def work():
            try:
                for i in range(self.B):
                    p = prompts[i // self.G]
                    text = self._text(g.tokens[i, :g.lengths[i]])
                    mark = lambda name, i=i, p=p: state.update(at=(name, p.where, time.monotonic()))  # noqa: E731
                    for name, v in rewards_lib.score(self.rewards, p.record, text, sources.locate(p.where), mark).items():
                        out[name][i] = v
            except BaseException as e:  # noqa: BLE001 - given back to the loop's thread, raised there
                state["error"] = e
            state["done"].set()

        threading.Thread(target=work, daemon=True, name="maxlm-rewards").start()
        limit = self.rl.reward_timeout_s
        while not state["done"].wait(0.5):
            name, where, since = state["at"] or ("", "", time.monotonic())
            if time.monotonic() - since > limit:
                raise ConfigError(f"rl.rewards: {name} took more than rl.reward_timeout_s={limit:g} s on the record at "
                                  f"{sources.locate(where)}; make it faster or raise the limit")
        if state["error"] is not None:
            raise state["error"]
        return out

    def _text(self, ids: np.ndarray) -> str:
        """A completion's text, without the token that ended it."""
        if len(ids) and int(ids[-1]) in self.stops:
            ids = ids[:-1]
        return self.tok.decode(ids)

    def _rows(self, rows: list[np.ndarray], g, scores: dict) -> dict[str, np.ndarray]:
        """The packed rows of one rollout: each prompt then its completion, the loss on the completion's tokens
        (the ending token included), and each completion's advantage."""
        B, L = self.B, self.L
        out = {k: np.zeros((B, L), np.int32) for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
        for i, (p, toks, n) in enumerate(zip(rows, g.tokens, g.lengths)):
            seq = np.r_[p, toks[:n]]
            m = len(seq) - 1
            out["inputs"][i, :m], out["targets"][i, :m] = seq[:-1], seq[1:]
            out["positions"][i, :m], out["segment_ids"][i, :m] = np.arange(m), 1
            out["loss_mask"][i, len(p) - 1:m] = 1
        total = sum(r.weight * scores[r.name] for r in self.rewards)
        out["advantages"] = advantages(total.reshape(-1, self.G), self.rl.scale_rewards).reshape(B).astype(np.float32)
        out["old_logp"] = np.zeros((B, L), np.float32)  # the trainer's forward fills it (_roll)
        return out

    def _summary(self, rows, g, scores: dict, host: dict, old: np.ndarray) -> dict:
        total = sum(r.weight * scores[r.name] for r in self.rewards)
        by_group = total.reshape(-1, self.G)
        mask = host["loss_mask"] > 0
        gap = np.zeros_like(old)
        for i, p in enumerate(rows):
            n = int(g.lengths[i])
            gap[i, len(p) - 1:len(p) - 1 + n] = np.abs(old[i, len(p) - 1:len(p) - 1 + n] - g.logps[i, :n])
        ended = np.array([n > 0 and int(t[n - 1]) in self.stops for t, n in zip(g.tokens, g.lengths)])
        out = {"reward": float(total.mean()), "reward_std": float(total.std()),
               "solved": float((by_group.max(1) > 0).mean()) if len(self.rewards) else 0.0,
               "completion_len": float(g.lengths.mean()), "completion_len_max": float(g.lengths.max()),
               "truncated": float((~ended).mean()), "logp_gap_max": float(gap[mask].max(initial=0.0)),
               "logp_gap_mean": float(gap[mask].mean()) if mask.any() else 0.0,
               "groups_all_equal": float((by_group.std(1) == 0).mean())}
        for r in self.rewards:
            out[f"reward/{r.name}"] = float(scores[r.name].mean())
        return out

    # ---- position ----

    def get_state(self) -> dict:
        return {"prompts": self.prompts.taken, "rollouts": self.rollouts, "uses": self.uses}

    def set_state(self, state: dict) -> None:
        if state.get("uses", 0) not in (0, self.rl.updates_per_batch):  # the rollout itself is not checkpointed
            self.log(f"the checkpoint was saved after update {state['uses']} of a rollout's {self.rl.updates_per_batch}: "
                     f"its other updates are skipped, and the next rollout starts")
        self.prompts.taken, self.rollouts, self.uses, self.batch = state["prompts"], state["rollouts"], 0, None

    def close(self) -> None:
        pass


def generate_stops(tok, template) -> list[int]:
    """The ids that end a completion: the template's end of turn and the tokenizer's EOS (chat.stop_ids)."""
    from maxlm.data import chat

    stops = chat.stop_ids(tok, template)
    if not stops:
        raise ConfigError("objective=grpo: the tokenizer has no end-of-sequence token and no chat template ends a turn, "
                          "so a completion could never end; use a tokenizer with an EOS or set data.chat_template")
    return stops
