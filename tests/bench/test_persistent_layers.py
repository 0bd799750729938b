"""bench/persistent_layers.py's persistent kernel against the chain of launches it is timed
beside, on the CPU in Triton's interpreter (one program, so its barriers pass at once; CI has no
GPU). Its configs' text is parsed as the benchmark takes it."""

from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted

from bench.persistent_layers import DEFAULT_CONFIGS, LLAMA3_8B, Config
from bench.persistent_layers_cuda import CudaConfig


def test_the_persistent_kernel_equals_the_launched_chain_in_the_interpreter() -> None:
    out = run_interpreted("from bench.persistent_layers import check_small; check_small()")
    assert "relative error" in out


def test_default_configs_split_every_product_into_whole_tiles() -> None:
    s = LLAMA3_8B
    outputs = {"qkv": s.qkv, "o": s.dim, "gu": 2 * s.ffn, "down": s.dim}
    inputs = {"qkv": s.dim, "o": s.dim, "gu": s.dim, "down": s.ffn}
    for text in DEFAULT_CONFIGS:
        if text.startswith("cuda"):
            assert str(CudaConfig.parse(text)) == text
            continue
        config = Config.parse(text)
        assert str(config) == text
        for name, (rows, width) in config.tiles.items():
            assert outputs[name] % rows == 0 and inputs[name] % width == 0, (text, name)


def test_a_config_names_all_four_products() -> None:
    with pytest.raises(AssertionError, match="qkv, o, gu, down"):
        Config.parse("512 4 qkv=4,512 o=8,512")


def test_a_config_carries_its_stages_and_register_cap() -> None:
    text = "660 4 qkv=4,512 o=4,512 gu=4,512 down=4,512 stages=4 regs=96 late"
    config = Config.parse(text)
    assert (config.stages, config.regs, config.ahead) == (4, 96, False)
    assert str(config) == text


def test_a_cuda_config_reads_threads_blocks_and_units_ahead() -> None:
    from bench.persistent_layers import Layers, Shapes
    from bench.persistent_layers_cuda import source

    assert CudaConfig.parse("cuda 256 2") == CudaConfig(256, 2)
    assert CudaConfig.parse("cuda 512 1 skip=1 ahead=2") == CudaConfig(512, 1, ahead=2, skip=1)
    assert str(CudaConfig.parse("cuda 512 1 nap=64 ahead=2")) == "cuda 512 1 ahead=2 nap=64"
    with pytest.raises(AssertionError, match="ahead, deep, nap, flag, skip"):
        CudaConfig.parse("cuda 256 2 stages=2")
    layers = Layers(Shapes(64, 96, 128), 2, torch.device("cpu"))
    text = source(layers, CudaConfig(256, 2, ahead=2))
    assert "#define AHEAD 2\n" in text and "#define FFN 128\n" in text
