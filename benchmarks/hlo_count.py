"""Loop-aware counts over an optimized HLO module's text: each op as many times per step as it runs.

XLA's `cost_analysis()` counts a while loop's body once. Here every computation gets the number of times
it runs per step: a while body runs its trip count (XLA's known_trip_count, else the largest s32
constant its condition compares with) per run of its caller; a computation reached through `calls=`, `to_apply=` or branches runs as
often as its caller. Ops are then weighted by that count.

Bytes per collective, per device, from the op's own shapes (the result; a reduce-scatter's operand):
- `bytes`: the collective's array, as written in the HLO (libtpu writes a reduce-scatter as an all-reduce
  inside an `all-reduce-scatter` fusion: counted as the reduce-scatter it is);
- `sent`: a ring algorithm's bytes sent per device over a group of g: all-reduce 2(g-1)/g, all-gather,
  reduce-scatter and all-to-all (g-1)/g of the full array, a collective-permute the whole buffer. An
  estimate of the wire, not a measurement: the ICI's topology and XLA's algorithms may do better.
"""

import math
import re
from collections import defaultdict

BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
         "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
SHAPE = re.compile(r"\b(" + "|".join(sorted(BYTES, key=len, reverse=True)) + r")\[([0-9,]*)\]")
CALLEE = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|called_computations)=\{?([%\w.\-, ]+)\}?")


def computations(hlo: str) -> dict:
    """{computation name: its lines} of an HLO module's text, and "ENTRY" naming the entry computation."""
    out, name = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            out[name] = []
            if line.startswith("ENTRY"):
                out["ENTRY"] = name
        elif name is not None:
            out[name].append(line)
    return out


def _operands(line: str) -> list[str]:
    """The names an instruction reads (its opcode is the first word after a space followed by '(': the
    layouts' T(8,128) follow a colon or a parenthesis)."""
    body = re.search(r" [a-z][\w\-]*\((.*?)\)(?:, [a-z_]+=|$)", line.split(" = ", 1)[1])
    return re.findall(r"%([\w.\-]+)", body.group(1)) if body else []


def _constant(defs: dict, name: str) -> int | None:
    """The integer a scalar is, through copies; None if it is not a constant."""
    line = defs.get(name, "")
    m = re.search(r" constant\((-?\d+)\)", line)
    if m:
        return int(m.group(1))
    return _constant(defs, _operands(line)[0]) if re.search(r" copy\(", line) else None


