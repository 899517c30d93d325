"""The stash: the state pytree (pools, free lists, page tables, flags), pool sizing, paging
(stash, pop, reclaim) and validation of a state. `_state.StashState` holds the page tables."""
