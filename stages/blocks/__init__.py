"""The model's blocks: attention with its KV pool, MLA, Gated DeltaNet, MoE and its expert
graph, RoPE, routing: each block's torch reference and its graph nodes."""
