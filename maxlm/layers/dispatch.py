"""MoE dispatch and combine, the one place tokens meet their experts. Each (token, expert) assignment
is sorted by expert, every expert's rows go through one grouped matmul per weight (`dense.grouped`),
and the results are unsorted and summed with the router's weights: FLOPs and memory scale with
experts_per_token, not n_experts.

Under a mesh each device dispatches its own tokens inside shard_map (a sort over a sharded token axis
would make GSPMD gather every token). When the rule table splits `experts` over mesh axes (expert
parallelism), rows travel to the devices that hold their experts and back with all-to-all, and each
device multiplies only its local experts. The experts' `mlp` dimension may be split as well (tensor
parallelism inside the expert: partial outputs are summed). Their `embed` dimension is split like any
FSDP weight's, and its gradient is summed in model.expert_grad_dtype. With float32, the sum one device
computes, GSPMD gathers it at the shard_map's boundary and reduce-scatters the gradient back. With
bfloat16, half the bytes for a rounding of each device's share (docs/moe.md), it is gathered inside in
the compute dtype and its gradient reduce-scattered in bfloat16 by a custom VJP (`gather_embed`).

`layout` is the one place that sizes and places the exchange, on every platform. Where the platform
has `jax.lax.ragged_all_to_all` (TPU and GPU: RAGGED_ALL_TO_ALL) rows are sent packed, exactly the rows
each shard needs, into a static receive buffer of model.ep_slack x the rows a balanced load brings
(`exchange_rows`); a shard that would receive more takes its lower senders' rows first and the rest are
dropped and counted (the layer's `dropped`), never silently; ep_slack 0 sizes it for the worst case.
XLA:CPU has no ragged all-to-all, so there the exchange is a padded all-to-all: every destination gets a
fixed block of rows sized for the worst case (dropless: all of a device's assignments to one shard;
with a capacity factor, the capacity), the unused ones marked by an out-of-range expert id.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxlm.errors import ConfigError
from maxlm.layers import gmm
from maxlm.layers.dense import grouped
from maxlm.sharding import active_spec, device_kind, platform, spec


class Plan(NamedTuple):
    """Where each assignment sits in the expert-sorted row buffer."""
    dest_A: jax.Array          # row of assignment a; `rows` (out of range) when it is not computed
    groups_E: jax.Array        # rows of each expert in the buffer, padded to the block
    block_N: jax.Array | None  # expert of each block (blocked grouped matmul), else None
    rows: int


def rank(g_A, n: int) -> tuple[jax.Array, jax.Array]:
    """Each item's position among the items of its group (in order), and the size of groups 0..n-1.
    g_A == n marks an item in no group."""
    counts = jnp.zeros(n + 1, jnp.int32).at[g_A].add(1)
    order = jnp.argsort(g_A, stable=True)
    first = jnp.cumsum(counts) - counts
    pos = jnp.zeros_like(g_A).at[order].set(jnp.arange(g_A.shape[0], dtype=g_A.dtype) - first[g_A[order]])
    return pos, counts[:n]


def block_size(assignments: int, n_experts: int) -> int | None:
    """Rows per block of the blocked grouped matmul (XLA:CPU), or None for ragged_dot. About a quarter
    of an expert's fair share, so padding costs ~1/8 extra rows on average; at most 128."""
    if platform() != "cpu":
        return None
    fair = max(1, assignments // (4 * n_experts))
    return min(128, 1 << (fair.bit_length() - 1))


def plan(e_A, n_experts: int, block: int | None) -> Plan:
    """Sort assignments (expert e_A; n_experts = not computed) by expert, each expert's rows padded to a
    multiple of `block`. The buffer's size is static: A rows plus the worst-case padding."""
    A, b = e_A.shape[0], block or 1
    pos_A, counts_E = rank(e_A, n_experts)
    groups_E = (counts_E + b - 1) // b * b
    start_E = jnp.cumsum(groups_E) - groups_E
    rows = -(-(A + n_experts * (b - 1)) // b) * b
    dest_A = jnp.where(e_A < n_experts, start_E[jnp.minimum(e_A, n_experts - 1)] + pos_A, rows)
    block_N = None
    if block:
        ends_E = jnp.cumsum(groups_E)
        block_N = jnp.minimum(jnp.searchsorted(ends_E, jnp.arange(rows // b) * b, side="right"), n_experts - 1)
    return Plan(dest_A, groups_E, block_N, rows)


# An expert's weights (`ew`): w_gate, w_up [E, D, F] and w_down [E, F, D], and, in gpt-oss, the biases
# b_gate, b_up [E, F] and b_down [E, D].
WEIGHTS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def expert_mlp(x_RD, pl: Plan, ew: dict, glu, mm=grouped):
    """`mm`: the grouped matmul (`dense.grouped`, or `gmm.tokamax_grouped`)."""
    g_RF = mm(x_RD, ew["w_gate"], pl.groups_E, pl.block_N)
    u_RF = mm(x_RD, ew["w_up"], pl.groups_E, pl.block_N)
    if "b_gate" not in ew:
        return mm(glu(g_RF, u_RF), ew["w_down"], pl.groups_E, pl.block_N)
    E, dt = ew["w_gate"].shape[0], x_RD.dtype
    e_R = jnp.minimum(jnp.searchsorted(jnp.cumsum(pl.groups_E), jnp.arange(pl.rows), side="right"), E - 1)
    h_RF = glu(g_RF + ew["b_gate"][e_R].astype(dt), u_RF + ew["b_up"][e_R].astype(dt))
    return mm(h_RF, ew["w_down"], pl.groups_E, pl.block_N) + ew["b_down"][e_R].astype(dt)


def sorted_mlp(x_AD, e_A, ew: dict, glu, mm=grouped):
    """Each row through its expert e_A (zero where e_A = n_experts): sorted by expert into the grouped
    matmul's buffer, and back."""
    E = ew["w_gate"].shape[0]
    pl = plan(e_A, E, block_size(e_A.shape[0], E))
    x_RD = jnp.zeros((pl.rows, x_AD.shape[1]), x_AD.dtype).at[pl.dest_A].set(x_AD, mode="drop")
    y_RD = expert_mlp(x_RD, pl, ew, glu, mm)
    return y_RD.at[pl.dest_A].get(mode="fill", fill_value=0)


def local(x_TD, e_TK, ew: dict, glu, mm=grouped):
    """Every assignment's expert output [T, K, D] (zero where e_TK = n_experts), experts all local."""
    T, K = e_TK.shape
    y_AD = sorted_mlp(jnp.repeat(x_TD, K, axis=0), e_TK.reshape(T * K), ew, glu, mm)
    return y_AD.reshape(T, K, -1)


# The ragged all-to-all of each platform that has one; the padded exchange runs elsewhere (XLA:CPU has
# none). A module-level table so that tests can put an emulation here for "cpu" and run the ragged path.
RAGGED_ALL_TO_ALL = {"gpu": jax.lax.ragged_all_to_all, "tpu": jax.lax.ragged_all_to_all}


class Layout(NamedTuple):
    """Where one device's assignments travel over n expert shards, in `jax.lax.ragged_all_to_all`'s terms
    ([n] arrays, offsets in rows). Out: my rows for shard r are send[input_offsets[r]:][:send_sizes[r]],
    written at output_offsets[r] of r's receive buffer. Back: the rows shard s sent me are at
    recv_offsets[s] of my receive buffer (recv_sizes[s] of them) and go home to home_offsets[s] of its."""
    slot_A: jax.Array            # row of each assignment in the send buffer; `send_rows` when it is not sent
    dropped_A: jax.Array         # had an expert, found no room in its shard's receive buffer
    input_offsets_S: jax.Array
    send_sizes_S: jax.Array
    output_offsets_S: jax.Array
    recv_sizes_S: jax.Array
    recv_offsets_S: jax.Array
    home_offsets_S: jax.Array
    send_rows: int
    recv_rows: int


def layout(shard_A, count_SR, me, slot: int, recv_rows: int) -> Layout:
    """The exchange of device `me` of n (shard_A: each assignment's destination, n = none; count_SR[s, r]:
    assignments device s has for shard r, from every device). slot > 0: the padded exchange, a `slot`-row
    block per (sender, receiver) pair, receive buffer n * slot. slot = 0: the ragged one, rows packed by
    sender in a `recv_rows` buffer; a receiver that would overflow takes the lower senders' rows first
    and each sender's in order, and the rest are dropped (dropped_A), never silently."""
    n, A = count_SR.shape[0], shard_A.shape[0]
    pos_A, _ = rank(shard_A, n)
    s_S = jnp.arange(n, dtype=jnp.int32)
    if slot:
        start_SR = jnp.broadcast_to(s_S[:, None] * slot, (n, n))  # s's block in r's receive buffer
        in_SR = jnp.broadcast_to(s_S[None, :] * slot, (n, n))     # r's block in s's send buffer
        size_SR, send_rows, recv_rows = jnp.minimum(count_SR, slot), n * slot, n * slot
    else:
        start_SR = jnp.cumsum(count_SR, axis=0) - count_SR
        in_SR = jnp.cumsum(count_SR, axis=1) - count_SR
        size_SR, send_rows = jnp.clip(recv_rows - start_SR, 0, count_SR), A
    # An empty slice's offset is 0: a start at the end of a full buffer is out of range.
    start_SR, in_SR = jnp.where(size_SR > 0, start_SR, 0), jnp.where(size_SR > 0, in_SR, 0)
    to_A = jnp.minimum(shard_A, n - 1)
    sent_A = (shard_A < n) & (pos_A < size_SR[me][to_A])
    return Layout(jnp.where(sent_A, in_SR[me][to_A] + pos_A, send_rows), (shard_A < n) & ~sent_A,
                  in_SR[me], size_SR[me], start_SR[me], size_SR[:, me], start_SR[:, me], in_SR[:, me],
                  send_rows, recv_rows)


def _padded(x, axes, n_shards: int):
    """Row block j of every device goes to device j of the expert axes, and back the same way."""
    y = jax.lax.all_to_all(x.reshape(n_shards, -1, *x.shape[1:]), axes, 0, 0, tiled=True)
    return y.reshape(x.shape)


def _there(x_S, fill, lay: Layout, axes, ragged):
    """The send buffer's rows to their shards' receive buffers (`fill` where nothing arrives)."""
    if ragged is None:
        return _padded(x_S, axes, lay.input_offsets_S.shape[0])
    out = jnp.full((lay.recv_rows, *x_S.shape[1:]), fill, x_S.dtype)
    return ragged(x_S, out, lay.input_offsets_S, lay.send_sizes_S, lay.output_offsets_S, lay.recv_sizes_S,
                  axis_name=axes)


def _back(y_R, lay: Layout, axes, ragged):
    """The receive buffer's rows home, to where they were in their sender's send buffer (zero elsewhere)."""
    if ragged is None:
        return _padded(y_R, axes, lay.input_offsets_S.shape[0])
    out = jnp.zeros((lay.send_rows, *y_R.shape[1:]), y_R.dtype)
    return ragged(y_R, out, lay.recv_offsets_S, lay.recv_sizes_S, lay.home_offsets_S, lay.send_sizes_S,
                  axis_name=axes)


def expert_parallel(x_TD, e_TK, ew: dict, glu, axes, n_shards: int, slot: int, recv_rows: int, ragged=None,
                    mm=grouped):
    """As `local`, with this device's experts only (E_loc = n_experts / n_shards of them, shard s holds
    experts s*E_loc ...): each assignment travels to its expert's shard (`layout`: padded `slot`-row
    blocks when `ragged` is None, else `ragged`, an all-to-all of exactly the rows, into `recv_rows`), the
    shard runs its grouped matmul over what it received, and the outputs travel back. Returns y_TKD
    and dropped_TK, the assignments that found no room (zero in y)."""
    (T, K), E_loc = e_TK.shape, ew["w_gate"].shape[0]
    e_A, D = e_TK.reshape(T * K), x_TD.shape[1]
    shard_A = jnp.where(e_A < E_loc * n_shards, e_A // E_loc, n_shards)
    _, count_S = rank(shard_A, n_shards)
    lay = layout(shard_A, jax.lax.all_gather(count_S, axes), jax.lax.axis_index(axes), slot, recv_rows)
    x_SD = jnp.zeros((lay.send_rows, D), x_TD.dtype).at[lay.slot_A].set(jnp.repeat(x_TD, K, axis=0), mode="drop")
    e_S = jnp.full((lay.send_rows,), E_loc, jnp.int32).at[lay.slot_A].set(e_A % E_loc, mode="drop")
    y_RD = sorted_mlp(_there(x_SD, 0, lay, axes, ragged), _there(e_S, E_loc, lay, axes, ragged), ew, glu, mm)
    y_SD = _back(y_RD, lay, axes, ragged)
    return y_SD.at[lay.slot_A].get(mode="fill", fill_value=0).reshape(T, K, D), lay.dropped_A.reshape(T, K)


def _axes(spec_entry) -> tuple:
    return () if spec_entry is None else (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def exchange_rows(B: int, L: int, K: int, E_loc: int, n_shards: int, capacity: int, slack: float) -> tuple[int, int]:
    """(slot, recv_rows) of a device's exchange for B x L tokens: the padded exchange's block per
    destination, sized for the worst case, and the ragged exchange's receive buffer, `slack` x the
    B*L*K rows a balanced load brings (0, or more than the worst case: the worst case, n_shards x slot)."""
    # Dropless, one shard may receive all of a token's assignments to its experts (at most min(K, E_loc):
    # a token picks an expert once); with a capacity, at most `capacity` per sequence for each of them.
    slot = B * L * min(K, E_loc)
    if capacity:
        slot = min(slot, B * capacity * E_loc)
    worst = n_shards * slot
    return slot, min(worst, math.ceil(B * L * K * slack)) if slack else worst


# The dimension of each expert weight that the `embed` rule splits (FSDP), gathered inside the layer.
EMBED_DIM = {"w_gate": 1, "w_up": 1, "w_down": 2}


def gather_embed(w, dim: int, axes: tuple, dt, grad_dt):
    """This device's slice of a weight split over mesh `axes` on `dim`, whole and cast to dt (the compute
    dtype): cast, then gathered, so the gather moves dt's bytes, not the float32 master's. Its gradient is
    summed over `axes` and scattered back in grad_dt, then returned in w's dtype. No axes: a cast."""
    if not axes:
        return w.astype(dt)

    @jax.custom_vjp
    def gather(w):
        return jax.lax.all_gather(w.astype(dt), axes, axis=dim, tiled=True)

    def scatter(_, ct):
        return (jax.lax.psum_scatter(ct.astype(grad_dt), axes, scatter_dimension=dim, tiled=True).astype(w.dtype),)

    gather.defvjp(lambda w: (gather(w), None), scatter)
    return gather(w)


def experts(x_BLD, e_BLK, w_BLK, ew: dict, glu, capacity: int = 0, slack: float = 0.0, grad_dtype="float32",
            gemm: str = "auto"):
    """(y_BLD, dropped_BL): y = sum_k w_BLK * expert_{e_BLK}(x_BLD); e_BLK = n_experts marks an assignment
    not computed (dropped, or a padding token's). `ew` holds the experts' weights (WEIGHTS), `glu(gate,
    up)` their gated unit. `capacity` (> 0) is the most assignments one expert takes from one sequence,
    which bounds the exchange; `slack` sizes the ragged exchange's receive buffer (`exchange_rows`).
    `grad_dtype` is the dtype the weights' gradients are summed in over the mesh axes that split their
    `embed` dimension (model.expert_grad_dtype; `gather_embed`). `gemm` chooses the grouped matmul
    (model.grouped_gemm; `gmm.resolve`).
    dropped_BL counts each token's assignments that found no room there (the ragged exchange only)."""
    mesh = jax.sharding.get_abstract_mesh()
    mm = gmm.tokamax_grouped if gmm.resolve(gemm, platform(), device_kind()) == "tokamax" else grouped
    ep, mlp, n_ep, emb = (), (), 1, {}  # no mesh (a notebook, one device): all experts here
    if not mesh.empty:
        tok = active_spec(("batch", "length", None))
        # A float32 sum is what GSPMD does at the layer's boundary, reduce-scattering each weight's gradient
        # as the backward produces it. Gathered inside, the three weights' float32 gradients were held at
        # once (gpt-oss-20b, 12 layers, 8 x H100: 4.9 GiB more temporaries), so only bfloat16 comes inside.
        emb_rule = "embed" if grad_dtype != "float32" else None
        w_in, w_out = active_spec(("experts", emb_rule, "mlp")), active_spec(("experts", "mlp", emb_rule))
        ep, mlp = _axes(w_in[0]), _axes(w_in[2])
        emb = {k: tuple(a for a in _axes((w_out if k == "w_down" else w_in)[d]) if mesh.shape[a] > 1)
               for k, d in EMBED_DIM.items()}
        n_ep = math.prod(mesh.shape[a] for a in ep)
        if n_ep > 1 and not set(ep) <= set(_axes(tok[0]) + _axes(tok[1])):
            raise ConfigError(f"expert parallelism needs the tokens split over the experts' mesh axes {ep}; add them "
                              f"to the `batch` rule in sharding_rules")

    def per_shard(x_BLD, e_BLK, w_BLK, ew):
        B, L, D = x_BLD.shape
        ew = {k: gather_embed(w, EMBED_DIM[k], emb.get(k, ()), x_BLD.dtype, grad_dtype) if k in EMBED_DIM else w
              for k, w in ew.items()}
        K, E_loc = e_BLK.shape[-1], ew["w_gate"].shape[0]
        if mlp and "b_down" in ew:  # the output bias once, not once per slice of the hidden units
            ew = {**ew, "b_down": jnp.where(jax.lax.axis_index(mlp) == 0, ew["b_down"], 0)}
        x_TD, e_TK = x_BLD.reshape(B * L, D), e_BLK.reshape(B * L, K)
        if n_ep > 1:
            ragged = RAGGED_ALL_TO_ALL.get(platform())
            slot, recv = exchange_rows(B, L, K, E_loc, n_ep, capacity, slack)
            y_TKD, dropped_TK = expert_parallel(x_TD, e_TK, ew, glu, ep, n_ep, 0 if ragged else slot, recv, ragged, mm)
        else:
            y_TKD, dropped_TK = local(x_TD, e_TK, ew, glu, mm), jnp.zeros(e_TK.shape, bool)
        y_TD = jnp.einsum("tkd,tk->td", y_TKD, w_BLK.reshape(B * L, K).astype(x_TD.dtype))
        if mlp:  # each shard holds a slice of every expert's hidden units: partial sums
            y_TD = jax.lax.psum(y_TD, mlp)
        return y_TD.reshape(B, L, D), jnp.sum(dropped_TK, axis=1, dtype=jnp.int32).reshape(B, L)

    if mesh.empty:
        return per_shard(x_BLD, e_BLK, w_BLK, ew)
    route = P(tok[0], tok[1], None)
    specs = {"w_gate": w_in, "w_up": w_in, "w_down": w_out, "b_gate": P(w_in[0], w_in[2]), "b_up": P(w_in[0], w_in[2]),
             "b_down": P(w_out[0], None)}
    # check_vma off: inside the pipeline's vmap over `stage` (spmd_axis_name), shard_map's batching infers
    # the outputs as varying over `stage` while its out_specs do not name it, and refuses. The values are
    # right (tests/test_stages.py: MoE through the stages equals one device).
    return jax.shard_map(per_shard, in_specs=(tok, route, route, {k: specs[k] for k in ew}),
                         out_specs=(tok, P(tok[0], tok[1])), check_vma=False)(x_BLD, e_BLK, w_BLK, ew)


def capacity_keep(e_BLK, valid_BL, n_experts: int, capacity: int) -> jax.Array:
    """Which assignments an expert with room for `capacity` per sequence takes: first come first served
    in order of the top-k slot, then position (a token's first choice outranks any second choice).
    Padding tokens take no room and are not kept."""
    B, L, K = e_BLK.shape
    e_BS = jnp.swapaxes(e_BLK, 1, 2).reshape(B, K * L)  # slot-major
    v_BS = jnp.broadcast_to(valid_BL[:, None, :], (B, K, L)).reshape(B, K * L)
    pos_BS = jax.vmap(lambda g: rank(g, n_experts)[0])(jnp.where(v_BS, e_BS, n_experts))
    return (v_BS & (pos_BS < capacity)).reshape(B, K, L).swapaxes(1, 2)


def expert_shards(mesh, rule_table) -> int:
    """How many ways the rule table splits the experts on this mesh."""
    return math.prod(mesh.shape[a] for a in _axes(spec(("experts",), rule_table)[0]))


# Measured (benchmarks/RESULTS.md, 2026-11-27): for h100 jax 0.11.2's XLA lowers lax.ragged_dot to a product
# masked per expert, whose temporaries are rows x n_experts x d_in: 112 GiB for 32768 rows x 256 experts x 7168.
GPU_RAGGED_DOT = ("on GPU, XLA lowers the grouped matmul (lax.ragged_dot) to a product masked per expert: every row "
                  "meets every local expert's weights, n_experts times the FLOPs, with temporaries of rows x n_experts "
                  "x d_model; MoE layers with many local experts need expert parallelism (mesh.expert), or on Hopper "
                  "tokamax's grouped kernel (model.grouped_gemm=tokamax; docs/moe.md)")


def describe(where: str, n_shards: int, slack: float, kernel: str = "xla") -> str:
    """The dispatch a run compiles, for the log: the grouped matmul picked for `where` (`kernel`, the
    resolved model.grouped_gemm), the exchange, and the ragged exchange's receive buffer (model.ep_slack)."""
    mm = ("tokamax's Mosaic GPU kernel (model.grouped_gemm=tokamax, its built-in tiles)" if kernel == "tokamax" else
          "a blocked batched matmul (XLA:CPU lowers ragged_dot densely)" if where == "cpu" else "ragged_dot")
    ep = ""
    if n_shards > 1 and where not in RAGGED_ALL_TO_ALL:
        ep = (f"; experts split {n_shards} ways, rows exchanged by a padded all-to-all sized for the worst case "
              f"({where} has no ragged all-to-all; model.ep_slack does not apply)")
    elif n_shards > 1:
        room = ("the worst case, never dropping" if slack == 0 else
                f"{slack} x a balanced load's rows (model.ep_slack), overflow dropped and "
                f"counted in moe_dropped")
        ep = f"; experts split {n_shards} ways, rows exchanged by a ragged all-to-all, each receive buffer {room}"
    return f"moe: tokens sorted by expert, grouped matmul by {mm}{ep}"
