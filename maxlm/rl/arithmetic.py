"""Small-number arithmetic, the task of the GRPO demonstration (docs/rl.md): "17+25=" and its answer, "42".

The demonstrations a model is fine-tuned on are often imperfect. Here half of the SFT answers are off by
one or two, so the SFT model says the right answer only part of the time; GRPO with an exact-match reward
then teaches it to prefer the right one. No download: the problems are every `a+b` and `a-b` (a >= b) with
operands up to `high`.

    python -m maxlm.rl.arithmetic --out data/arithmetic

writes, from a fixed seed:
- `sft.jsonl`: {"text": "17+25=42"}: each problem `copies` times, its answer wrong with probability
  `noise` each time (data.format=text);
- `prompts.jsonl`: {"prompt": "17+25=", "answer": "42"}: each problem once (data.format=prompt);
- `eval.jsonl`: the held-out problems, in the prompt form: about 1 in 10, by a hash of the problem's text,
  in neither of the other two.
"""

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from maxlm import cli
from maxlm.errors import ConfigError


def held_out(problem: str) -> bool:
    """About 1 problem in 10, by a hash of its text."""
    return int(hashlib.sha256(problem.encode()).hexdigest(), 16) % 10 == 0


def problems(high: int) -> list[tuple[str, int]]:
    """Every a+b and a-b (a >= b, so no answer is negative) with a, b in [0, high]: (prompt, answer)."""
    out = []
    for a in range(high + 1):
        for b in range(high + 1):
            out.append((f"{a}+{b}=", a + b))
            if a >= b:
                out.append((f"{a}-{b}=", a - b))
    return out


def demonstration(prompt: str, answer: int, rng: np.random.Generator, noise: float) -> str:
    if rng.random() < noise:
        d = int(rng.choice([-2, -1, 1, 2]))
        answer = answer + d if answer + d >= 0 else answer - d
    return f"{prompt}{answer}"


def write(out: Path, high: int = 29, copies: int = 8, noise: float = 0.5, seed: int = 0) -> dict[str, int]:
    """Write the three files into `out`; returns each one's record count."""
    rng = np.random.default_rng(seed)
    every = problems(high)
    train = [every[i] for i in rng.permutation(len(every)) if not held_out(every[i][0])]
    sft = [demonstration(p, a, rng, noise) for p, a in train for _ in range(copies)]
    files = {"sft.jsonl": [{"text": sft[i]} for i in rng.permutation(len(sft))],
             "prompts.jsonl": [{"prompt": p, "answer": str(a)} for p, a in train],
             "eval.jsonl": [{"prompt": p, "answer": str(a)} for p, a in every if held_out(p)]}
    out.mkdir(parents=True, exist_ok=True)
    for name, recs in files.items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    return {name: len(recs) for name, recs in files.items()}


def main(argv=None) -> int:
    p = cli.Parser(prog="python -m maxlm.rl.arithmetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=cli.path, help="directory to write sft.jsonl, prompts.jsonl and eval.jsonl")
    p.add_argument("--high", type=cli.whole(1), default=29, help="the largest operand (default 29)")
    p.add_argument("--copies", type=cli.whole(1), default=8, help="SFT demonstrations of each problem (default 8)")
    p.add_argument("--noise", type=cli.fraction, default=0.5,
                   help="the chance that a demonstration's answer is wrong (default 0.5)")
    p.add_argument("--seed", type=cli.whole(0), default=0)
    try:
        a = p.parse_args(argv)
        out = Path(a.out)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out} is a file, not a directory")
        counts = write(out, a.high, a.copies, a.noise, a.seed)
    except ConfigError as e:
        print(f"maxlm: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"maxlm: error: --out {a.out} cannot be written ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(f'{out / k} ({n} records)' for k, n in counts.items())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
