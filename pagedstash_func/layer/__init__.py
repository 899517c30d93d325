"""The MoE layer: `psf.moe` (exact, capacity and stash paths, chosen from the frame) and the
validation of its arguments."""
