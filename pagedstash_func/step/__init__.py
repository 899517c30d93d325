"""The step: the `stash_aware` transform, the runner (`run_step`: one flag read, one rerun),
CUDA-graph capture, step files and replay, routing profiles."""
