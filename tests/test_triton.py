"""Triton-specific paths the shared suite reaches only through its shapes (interpreter on CPU)."""

import importlib

import pytest
import torch

import portable_ops
from portable_ops import dispatch

pytestmark = pytest.mark.skipif(dispatch.unavailable_reason("triton") is not None, reason="triton not installed")


def test_decode_splits_keys_across_programs_and_merges_exactly():
    from portable_ops.backends.triton.attention_configs import key_splits, tile_config

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 64, generator=g).to(device)
    k, v = (torch.randn(1, 1, 1100, 64, generator=g).to(device) for _ in range(2))
    # decode shapes are never timed
    block_m, block_n = tile_config("fwd", q, q.shape[2], k.shape[2], k.shape[1], False, "ieee", launch=None)[:2]
    assert key_splits(1, 2, 1, 1100, block_m, block_n) > 1  # the conformance case takes the split path
    assert key_splits(1, 2, block_m + 1, 1100, block_m, block_n) == 1  # prefill does not
    for causal in (False, True):
        with portable_ops.use_backend("triton"):
            out = portable_ops.attention(q, k, v, causal=causal)
        with portable_ops.use_backend("reference"):
            ref = portable_ops.attention(q, k, v, causal=causal)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_decode_split_policy_on_an_h100_sized_gpu(monkeypatch):
    """The split counts and tiles the H100 sweep chose (docs/performance.md, "Decode"), with the SM
    count of an H100 (132) standing in for the device's: programs x ranges fill one wave, ranges of
    at least two key blocks, never more than MAX_SPLITS (the merge holds [splits, D] float32 per
    row in registers), an empty batch not split at all; 128-key tiles only on sm_90 and only where
    the programs would take the narrow tiles more than one wave (three an SM), and only for 2-byte
    heads of one column chunk, 97 to 128 wide."""
    configs = importlib.import_module("portable_ops.backends.triton.attention_configs")
    monkeypatch.setattr(configs, "INTERPRETED", False)
    monkeypatch.setattr(configs, "multiprocessors", lambda index: 132)
    cpu = torch.device("cpu", 0)
    splits = lambda b, h, skv: configs.key_splits(b, h, 1, skv, 16, 64, cpu)  # noqa: E731
    assert splits(1, 8, 512) == 4  # 8 programs: ranges of two 64-key blocks
    assert splits(1, 8, 131072) == 16 and splits(4, 8, 131072) == 4  # one wave: 128 of 132 SMs
    assert splits(16, 8, 131072) == 1 and splits(64, 8, 131072) == 1  # the programs fill the GPU by themselves
    assert splits(1, 1, 10 ** 6) == configs.MAX_SPLITS
    assert splits(0, 8, 4096) == 1
    monkeypatch.setattr(configs.attention_sm90, "device_index", lambda device: 0)
    for sm90 in (False, True):
        monkeypatch.setattr(configs.attention_sm90, "is_sm90", lambda index, sm90=sm90: sm90)

        def tiles(d, programs, dtype=torch.bfloat16):
            return configs.decode_tile_config(torch.empty(1, 1, 1, d, dtype=dtype), programs)[:2]

        assert tiles(128, 3 * 132) == (16, 64) and tiles(256, 512) == (16, 32)  # narrow tiles: one wave
        assert tiles(80, 512) == tiles(64, 512) == (16, 64)  # the wide tile would spill
        assert tiles(128, 512, torch.float32) == (16, 64)  # nor would it fit in shared memory
        assert tiles(128, 3 * 132 + 1) == tiles(112, 512, torch.float16) == ((16, 128) if sm90 else (16, 64))


@pytest.mark.skipif(not importlib.import_module("portable_ops.backends.triton.interpreter").INTERPRETED,
                    reason="runs the H100 policy's tiles in the interpreter, on CPU tensors")
