"""Loading a model from a GGUF file or a Hugging Face safetensors folder, with a progress bar."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from engine import cpu_kernels
from engine.codes_linear import gather_codes
from engine.config import ModelConfig
from engine.cpu_linear import pack_linears, packing_supported
from engine.errors import InvalidRequest, ModelNotFound
from engine.gguf_file import open_gguf
from engine.gguf_weights import GGUFWeights
from engine.hf_weights import SafetensorsWeights, read_config
from engine.model import Transformer
from engine.parallel_layers import parallelize
from engine.quant import Fp8Linear, Int8Linear, Q4Blocks, int4_supported
from engine.random_weights import RandomWeights
from engine.registry import SEED_KEY
from engine.shard import ShardedSource, ShardPlan
from engine.tensor_parallel import SINGLE, TensorParallel
from engine.weights import build_model

QUANTIZE_MODES = ("auto", "int4", "none", "int8", "fp8")
Reader = GGUFWeights | SafetensorsWeights | RandomWeights


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    weight_format: str  # the file's, e.g. "gguf:Q4_1" or "safetensors"
    # How the projections are served: "native-codes" (the GGUF's codes, native CPU kernel),
    # "int4" (torch's int4 kernel), "int8", or a dtype's name; "packed-" for oneDNN's layout.
    linear_format: str
    tp: TensorParallel = SINGLE  # the group whose slice this is (model.config: the slice's shape)


class _Source:
    """A reader seen through the load: dtype conversion, the progress bar, and 4-bit policy."""

    def __init__(
        self, reader: Reader, dtype: torch.dtype, bar: tqdm, keep_q4: bool, native: bool
    ) -> None:
        self.reader, self.dtype, self.bar, self.keep_q4 = reader, dtype, bar, keep_q4
        self.native_codes = native  # kept codes served by the native kernel, else torch's int4
        self.kept_q4 = 0
        self.counted: set[str] = set()  # a tied embedding is read twice, but counted once

    def has(self, name: str) -> bool:
        return self.reader.has(name)

    def _progress(self, name: str, numel: int) -> None:
        if name not in self.counted:
            self.counted.add(name)
            self.bar.update(numel * 4)

    def get(self, name: str) -> torch.Tensor:
        tensor = self.reader.get(name)
        self._progress(name, tensor.numel())
        return tensor.to(self.dtype)

    def get_int4(self, name: str) -> list[Q4Blocks] | None:
        if not self.keep_q4 or not isinstance(self.reader, GGUFWeights):
            return None
        parts = self.reader.get_int4(name)
        if parts is not None:
            self.kept_q4 += 1
            self._progress(name, parts[0].codes.numel())
        return parts


def load_model(
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
    quantize: str = "auto",
    tp: TensorParallel = SINGLE,
) -> LoadedModel:
    """quantize: "auto" is the fastest measured choice for the device: on CPU a GGUF's
    Q4_0/Q4_1/Q8_0 projections stay quantized, served by the native kernel where it is built
    (else as "int4"), and float projections are packed in `dtype`; elsewhere as "none". "int4"
    (CPU) serves the kept codes through torch's int4 kernel (bf16 activations: closer to fp32,
    slower) for steps of few rows, beside a bf16 copy in oneDNN's packed layout for larger ones.
    "none" dequantizes everything to `dtype` as plain `nn.Linear`s; "int8" serves every
    projection as weight-only int8 with per-channel scales, "fp8" as e4m3 with per-channel
    scales (FP8 GEMMs with per-token activation scales beyond a few rows). With `tp` sharded,
    this rank's slice of every weight (engine/shard.py), wrapped in the collectives
    (engine/parallel_layers.py); LoadedModel.config stays the whole model's, the model's own
    config is the rank's."""
    if quantize not in QUANTIZE_MODES:
        raise InvalidRequest("quantize", f"unknown mode {quantize!r}; choose {QUANTIZE_MODES}")
    if quantize == "fp8" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise InvalidRequest(
                "quantize",
                f"fp8 needs a GPU of compute capability 8.9 or newer; this one is {major}.{minor}",
            )
    if path.is_dir():
        raw = read_config(path)
        config = ModelConfig.from_hf(raw)
        reader: Reader
        if SEED_KEY in raw:
            reader = RandomWeights(config, int(raw[SEED_KEY]), device, dtype)
            file_format = "random"
        else:
            reader = SafetensorsWeights(path)
            file_format = "safetensors"
        rope_factors = None
    elif path.is_file():
        gguf = open_gguf(path)
        config = ModelConfig.from_gguf(gguf.metadata)
        reader = GGUFWeights(gguf, config.n_heads, config.n_kv_heads)
        config = replace(config, tie_embeddings=not reader.has("lm_head.weight"))
        first = "model.layers.0.self_attn.q_proj.weight"
        file_format = f"gguf:{reader.quant_type(first) if reader.has(first) else ''}"
        rope_factors = reader.rope_freq_factors()
    else:
        raise ModelNotFound(f"no such model file or folder: {path}")
    keep_q4 = quantize in ("auto", "int4") and int4_supported(device)
    native = keep_q4 and quantize == "auto" and cpu_kernels.load()
    # Progress counts float32-equivalent bytes, so 4-bit and float weights weigh alike.
    with tqdm(
        total=_total_numel(reader) * 4,
        unit="B",
        unit_scale=True,
        desc=f"load {path.name}",
        disable=not progress,
        file=sys.stderr,
        leave=False,
    ) as bar:
        source = _Source(reader, dtype, bar, keep_q4, native)
        # int8/fp8 as each projection is built: the float model is never whole in memory.
        linear = {"int8": Int8Linear, "fp8": Fp8Linear}.get(quantize)
        # The output head stays in `dtype`, as vLLM's: its logits are what sampling reads, and
        # e4m3's 3 mantissa bits there cost the default model the most (bench/RESULTS-gpu.md).
        head = quantize != "fp8"
        if tp.sharded:
            plan = ShardPlan.for_model(config, tp.rank, tp.world_size)
            sharded = ShardedSource(source, plan)
            model = build_model(
                plan.local_config(config), sharded, device, rope_factors, linear, head
            )
            parallelize(model, tp, plan.vocab[0], config.vocab_size)
        else:
            model = build_model(config, source, device, rope_factors, linear, head)
    kept = "native-codes" if native else "int4"
    if source.kept_q4 and native:
        gather_codes(model)
    linear_format = kept if source.kept_q4 else str(dtype).removeprefix("torch.")
    if quantize in ("int8", "fp8"):
        linear_format = quantize
    elif quantize in ("auto", "int4") and device.type == "cpu":
        # Projections that stayed float (all of them, for float files): packed once.
        packed_dtype = torch.bfloat16 if file_format.startswith("gguf:Q") else dtype
        if packing_supported(packed_dtype) and pack_linears(model, packed_dtype):
            packed = "packed-" + str(packed_dtype).removeprefix("torch.")
            linear_format = f"{kept}+{packed}" if source.kept_q4 else packed
    return LoadedModel(model, config, file_format, linear_format, tp)


def _total_numel(reader: Reader) -> int:
    if isinstance(reader, GGUFWeights):
        return sum(int(t.n_elements) for t in reader.by_name.values())
    if isinstance(reader, RandomWeights):
        return sum(torch.Size(reader.shape(n)).numel() for n in reader.names())
    return sum(reader.numel(n) for n in reader.location)
