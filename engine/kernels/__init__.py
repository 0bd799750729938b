"""GPU kernels (Triton), imported only where CUDA is used; CPU paths never load them."""

import os

# Our kernels were tuned and checked with Triton fusing multiplies and adds (its default up to
# 3.9). Triton 3.10 turns that off unless this says otherwise: keep it, and keep its warning
# about the change out of every process that compiles them.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
