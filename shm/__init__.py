"""POSIX shared memory for tensors between processes: segments, arenas, handles, rings."""
