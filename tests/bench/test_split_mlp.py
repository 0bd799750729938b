"""bench/split_mlp.py's MLP in one kernel (down split by features, atomic adds) against the
launched chain it is timed beside, on the CPU in Triton's interpreter (CI has no GPU), and its
configs' text as the benchmark takes it."""

from __future__ import annotations

import pytest
from interpreted import run_interpreted

from bench.persistent_layers import LLAMA3_8B
from bench.split_mlp import DEFAULT_CONFIGS, SplitConfig


def test_the_split_mlp_chain_equals_the_launched_chain_in_the_interpreter() -> None:
    out = run_interpreted("from bench.split_mlp import check_small; check_small()")
    assert out.count("relative error") == 2


def test_default_configs_read_back_and_fit_the_8b_shapes() -> None:
    for text in DEFAULT_CONFIGS:
        config = SplitConfig.parse(text)
        assert str(config) == text
        config.check(LLAMA3_8B)


def test_a_config_whose_features_do_not_divide_the_mlp_is_refused() -> None:
    with pytest.raises(AssertionError, match="F=48 must divide 14336"):
        SplitConfig.parse("48 gu=16,1024 down=64 4").check(LLAMA3_8B)
    with pytest.raises(AssertionError, match="F gu=R,C down=R warps"):
        SplitConfig.parse("32 down=64 gu=16,1024 4")
