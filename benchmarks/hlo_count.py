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


def runs(comps: dict) -> dict:
    """{computation: times it runs per run of the entry computation}."""
    calls = defaultdict(list)  # callee -> [(caller, multiplier)]
    for name, lines in comps.items():
        if name == "ENTRY":
            continue
        for line in lines:
            loop = re.search(r" while\(.*condition=%?([\w.\-]+), body=%?([\w.\-]+)", line)
            if loop:
                known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                cond = "\n".join(comps.get(loop.group(1), []))
                trip = int(known.group(1)) if known else max(
                    (int(c) for c in re.findall(r"s32\[\](?:\{[^}]*\})? constant\((\d+)\)", cond)), default=1)
                calls[loop.group(2)].append((name, trip))
                calls[loop.group(1)].append((name, trip + 1))
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


def dot_flops(hlo: str) -> float:
    """Matmul FLOPs per step per device: 2 x the result's elements x the contracted size, for every `dot`
    (its left operand's shape is read inline, or from the instruction that defines it). libtpu writes
    its matmuls as `convolution`s, which this does not count: 0 for a TPU module."""
    comps = computations(hlo)
    n = runs(comps)
    total = 0.0
    for name, lines in comps.items():
        if name == "ENTRY" or not n.get(name):
            continue
        dims = {}
        for line in lines:
            d = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \w+\[([0-9,]*)\]", line)
            if d:
                dims[d.group(1)] = [int(x) for x in d.group(2).split(",") if x]
            m = re.search(r"= \w+\[([0-9,]*)\]\S* dot\((?:\w+\[([0-9,]*)\]\S* )?%?([\w.\-]+)", line)
            if not m:
                continue
            out = math.prod(int(x) for x in m.group(1).split(",") if x)
            lhs = [int(x) for x in m.group(2).split(",") if x] if m.group(2) is not None else dims.get(m.group(3), [])
            contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", line)
            k = math.prod(lhs[int(i)] for i in contract.group(1).split(",") if i) if contract else 1
            total += 2 * out * k * n[name]
    return total


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
