"""What tests and benchmarks drive tandem with: the pipeline as real processes. Not installed:
nothing in engine/, services/ or shm/ imports it."""