def test_decode_tiles_are_chosen_for_the_programs_the_grid_has(monkeypatch):
    """A program takes a KV head's whole group of query rows when they fit one tile, else one query
    head, and a packed batch has a program per sequence and head: the tile policy counts the
    programs the grid really has. Run with the H100 policy on a one-SM GPU (so every count here
    takes sm_90's 128-key tiles), the kernels in the interpreter, against the reference."""
    attention = importlib.import_module("portable_ops.backends.triton.attention")
    configs = importlib.import_module("portable_ops.backends.triton.attention_configs")
    plans = importlib.import_module("portable_ops.backends.triton.attention_plans")
    monkeypatch.setattr(plans, "fwd_plans", {})  # plans of this policy stay here, and none is reused
    for module in (plans, configs):
        monkeypatch.setattr(module, "INTERPRETED", False)
    monkeypatch.setattr(configs, "multiprocessors", lambda index: 1)
    monkeypatch.setattr(configs.attention_sm90, "device_index", lambda device: 0)
    monkeypatch.setattr(configs.attention_sm90, "is_sm90", lambda index: True)
    seen = []
    policy = configs.decode_tile_config
    monkeypatch.setattr(configs, "decode_tile_config",
                        lambda q, programs, dv: seen.append(programs) or policy(q, programs, dv))
    g = torch.Generator().manual_seed(2)

    def grid_programs():
        (plan,) = plans.fwd_plans.values()
        plans.fwd_plans.clear()
        assert plan.fwd.options["BLOCK_N"] == 128
        return plan.fwd.grid[0] * plan.fwd.grid[1]

    for sq, programs in ((1, 5 * 2), (5, 5 * 8)):  # 4 heads x 1 row in one tile; 4 x 5 rows do not fit 16
        q = torch.randn(5, 8, sq, 128, generator=g).half()
        k, v = (torch.randn(5, 2, 40, 128, generator=g).half() for _ in range(2))
        out, _ = attention.attention_fwd(q, k, v, causal=True, scale=0.1)
        assert seen.pop() == grid_programs() == programs
        with portable_ops.use_backend("reference"):
            torch.testing.assert_close(out, portable_ops.attention(q, k, v, causal=True, scale=0.1), atol=2e-3,
                                       rtol=2e-3)
    cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)  # three packed sequences of 2, 1 and 3 rows
    q = torch.randn(6, 8, 128, generator=g).half()
    k, v = (torch.randn(6, 2, 128, generator=g).half() for _ in range(2))
    out, _ = attention.attention_varlen_fwd(q, k, v, cu, cu, 3, 3, causal=True, scale=0.1)
    assert seen.pop() == grid_programs() == 3 * 8
    with portable_ops.use_backend("reference"):
        want = torch.cat([portable_ops.attention(*(t[a:e].transpose(0, 1)[None] for t in (q, k, v)), causal=True,
                                                 scale=0.1)[0].transpose(0, 1) for a, e in ((0, 2), (2, 3), (3, 6))])
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)


def test_multi_tensor_tables_are_reused_while_the_tensors_are():
    from portable_ops.backends.triton.multi_tensor import tables

    xs = [torch.zeros(n) for n in (3, 5000)]
    first = tables([xs], 1024)
    assert tables([xs], 1024) is first
    assert first.chunks == 1 + 5
    assert tables([xs], 2048) is not first and tables([xs], 2048).chunks == 1 + 3
    moved = tables([[torch.zeros(3), torch.zeros(5000)]], 1024)
    assert moved is not first and not torch.equal(moved.addresses, first.addresses)
    # same sizes: the chunk tables are shared, only the addresses are new
    assert moved.chunk_tensor is first.chunk_tensor and moved.chunk_start is first.chunk_start
    assert first.chunk_tensor.tolist() == [0, 1, 1, 1, 1, 1]
    assert first.chunk_start.tolist() == [0, 0, 1024, 2048, 3072, 4096]


