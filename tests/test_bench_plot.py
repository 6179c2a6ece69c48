"""The benchmarks' plots draw the run's rows: an attention run of one head dim other than 128 too."""

import pytest

from portable_ops.bench.__main__ import plot

plt = pytest.importorskip("matplotlib.pyplot")


def _rows(d):
    return [{"variant": variant, "dir": direction, "D": d, "S": s, "Hkv": hkv, "causal": causal,
             "TFLOP/s": 1.0, "steady TFLOP/s": 2.0 * s}
            for variant in ("portable_ops", "sdpa cudnn") for direction in ("fwd", "bwd")
            for s in (1024, 2048) for hkv in (4, 16) for causal in (False, True)]


@pytest.mark.parametrize("dims,drawn", [((64,), 64), ((64, 128, 256), 128)])
def test_attention_plot_draws_one_head_dims_steady_curves(tmp_path, dims, drawn):
    plot("attention", [r for d in dims for r in _rows(d)], tmp_path / "attention.png")
    ax = plt.gcf().axes[0]
    plt.close("all")
    assert (tmp_path / "attention.png").stat().st_size > 0
    assert len(ax.lines) == 4  # two variants, two directions
    assert all(list(line.get_ydata()) == [2048.0, 4096.0] for line in ax.lines)  # steady TFLOP/s
    assert f"D={drawn}, non-causal, 16 KV heads" in ax.get_xlabel()


def test_attention_plot_takes_the_kv_heads_of_its_head_dim(tmp_path):
    rows = [r for r in _rows(128) if r["Hkv"] == 4] + _rows(64)
    plot("attention", rows, tmp_path / "attention.png")
    ax = plt.gcf().axes[0]
    plt.close("all")
    assert len(ax.lines) == 4 and "D=128, non-causal, 4 KV heads" in ax.get_xlabel()
    with pytest.raises(ValueError, match="no attention rows"):
        plot("attention", [], tmp_path / "empty.png")
