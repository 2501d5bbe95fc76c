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
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

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
    """The prompt records of data.path (JSONL lines or Parquet rows), endlessly, each pass over the files' units in
    a fresh order (data.seed): `take(n)` the next n. The position is a count of records taken, so a resume is
    exact."""

    def __init__(self, cfg, tok, template):
        d = cfg.data
        files = sources.resolve(d.path, "data.path", sources.SUFFIXES[d.source])
        self.src = (sources.ParquetSource(files, d.field, records=True) if d.source == "parquet"
                    else sources.JsonlSource(files, d.field, records=True))
        self.order = order_lib.Order(len(self.src), d.seed, 0)
        self.tok, self.template, self.add_bos = tok, template, d.add_bos
        self.limit = cfg.rl.max_prompt_tokens
        if template is not None:
            check_opens_assistant_turn(template)
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
            if msgs[-1]["role"] == "assistant":
                raise ConfigError(f"data.format=prompt: the record at {sources.locate(where)} ends with an assistant turn; a "
                                  f"prompt's messages end where the model's answer starts (a user or tool turn)")
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


def old_logp_program(recipe, ss, temperature: float):
    """The trainer's forward over a rollout's packed rows: each target's log-probability at the sampler's
    temperature, the update's `old_logp`, and for an MoE model the experts each position's token chose
    ([B, L, MoE layers], forward.Scored.routes; else None), to compare with the decoder's."""
    moe = bool(recipe.model.n_experts)
    sh = ss.abstract_batch["old_logp"].sharding
    routes_sh = NamedSharding(sh.mesh, P(*sh.spec, *[None] * (3 - len(sh.spec))))

    def old_logp(params, batch):
        s = recipe.forward.token_losses(params, batch, temperature=temperature, routes=moe)
        return -s.tok_BL, s.routes

    return jax.jit(old_logp, out_shardings=(sh, routes_sh if moe else None))


def compile_programs(cfg, ss) -> list[tuple[str, object]]:
    """What a run compiles besides its train step, compiled for its devices without running (the dry run):
    the reshard to natural layer order if the layout needs one, the decoder at each prompt length a rollout
    can pad to, and the old log-probabilities' forward. Returns (name, compiled) for each, in that order."""
    r, mesh = cfg.rl, ss.mesh
    one = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    params, out = ss.model_params(ss.abstract), []
    with sharding.use(mesh, ss.rule_table):
        if ss.reshard() is not None:
            out.append(("reshard to natural layer order", ss.reshard().lower(params).compile()))
            params = jax.eval_shape(ss.reshard(), params)
        for length in prompt_buckets(r.max_prompt_tokens):
            rows = [one((cfg.global_batch_size, length), jnp.int32)] * 3
            scalars = [one((), jnp.int32), one((), jnp.float32), one((), jnp.int32), one((), jnp.float32)]
            compiled = generate._generate.lower(  # two stop ids: an EOS and a chat template's end of turn
                params, *rows, *scalars, one((2,), jnp.int32), one((), jnp.int32), m=cfg.model, dtype=jnp.dtype(cfg.dtype),
                n_new=r.max_new_tokens, greedy=False, filtered=bool(r.top_k) or r.top_p < 1, return_logits=False,
                return_logps=True, return_routes=bool(cfg.model.n_experts), out_sharding=generate._replicated(params),
                rules=sharding.current_rules()).compile()
            out.append((f"decoder, prompts padded to {length} tokens", compiled))
        batch = ss.abstract_batch
        out.append(("old log-probabilities", old_logp_program(ss.recipe, ss, r.temperature).lower(params, batch).compile()))
    return out


def pack(prompts, g, L: int) -> dict[str, np.ndarray]:
    """[B, L] rows of each prompt then its completion (`g`: generate.Generation), the loss on the completion's
    tokens, the ending token included: position len(prompt) - 1 + t predicts completion token t."""
    out = {k: np.zeros((len(prompts), L), np.int32) for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}
    for i, (p, toks, n) in enumerate(zip(prompts, g.tokens, g.lengths)):
        seq = np.r_[p, toks[:n]]
        m = len(seq) - 1
        out["inputs"][i, :m], out["targets"][i, :m] = seq[:-1], seq[1:]
        out["positions"][i, :m], out["segment_ids"][i, :m] = np.arange(m), 1
        out["loss_mask"][i, len(p) - 1:m] = 1
    return out


