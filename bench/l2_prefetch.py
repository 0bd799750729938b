"""The launched chain of int8 batch-1 products (bench/persistent_layers.py's, LLaMA-3-8B shapes,
attention left out) with each product asking L2 for the next product's first bytes while it
streams its own (engine/kernels/l2_prefetch.py), against the same chain without: whether the
memory kept busy across each dependency takes a layer nearer its bytes' floor.

    python -m bench.l2_prefetch [--layers 16] [--megabytes 0,4,8,16,24] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from bench.cli import first_paragraph, json_option
from bench.persistent_layers import LLAMA3_8B, Layers, relative_error, time_chains


def main() -> None:
    from bench.gpu_measure import copy_bandwidth

    parser = argparse.ArgumentParser(description=first_paragraph(__doc__))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument(
        "--megabytes", default="0,4,8,16,24", help="prefetch sizes to try, MB of the next product"
    )
    parser.add_argument("--rounds", type=int, default=2)
    json_option(parser, "l2_prefetch.json")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    floor = LLAMA3_8B.layer_bytes() / bandwidth
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s; a layer's "
          f"{LLAMA3_8B.layer_bytes() / 1e6:.0f} MB take {floor * 1e6:.1f} µs")  # fmt: skip
    layers = Layers(LLAMA3_8B, args.layers, torch.device("cuda"))
    expected = layers.launched()
    candidates = []
    for mb in (int(m) for m in args.megabytes.split(",")):
        run = functools.partial(layers.launched, prefetch=mb << 20)
        error = relative_error(run(), expected)
        assert error == 0.0, f"prefetching {mb} MB changed the result by {error:.1e}"
        candidates.append((f"launched, prefetch {mb} MB" if mb else "launched", run))
    rows = time_chains(candidates, args.layers, floor, args.rounds)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(), copy_bandwidth=bandwidth, rows=rows,
                  layers=args.layers, floor_seconds=floor)  # fmt: skip
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
