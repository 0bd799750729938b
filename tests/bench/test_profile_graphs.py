"""bench/profile_graphs.py charges each kernel of a one-row step from the end of the one before."""

from __future__ import annotations

from bench.profile_graphs import charged_by_layer, medians


def layer(t: float, attention_gap: float = 0.0) -> list[tuple[str, float, float]]:
    """One layer's five kernels from time t, each starting 2 µs before the previous one ends
    (programmatic dependent launch), but attention after a gap when one is given."""
    return [
        ("_row_gemv_qkv", t, t + 12),
        ("_rope_attention", t + 10 + attention_gap, t + 18 + attention_gap),
        ("_row_gemv_o", t + 16 + attention_gap, t + 27 + attention_gap),
        ("_row_gemv_tc", t + 25 + attention_gap, t + 78 + attention_gap),
        ("_row_gemv_down", t + 76 + attention_gap, t + 106 + attention_gap),
    ]


def test_each_kernel_is_charged_what_it_adds_after_the_one_before() -> None:
    spans = [("embedding", -5.0, 0.0), *layer(0.0), *layer(106.0), ("head", 212.0, 230.0)]
    got = charged_by_layer(spans)
    assert medians(got["charged"]) == {
        "QKV": 12.0, "attention": 6.0, "O": 9.0, "gate/up": 51.0, "down": 28.0,
    }  # fmt: skip
    assert medians(got["span"]) == {
        "QKV": 12.0, "attention": 8.0, "O": 11.0, "gate/up": 53.0, "down": 30.0,
    }  # fmt: skip
    assert len(got["charged"]["QKV"]) == 2


def test_a_gap_before_a_kernel_is_not_charged_to_it() -> None:
    spans = [("embedding", -5.0, 0.0), *layer(0.0, attention_gap=5.0), ("head", 120, 130)]
    got = charged_by_layer(spans)
    assert got["charged"]["attention"] == [8.0]  # the idle 3 µs before it is nobody's
    assert got["charged"]["O"] == [9.0]


def test_layers_cut_off_at_either_end_are_skipped() -> None:
    whole = layer(0.0)
    assert charged_by_layer(whole)["charged"]["QKV"] == []  # no kernel before QKV
    assert charged_by_layer([("x", -5.0, 0.0), *whole[:4]])["charged"]["down"] == []
