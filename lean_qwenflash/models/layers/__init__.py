"""The building blocks families compose, one concept per module:

- ``linear``: Linear, Embedding (block-quantized weights, native one-row products);
- ``norm``: RMSNorm, GatedRMSNorm;
- ``rope``: RopeConfig (a config's typed rope settings), Rotary tables, apply_rotary;
- ``attention``: causal GQA attention over a KV cache and the variants families pick
  (sliding window, sinks, output gates, whole-projection q/k norms);
- ``latent_attention``: DeepSeek's multi-head latent attention;
- ``deltanet``: the gated delta rule and Gated DeltaNet;
- ``mlp``: the SwiGLU feed-forward.

Routers, the sparse block and expert math are in ``lean_qwenflash.models.moe``.

Families only declare modules (with Hugging Face attribute names, so ``state_dict()`` keys equal the
checkpoint's); the math lives here. Every layer takes an optional per-layer state object (see
``lean_qwenflash.generate.state``) and works on any device: layers only use duck-typed state
attributes so that this package never imports the generation package.

Shapes: B batch, T new tokens, L tokens in the cache, H hidden, E experts, I expert intermediate.
"""