def _trip(comps: dict, defs: dict, init: str, cond: str, body: str) -> int:
    """A while loop's trip count from its counter: the condition's `i < limit` on tuple element k, the
    body's `i + step` there and the initial tuple's constant (libtpu's windowed matmul loops step by 2, so
    their limit is twice their trips). Else the largest integer constant the condition holds."""
    lines = comps.get(cond, [])
    try:
        root = next(x for x in lines if x.lstrip().startswith("ROOT") and " compare(" in x and "direction=LT" in x)
        counter, limit = _operands(root)
        k = int(re.search(r"index=(\d+)", defs[counter]).group(1))
        body_root = next(x for x in comps[body] if x.lstrip().startswith("ROOT"))
        step_line = defs[_operands(body_root)[k]]
        step = next(c for c in (_constant(defs, o) for o in _operands(step_line)) if c is not None)
        start, stop = _constant(defs, _operands(defs[init])[k]), _constant(defs, limit)
        if " add(" in step_line and step > 0 and start is not None and stop is not None:
            return max(0, -(-(stop - start) // step))
    except (StopIteration, KeyError, AttributeError, IndexError, ValueError):
        pass
    return max((int(c) for c in re.findall(r"[su](?:32|64)\[\](?:\{[^}]*\})? constant\((\d+)\)", "\n".join(lines))),
               default=1)


def runs(comps: dict) -> dict:
    """{computation: times it runs per run of the entry computation}."""
    calls = defaultdict(list)  # callee -> [(caller, multiplier)]
    defs = {m.group(1): line for lines in comps.values() if isinstance(lines, list) for line in lines
            if (m := re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line))}
    for name, lines in comps.items():
        if name == "ENTRY":
            continue
        for line in lines:
            loop = re.search(r" while\(%?([\w.\-]+)\).*condition=%?([\w.\-]+), body=%?([\w.\-]+)", line)
            if loop:
                known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                trip = int(known.group(1)) if known else _trip(comps, defs, *loop.groups())
                calls[loop.group(3)].append((name, trip))
                calls[loop.group(2)].append((name, trip + 1))
                continue
            for group in CALLEE.findall(line):
                for callee in re.findall(r"%?([\w.\-]+)", group):
                    if callee in comps:
                        calls[callee].append((name, 1))
    memo = {}

    def times(name, seen=()):
        if name == comps.get("ENTRY"):
            return 1
        if name in memo:
            return memo[name]
        total = sum(k * times(up, (*seen, name)) for up, k in calls.get(name, ()) if up not in seen)
        memo[name] = total
        return total
    return {name: times(name) for name in comps if name != "ENTRY"}


def _size(text: str) -> float:
    return sum(BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in SHAPE.findall(text))


def _group(line: str) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)  # mesh['data'=8,'fsdp'=2] {'fsdp'}
    if m:
        sizes = {a: int(n) for a, n in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=", line)
    return 2 if m else 1


def collectives(hlo: str) -> dict:
    """{kind: {"ops": per step, "bytes": per step, "sent": ring estimate per step}} per device."""
    comps = computations(hlo)
    n = runs(comps)
    out = {k: {"ops": 0, "bytes": 0.0, "sent": 0.0} for k in KINDS}
    for name, lines in comps.items():
        if name == "ENTRY" or not n.get(name):
            continue
        for line in lines:
            m = re.search(r"= (.*?) (" + "|".join(KINDS) + r")(-start)?\(", line)
            if not m or "-done(" in line:
                continue
            kind, result = m.group(2), m.group(1)
            shapes = [_size(f"{t}[{d}]") for t, d in SHAPE.findall(result)]
            size = sum(shapes)
            if kind == "all-reduce" and name.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"  # libtpu's: an all-reduce of the whole operand, fused with the slice each keeps
            elif m.group(3) and kind == "all-gather":  # (operands..., results...): the results are the larger half
                size = sum(sorted(shapes)[len(shapes) // 2:])
            elif m.group(3) and kind == "collective-permute":  # (operand, result, contexts): one buffer travels
                size = shapes[0]
            g = _group(line)
            if kind == "reduce-scatter" and not name.startswith("all-reduce-scatter"):
                size *= g  # the operand, of which each device keeps 1/g
            frac = {"all-reduce": 2 * (g - 1) / g, "collective-permute": 1.0}.get(kind, (g - 1) / g)
            c = out[kind]
            c["ops"] += n[name]
            c["bytes"] += size * n[name]
            c["sent"] += size * frac * n[name]
    return out


def _dims(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _dot(line: str, out: list[int], operands: list[list[int]]) -> float:
    contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
    return 2 * math.prod(out) * math.prod(operands[0][i] for i in _dims(contract.group(1) if contract else ""))


def _window_pairs(size: int, out: int, win: int, stride: int, lo: int, lhs_dilate: int, rhs_dilate: int) -> int:
    """(output position, window position) pairs of one spatial dimension that read a real input element,
    not padding or a dilation hole: the multiply-adds that dimension contributes."""
    if lhs_dilate > 1:  # a transposed convolution's input has holes
        span = (size - 1) * lhs_dilate + 1
        return sum(0 <= p < span and p % lhs_dilate == 0
                   for k in range(win) for p in (o * stride + k * rhs_dilate - lo for o in range(out)))
    pairs = 0
    for k in range(win):  # outputs o with 0 <= o*stride + k*rhs_dilate - lo < size
        first = max(0, -(-(lo - k * rhs_dilate) // stride))
        last = min(out - 1, (size - 1 + lo - k * rhs_dilate) // stride)
        pairs += max(0, last - first + 1)
    return pairs


def _convolution(line: str, out: list[int], operands: list[list[int]]) -> float:
    """2 x output batch x output features x input features per group x, for every spatial dimension, the
    window positions that land on input (libtpu writes a matmul with batch or head dimensions as a
    convolution whose padded window picks one position per output, so a window's full size overcounts)."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", line)
    lhs_l, rhs_l, out_l = labels.groups()
    lhs, rhs = operands
    window = dict(re.findall(r"(\w+)=([0-9_x]+)", (re.search(r"window=\{([^}]*)\}", line) or ["", ""])[1]))
    per = {k: v.split("x") for k, v in window.items()}
    total = 2 * out[out_l.index("b")] * out[out_l.index("f")] * rhs[rhs_l.index("i")]
    for d in sorted(c for c in out_l if c.isdigit()):
        i = int(d)
        get = lambda key, default: int(per[key][i]) if key in per else default  # noqa: E731
        lo = int(per["pad"][i].split("_")[0]) if "pad" in per else 0
        total *= _window_pairs(lhs[lhs_l.index(d)], out[out_l.index(d)], rhs[rhs_l.index(d)], get("stride", 1), lo,
                               get("lhs_dilate", 1), get("rhs_dilate", 1))
    return total


def matmul_flops(hlo: str) -> dict:
    """Matmul FLOPs per step per device, every `dot` and `convolution` as often as it runs (2 x the
    multiply-adds): {"all": ..., "recomputed": the share remat recomputes, read from the ops' metadata
    (jax names a checkpoint's recomputation `rematted_computation`), "unnamed": the share whose ops carry
    no jax op name (libtpu drops it from some fusions it builds), which may be either}. Operand shapes are
    read inline, or from the instructions that define them (names are unique in a module; an operand may
    be printed after its user)."""
    comps = computations(hlo)
    n = runs(comps)
    dims = {k: _dims(v) for k, v in re.findall(r"\n\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([0-9,]*)\]", hlo)}
    out = {"all": 0.0, "recomputed": 0.0, "unnamed": 0.0}
    for name, lines in comps.items():
        if name == "ENTRY" or not n.get(name):
            continue
        for line in lines:
            m = re.search(r"= \w+\[([0-9,]*)\]\S* (dot|convolution)\(([^)]*)\)", line)
            if not m:
                continue
            operands = [_dims(t[t.index("[") + 1:-1]) if t else dims.get(ref, [])
                        for t, ref in re.findall(r"(?:(\w+\[[0-9,]*\])\S* )?%?([\w.\-]+)", m.group(3))]
            flops = (_dot if m.group(2) == "dot" else _convolution)(line, _dims(m.group(1)), operands) * n[name]
            out["all"] += flops
            if "rematted_computation" in line:
                out["recomputed"] += flops
            elif "op_name=" not in line:
                out["unnamed"] += flops
    return out


def custom_calls(hlo: str) -> dict:
    """{custom call target (with the kernel's name where it has one): calls per step}."""
    comps = computations(hlo)
    n = runs(comps)
    out = defaultdict(int)
    for name, lines in comps.items():
        if name == "ENTRY" or not n.get(name):
            continue
        for line in lines:
            m = re.search(r" custom-call\(.*custom_call_target=\"([\w.\-]+)\"", line)
            if m:
                kernel = re.search(r"kernel_name=\\?\"([\w.\-]+)", line)
                out[m.group(1) + (f":{kernel.group(1)}" if kernel else "")] += n[name]
    return dict(out)
