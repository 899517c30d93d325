"""Running code with every device-to-host sync an error (CUDA's sync debug mode)."""

import torch


def without_sync(fn, *args):
    """``fn(*args)`` with any device-to-host sync an error; the mode restored after."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