def prompt_buckets(limit: int) -> tuple[int, ...]:
    """The prompt lengths the decoder is compiled for: powers of two from 8, and the limit rounded up to 8.
    A rollout pads its prompts to the smallest that holds its longest, so a run compiles at most these
    decoders (a few, whatever the prompts' lengths) and a short-prompt rollout does not pay the limit's cost."""
    top = -(-limit // 8) * 8
    return tuple(b for b in (8 << i for i in range(top.bit_length())) if b < top) + (top,)


def check_opens_assistant_turn(template) -> None:
    """Once, before any prompt: a template whose generation prompt adds nothing would have every completion
    continue the user's turn."""
    msgs = [{"role": "user", "content": "1+1="}]
    if template.render(msgs, add_generation_prompt=True) == template.render(msgs, add_generation_prompt=False):
        raise ConfigError(f"data.chat_template {template.name} renders no assistant turn after a prompt (its "
                          f"add_generation_prompt adds nothing), so a completion would continue the user's turn; "
                          f"use a template that opens the assistant's turn")


def advantages(total_BG: np.ndarray, scale: bool) -> np.ndarray:
    """Each completion's reward less its group's mean, over the group's standard deviation (Bessel-corrected,
    + 1e-4) when `scale`: TRL's GRPOTrainer computes them so."""
    a = total_BG - total_BG.mean(1, keepdims=True)
    return a / (total_BG.std(1, ddof=1, keepdims=True) + 1e-4) if scale else a


class Rollouts:
    """The batch source of objective=grpo (see the module's docstring). `state()` gives the Trainer's state,
    read when a rollout starts; the decoder runs its params as the model does (StateSpec.natural_params)."""

    def __init__(self, cfg, recipe, ss, tok, template, state: Callable, log):
        r = cfg.rl
        self.cfg, self.rl, self.recipe, self.ss, self.tok, self.state, self.log = cfg, r, recipe, ss, tok, state, log
        self.tokenizer = tok
        self.G, self.B, self.L = r.group_size, cfg.global_batch_size, cfg.seq_len
        self.prompts = Prompts(cfg, tok, template)
        self.rewards = rewards_lib.build(r.rewards)
        self.stops = generate_stops(tok, template)
        self.buckets, self.compiled = prompt_buckets(r.max_prompt_tokens), set()
        self.rollouts, self.uses, self.batch = 0, 0, None
        self.wait_s, self.skips, self.steps_per_epoch, self.epochs = 0.0, {}, None, cfg.data.epochs
        self._reports = collections.deque()
        self._old = old_logp_program(recipe, ss, r.temperature)

    def describe(self) -> str:
        names = ", ".join(f"{x.name} x {x.weight:g}" for x in self.rewards)
        return (f"rollouts of {self.B // self.G} prompts x {self.G} completions (up to {self.rl.max_new_tokens} tokens, "
                f"temperature {self.rl.temperature:g}) from {len(self.prompts.src.files)} {self.cfg.data.source} file(s), "
                f"each feeding {self.rl.updates_per_batch} update(s); rewards {names}; the decoder compiles for prompts "
                f"padded to {', '.join(map(str, self.buckets))} tokens as rollouts need them")

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
        # The state is the previous update's output: wait for it first, so that neither reshard_s nor
        # rollout_s counts the update still running on the device.
        t = time.perf_counter()
        state = jax.block_until_ready(self.state())
        update_s, t = time.perf_counter() - t, time.perf_counter()  # the previous update, not overlapped
        params = jax.block_until_ready(self.ss.natural_params(state))  # a circular pipeline's: one compiled reshard
        t0 = time.perf_counter()
        prompts, g, scores, info = self._groups(params)
        rows = [p.ids for p in prompts for _ in range(self.G)]
        t1, t2 = t0 + info.pop("sample_s"), time.perf_counter()  # sampling, then scoring (interleaved over rounds)
        host = self._rows(rows, g, scores)
        batch = {k: jax.make_array_from_callback(a.shape, self.ss.abstract_batch[k].sharding, lambda i, a=a: a[i])
                 for k, a in host.items()}
        with sharding.use(self.ss.mesh, self.ss.rule_table):
            batch["old_logp"], routes = self._old(params, batch)
        # Every process compares the whole batch: the trainer's numbers, gathered
        old, routes = (None if a is None else np.asarray(multihost_utils.process_allgather(a, tiled=True))
                       for a in (batch["old_logp"], routes))
        self._report = self._summary(rows, g, scores, host, old, routes) | info | {
            "rollout_s": t1 - t0, "reward_s": t2 - t1, "rollout_logp_s": time.perf_counter() - t2, "update_wait_s": update_s}
        if self.ss.reshard() is not None:
            self._report["reshard_s"] = t0 - t
        self.batch, self.uses = batch, 0
        self.rollouts += 1

    def _groups(self, params):
        """The rollout's B / G prompts, their completions and rewards. With rl.dynamic_sampling (DAPO's dynamic
        sampling), a group whose rewards are all equal (advantage 0: it teaches nothing) is set aside and up to
        that many more rounds of B / G prompts are sampled to replace it; groups set aside fill what the rounds
        could not, and `groups_all_equal` shows them."""
        want, extra = self.B // self.G, self.rl.dynamic_sampling
        kept, spare, sampled, sample_s = [], [], [], 0.0
        for round_ in range(1 + extra):
            prompts = self.prompts.take(want)
            t = time.perf_counter()
            g = self._sample(params, prompts, round_)
            sample_s += time.perf_counter() - t
            scores = self._score(prompts, g)
            total = sum(r.weight * scores[r.name] for r in self.rewards).reshape(want, self.G)
            sampled.append(total)
            for j in range(want):
                group = (prompts[j], round_, j, g, scores)
                (spare if extra and total[j].std() == 0 else kept).append(group)
            if len(kept) >= want:
                break
        chosen = (kept + spare)[:want]
        rows_of = lambda c: slice(c[2] * self.G, (c[2] + 1) * self.G)  # noqa: E731 - a group's rows in its round
        g = type(g)(*[None if f is None else np.concatenate([getattr(c[3], n)[rows_of(c)] for c in chosen])
                      for n, f in zip(g._fields, g)])
        scores = {r.name: np.concatenate([c[4][r.name][rows_of(c)] for c in chosen]) for r in self.rewards}
        info = {"sample_s": sample_s}
        if extra:
            info |= {"sampling_rounds": round_ + 1, "reward_sampled": float(np.mean(sampled))}
        return [c[0] for c in chosen], g, scores, info

    def _sample(self, params, prompts: list[Prompt], round_: int):
        """G completions of each prompt, from the decoder compiled for the smallest prompt length that holds them."""
        tag = f"/round/{round_}" if round_ else ""  # round 0 draws what a run without dynamic sampling draws
        seed = zlib.crc32(f"{self.cfg.seed}/rollout/{self.rollouts}{tag}".encode())
        rows = [p.ids for p in prompts for _ in range(self.G)]
        bucket = next(b for b in self.buckets if b >= max(map(len, rows)))
        if bucket not in self.compiled:
            self.compiled.add(bucket)
            self.log(f"rollout {self.rollouts}: compiling the decoder for prompts padded to {bucket} tokens "
                     f"({len(self.compiled)} of at most {len(self.buckets)})")
        with sharding.use(self.ss.mesh, self.ss.rule_table):
            return generate.decode(params, self.recipe.model, rows, self.rl.max_new_tokens, temperature=self.rl.temperature,
                                   top_k=self.rl.top_k or None, top_p=self.rl.top_p if self.rl.top_p < 1 else None,
                                   seed=seed, eos_id=self.stops, dtype=self.cfg.dtype, return_logps=True, prompt_len=bucket,
                                   return_routes=bool(self.recipe.model.n_experts))

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
        out = pack(rows, g, L)
        total = sum(r.weight * scores[r.name] for r in self.rewards)
        out["advantages"] = advantages(total.reshape(-1, self.G), self.rl.scale_rewards).reshape(B).astype(np.float32)
        out["old_logp"] = np.zeros((B, L), np.float32)  # the trainer's forward fills it (_roll)
        return out

    def _summary(self, rows, g, scores: dict, host: dict, old: np.ndarray, routes) -> dict:
        """The rollout's row: rewards, lengths, and where the sampler and the trainer disagree: log-probabilities
        and, for MoE, the completion tokens routed to other experts in any layer."""
        total = sum(r.weight * scores[r.name] for r in self.rewards)
        by_group = total.reshape(-1, self.G)
        mask = host["loss_mask"] > 0
        gap = np.zeros_like(old)
        sampled = None if routes is None else np.zeros_like(routes)  # the decoder's routes where the trainer's are
        for i, p in enumerate(rows):
            n, at = int(g.lengths[i]), len(p) - 1  # position at + t's token decided completion token t
            gap[i, at:at + n] = np.abs(old[i, at:at + n] - g.logps[i, :n])
            if sampled is not None:
                sampled[i, at:at + n] = g.routes[i, :n]
        ended = np.array([n > 0 and int(t[n - 1]) in self.stops for t, n in zip(g.tokens, g.lengths)])
        out = {"reward": float(total.mean()), "reward_std": float(total.std()),
               "solved": float((by_group.max(1) > 0).mean()) if len(self.rewards) else 0.0,
               "completion_len": float(g.lengths.mean()), "completion_len_max": float(g.lengths.max()),
               "truncated": float((~ended).mean()), "logp_gap_max": float(gap[mask].max(initial=0.0)),
               "logp_gap_mean": float(gap[mask].mean()) if mask.any() else 0.0,
               "entropy": float(np.mean(np.concatenate([e[:n] for e, n in zip(g.entropy, g.lengths)]))),
               "groups_all_equal": float((by_group.std(1) == 0).mean())}
        if sampled is not None:
            out["routes_differ"] = float((sampled != routes).any(-1)[mask].mean()) if mask.any() else 0.0
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