def test_launch_shapes_follow_the_element_sizes(monkeypatch):
    adam = importlib.import_module("portable_ops.backends.triton.adam")  # the package exports functions of these names
    grad_norm = importlib.import_module("portable_ops.backends.triton.grad_norm")
    mt = importlib.import_module("portable_ops.backends.triton.multi_tensor")

    monkeypatch.setattr(mt, "INTERPRETED", False)
    launches = []
    monkeypatch.setattr(adam, "tables", lambda lists, chunk: launches.append(chunk) or mt.Tables(*[None] * 4, 0, True))
    monkeypatch.setattr(adam, "LAUNCH", {(4, 4): mt.Launch(100, 1, 1), (2, 2): mt.Launch(200, 1, 1),
                                         (2, 4): mt.Launch(300, 1, 1)})
    monkeypatch.setattr(grad_norm, "LAUNCH", {4: mt.Launch(400, 1, 1), 2: mt.Launch(500, 1, 1)})
    for param_dtype, state_dtype, chunk in [(torch.float32, torch.float32, 100), (torch.bfloat16, torch.bfloat16, 200),
                                            (torch.float16, torch.float32, 300), (torch.float32, torch.float16, 100)]:
        launches.clear()
        p, m = torch.zeros(3, dtype=param_dtype), torch.zeros(3, dtype=state_dtype)
        adam._plan([p], [p], [m], [m], [], [torch.zeros(())], amsgrad=False)
        assert launches[0] == chunk, (param_dtype, state_dtype)  # the last pair has no entry: the first one
    assert mt.launch_for(grad_norm.LAUNCH, torch.bfloat16.itemsize).chunk == 500


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """Timing on, as on a GPU, with the disk cache in a fresh folder and a stand-in GPU name."""
    from portable_ops.backends.triton import autotune

    monkeypatch.setattr(autotune, "INTERPRETED", False)
    monkeypatch.setattr(autotune, "device_identity", lambda: "Some GPU sm_90")
    monkeypatch.setenv("PORTABLE_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PORTABLE_OPS_AUTOTUNE", raising=False)
    return autotune


def _source_a():
    return 1


def _source_b():
    return 2


class _Timed:
    """A launch whose cost is looked up by config, recording what was timed."""

    def __init__(self, cost):
        self.cost, self.timed = cost, []

    def __call__(self, config):
        self.timed.append(config)
        return self.cost[config]


def test_tuner_times_each_candidate_once_per_key_and_skips_ones_that_do_not_fit(tuning, monkeypatch):
    from triton.runtime.errors import OutOfResources

    cost = {"a": 3.0, "b": 1.0, "c": 2.0}
    timed = []

    def launch(config):
        timed.append(config)
        if config == "b":
            raise OutOfResources(300000, 232448, "shared memory")
        return cost[config]

    tuner = tuning.Tuner(timer=lambda run: run())
    assert tuner.pick("k", ["a", "b", "c"], launch) == "c"  # b would be fastest but does not fit
    assert tuner.pick("k", ["a", "b", "c"], launch) == "c" and timed == ["a", "b", "c"]  # remembered
    monkeypatch.setenv("PORTABLE_OPS_AUTOTUNE", "0")
    assert tuner.pick("other", ["a", "b", "c"], launch) == "a" and len(timed) == 3  # off: the first, untimed
    monkeypatch.delenv("PORTABLE_OPS_AUTOTUNE")
    with pytest.raises(RuntimeError, match="no launch configuration fits"):
        tuner.pick("none", ["b", "b"], launch)


