"""maxlm's own Pallas kernels: causal flash attention for GPU (flash_gpu, Triton) and TPU (flash_tpu,
Mosaic). Both take the model's [B, L, H, D] layout and `reference_attention`'s semantics; the model
reaches them through `maxlm.layers.attention.attend_fn`."""
