"""GPU kernels (Triton), imported only where CUDA is used; CPU paths never load them."""