def test_tile_choices_persist_across_processes_on_the_same_gpu_triton_and_kernel_source(tuning, monkeypatch,
                                                                                        tmp_path):
    candidates = [(128, 64, 8, 3), (64, 64, 4, 3)]
    first = _Timed({candidates[0]: 2.0, candidates[1]: 1.0})
    key = ("fwd", 80, torch.bfloat16, True, 4096, 4096, 64, 4)
    tuner = tuning.Tuner(timer=lambda run: run(), name="attention", sources=[_source_a])
    assert tuner.pick(key, candidates, first) == candidates[1] and len(first.timed) == 2
    assert [p.name for p in tmp_path.iterdir()] == [tuner.path().name]  # no temporary file left behind

    def never(config):
        raise AssertionError("timed again")

    # a new process (a new Tuner) on the same GPU, Triton and kernels: read from disk, untimed
    again = tuning.Tuner(timer=lambda run: run(), name="attention", sources=[_source_a])
    assert again.pick(key, candidates, never) == candidates[1]
    assert again.pick(key, candidates, never) == candidates[1]
    # another kernel source, another GPU, another Triton: timed afresh
    for changed in ({"sources": [_source_b]}, {"gpu": "Other GPU sm_80"}, {"triton": "0.0.1"}):
        with monkeypatch.context() as m:
            if "gpu" in changed:
                m.setattr(tuning, "device_identity", lambda: changed["gpu"])
            if "triton" in changed:
                m.setattr(tuning.triton, "__version__", changed["triton"])
            fresh = _Timed({candidates[0]: 1.0, candidates[1]: 2.0})
            other = tuning.Tuner(timer=lambda run: run(), name="attention", sources=changed.get("sources", [_source_a]))
            assert other.pick(key, candidates, fresh) == candidates[0] and len(fresh.timed) == 2, changed
    # a choice that is no longer a candidate is timed again
    replaced = _Timed({(32, 32, 4, 3): 1.0, candidates[0]: 2.0})
    assert tuning.Tuner(timer=lambda run: run(), name="attention", sources=[_source_a]).pick(
        key, [(32, 32, 4, 3), candidates[0]], replaced) == (32, 32, 4, 3) and len(replaced.timed) == 2


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"(\'k\',)": "oops"}', ""])
def test_a_corrupt_cache_file_is_ignored_and_replaced(tuning, content):
    tuner = tuning.Tuner(timer=lambda run: run(), name="t", sources=[_source_a])
    tuner.path().parent.mkdir(parents=True, exist_ok=True)
    tuner.path().write_text(content)
    timed = _Timed({"a": 2.0, "b": 1.0})
    assert tuner.pick(("k",), ["a", "b"], timed) == "b" and timed.timed == ["a", "b"]
    again = tuning.Tuner(timer=lambda run: run(), name="t", sources=[_source_a])
    assert again.pick(("k",), ["a", "b"], _Timed({})) == "b"


def test_an_unwritable_cache_folder_costs_a_retuning_not_an_error(tuning, monkeypatch, tmp_path):
    blocker = tmp_path / "a file where the folder would be"
    blocker.write_text("")
    monkeypatch.setenv("PORTABLE_OPS_CACHE_DIR", str(blocker / "cache"))
    tuner = tuning.Tuner(timer=lambda run: run(), name="t", sources=[_source_a])
    assert tuner.pick("k", ["a", "b"], _Timed({"a": 2.0, "b": 1.0})) == "b"
    timed = _Timed({"a": 2.0, "b": 1.0})
    assert tuning.Tuner(timer=lambda run: run(), name="t", sources=[_source_a]).pick("k", ["a", "b"], timed) == "b"
    assert timed.timed == ["a", "b"]


def test_under_cuda_graph_capture_a_stored_choice_is_read_but_nothing_is_timed(tuning, monkeypatch):
    first = tuning.Tuner(timer=lambda run: run(), name="t", sources=[_source_a])
    first.pick("k", ["a", "b"], _Timed({"a": 2.0, "b": 1.0}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    capturing = tuning.Tuner(timer=lambda run: run(), name="t", sources=[_source_a])
    timed = _Timed({"a": 2.0, "b": 1.0})
    assert capturing.pick("k", ["a", "b"], timed) == "b"  # from disk
    assert capturing.pick("unseen", ["a", "b"], timed) == "a" and timed.timed == []  # the first, untimed
