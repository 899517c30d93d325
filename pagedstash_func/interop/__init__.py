"""Interop with `transformers` (an optional dependency): weights of its MoE blocks, and whole
causal LMs whose sparse blocks `psf.moe` computes (`from_hf_model`, `to_hf_state_dict`)."""
