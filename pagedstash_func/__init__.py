"""pagedstash_func: sync-free, capacity-bounded MoE with paged activation stashing.

Only re-exports live here; see README.md for the contract.
"""

from . import kernels
from .core._config import StashConfig
from .core._frame import LayerInfo
from .step._grad import value_and_grad
from .step._graph import GraphedStep, graphed
from .step._compile import CompiledStep, compile
from .interop._blocks import from_hf_moe_block, hf_moe_kwargs
from .interop._lm_loss import lm_loss
from .interop._models import from_hf_model, pad_to_bucket, to_hf_state_dict
from .interop._build import build_bytes, from_hf_config
from .interop._plan import MemoryPlan, plan_memory
from .layer._norm import rms_norm
from .layer._trainable import set_grads, trainable
from .layer._moe import PARAM_NAMES, moe, moe_capacity, moe_exact, moe_init, shared_expert
from .layer._aux import (
    global_counts, load_balancing_loss, switch_loss, update_expert_bias, z_loss,
)
from .core._router import Router, RouterStats, router_stats
from .parallel._expert_parallel import all_reduce_replicated, shard_experts
from .parallel._placement import ExpertShard, HFStateDict, placements
from .parallel._dcp import load_checkpoint, save_checkpoint
from .parallel._zero import ShardedOptimizer, sharded_optimizer
from .parallel._mesh import clip_grad_norm, reduce_gradients
from .parallel._checkpoint import load_sharded, save_sharded
from .stash._paging import (
    StashSlot, pages_in_use, pop, read_flags, reclaim, stash, stash_slot, table_view,
)
from .stash._pools import (
    STASHED, PoolLayout, StashSpec, init_stash_state, moe_stash_specs, pool_pages, reset,
    stashed_names,
)
from .step._profile import RoutingProfile
from .step._replay import load_policy, load_step, replay_step, save_step
from .core._routing import Capacity, capacity_rows, route
from .step._runner import LayerReport, StepReport, StepResult, run_step
from .step._micro import MicroBatchResult, run_micro_batches
from .step._buckets import pad_rows
from .step._ladder import Ladder, LadderMove
from .step._adaptive import AdaptiveState, AdaptiveStep, adaptive
from .stash._state import ConsumedStateError, Pool, StashState, StateMismatchError
from .parallel._symmetric import available_transports, workspace_bytes
from .step._transform import StashAwareStep, stash_aware
from .stash._validate import validate_state

__version__ = "0.1.0"

__all__ = [
    "PARAM_NAMES", "STASHED",
    "Capacity", "ConsumedStateError", "LayerInfo", "LayerReport", "Pool", "PoolLayout",
    "RoutingProfile", "StashAwareStep", "StashConfig", "StashSlot", "StashSpec", "StashState",
    "StateMismatchError", "StepReport", "StepResult",
    "capacity_rows", "from_hf_model", "from_hf_moe_block", "to_hf_state_dict", "hf_moe_kwargs",
    "init_stash_state", "kernels", "lm_loss",
    "load_step", "moe", "moe_capacity", "moe_exact", "moe_init", "moe_stash_specs",
    "pages_in_use", "pool_pages", "pop", "read_flags", "replay_step", "reset", "route",
    "run_step", "save_step", "stash", "stash_aware", "stash_slot", "table_view",
    "ExpertShard", "all_reduce_replicated", "reclaim", "shard_experts", "validate_state",
    "GraphedStep", "available_transports", "graphed", "stashed_names", "value_and_grad",
    "workspace_bytes", "Router", "RouterStats", "router_stats", "shared_expert",
    "global_counts", "load_balancing_loss", "switch_loss", "update_expert_bias", "z_loss",
    "rms_norm", "MicroBatchResult", "run_micro_batches",
    "AdaptiveState", "AdaptiveStep", "Ladder", "LadderMove", "adaptive", "pad_to_bucket",
    "pad_rows",
    "clip_grad_norm", "reduce_gradients", "load_sharded", "save_sharded", "load_policy",
    "set_grads", "trainable", "CompiledStep", "compile",
    "HFStateDict", "placements", "load_checkpoint", "save_checkpoint", "build_bytes",
    "from_hf_config", "ShardedOptimizer", "sharded_optimizer", "MemoryPlan", "plan_memory",
]
