"""The model as a train step runs it: the family's forward with the run's attention kernel, remat policy
and output-layer loss, built once (maxlm.recipe). What every objective starts from is `token_losses`:
each position's next-token cross-entropy, with the model's auxiliary loss and statistics."""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from maxlm.layers import attention, loss, ring
from maxlm.models import decoder


class Scored(NamedTuple):
    tok_BL: jax.Array  # next-token cross-entropy of every position, zero where `loss_mask` is 0 (padding)
    aux: jax.Array     # the model's auxiliary loss (MoE load balancing; 0 for dense models)
    moe: Any           # its MoE expert load and drops (decoder.Hidden.moe), or None
    ahead_NBL: Any     # a model that predicts further ahead (multi-token prediction): each module's
                       # cross-entropy against the target k + 1 positions on, or None
    routes: Any = None  # token_losses(routes=True) of an MoE model: [B, L, MoE layers] uint32, the experts
                        # each position's input token chose (decoder.Hidden.routes), which decide target
                        # j's loss at position j; else None


class Forward(NamedTuple):
    family: Any            # the family's module (maxlm.models.get)
    m: Any                 # the model's config section
    dtype: Any             # activations and matmuls
    attention: str         # the kernel choice, resolved against the mesh being traced (layers.attention)
    wrap_block: Callable   # remat over the layer function (maxlm.remat)
    chunked_loss: bool     # the cross-entropy in chunks (layers.loss), never holding [B, L, V]

    def token_losses(self, params, batch: dict, stack=None, temperature: float = 1.0, routes: bool = False) -> Scored:
        """With the sequence split over devices (mesh.context), the model runs on the ring's zig-zag
        layout (layers.ring) and the losses come back in the batch's order. `stack`: the schedule's
        (maxlm.schedules), or None. `temperature`: the cross-entropy of softmax(logits / temperature), the
        distribution a sampler at that temperature draws from. `routes` (static): also Scored.routes, for
        comparing with the decoder's (generate.decode(return_routes=True)); outside a train step only."""
        m = self.m
        if routes and stack is not None:
            raise ValueError("token_losses(routes=True) runs the plain layer scan only (stack=None): a schedule "
                             "sums the layers' statistics over microbatches")
        routes = routes and bool(m.n_experts)  # a dense family takes no `routes`
        _, ring_size = attention.context_axis()
        if ring_size > 1:
            batch = {k: ring.to_zigzag(x_BL, ring_size) for k, x_BL in batch.items()}
        out = self.family.forward(params, batch["inputs"], batch["positions"], batch["segment_ids"], m, self.dtype,
                                  self.wrap_block, attend=attention.attend_fn(self.attention, m, self.dtype.name),
                                  stack=stack, **({"routes": True} if routes else {}))
        ce = loss.cross_entropy if self.chunked_loss else loss.reference
        head = decoder.head(params, m)
        tok_BL = ce(out.x_BLD, head, batch["targets"], batch["loss_mask"], softcap=m.final_softcap,
                    temperature=temperature)
        ahead_NBL = None
        if out.ahead is not None:
            ahead_NBL = jnp.stack([ce(x_BLD, head, *loss.ahead(batch, k + 1), softcap=m.final_softcap)
                                   for k, x_BLD in enumerate(out.ahead)])
        routes_BLM = out.routes
        if ring_size > 1:
            tok_BL = ring.from_zigzag(tok_BL, ring_size)  # (config refuses multi-token prediction with a ring)
            routes_BLM = None if routes_BLM is None else ring.from_zigzag(routes_BLM, ring_size)
        return Scored(tok_BL, out.aux_loss, out.moe, ahead_NBL, routes_BLM)

    @staticmethod
    def metrics(aux, moe) -> dict:
        """The model's own metrics: an MoE model's auxiliary loss, expert load and dropped assignments."""
        if moe is None:
            return {}
        return {"moe_aux_loss": aux, "moe_load": moe["load"], "moe_dropped": jnp.sum(moe["dropped"])}
