"""Expert parallelism: the exchange plan across ranks, its transports (fixed slots over
``all_to_all_single``, NVSHMEM symmetric memory), sharding and replicated-gradient reduction."""
