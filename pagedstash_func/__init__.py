"""pagedstash_func: sync-free, capacity-bounded MoE with paged activation stashing.

Only re-exports live here; see README.md and DESIGN for the contract.
"""

from . import kernels
from ._config import StashConfig
from ._interop import from_hf_moe_block, hf_moe_kwargs
from ._moe import capacity_rows, moe, moe_capacity, moe_exact, moe_init, moe_stash_specs
from ._paging import pages_in_use, pop, read_flags, stash, table_view
from ._profile import RoutingProfile
from ._replay import load_step, replay_step, save_step
from ._routing import route
from ._runner import LayerReport, StepReport, StepResult, run_step
from ._transform import LayerInfo, StashAwareStep, stash_aware
from ._state import (
    ConsumedStateError, Pool, PoolLayout, StashSpec, StashState, init_stash_state, pool_pages,
    reset,
)

__version__ = "0.1.0"

__all__ = [
    "ConsumedStateError", "LayerInfo", "LayerReport", "Pool", "PoolLayout", "RoutingProfile",
    "StashAwareStep", "StashConfig", "StashSpec", "StashState", "StepReport", "StepResult",
    "capacity_rows", "from_hf_moe_block", "hf_moe_kwargs", "init_stash_state", "kernels",
    "load_step", "moe", "moe_capacity", "moe_exact", "moe_init", "moe_stash_specs",
    "pages_in_use", "pool_pages", "pop", "read_flags", "replay_step", "reset", "route",
    "run_step",
    "save_step", "stash", "stash_aware", "table_view",
]
