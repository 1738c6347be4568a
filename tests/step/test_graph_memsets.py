"""A captured graph's memsets as fill kernels (``step/graph_memsets.py``): which memsets one
kernel node replaces, the words it writes, its PTX, and on a GPU (``gpu``) the rewritten graph
against the one captured."""

import ctypes
import logging
import os
import shutil
import subprocess

import pytest
import torch

from fasttrain.step import graph_memsets as gm
from fasttrain.step.graphs import capture


def memset(dst: int, nbytes: int = 1024, value: int = 0, size: int = 1, height: int = 1):
    return gm.Memset(dst, nbytes, value, size, nbytes // size, height)


def test_a_row_of_memsets_is_one_run_and_a_fork_ends_it():
    # conv input -> m1 -> m2 -> m3 -> conv, as cuDNN issues them
    ms = {1: memset(0), 2: memset(4096), 3: memset(8192, 4)}
    deps = {1: [10], 2: [1], 3: [2], 11: [3]}
    succs = {10: [1], 1: [2], 2: [3], 3: [11]}
    assert gm.chains(ms, deps, succs) == [[1, 2, 3]]
    # m2 also feeds node 20: m3 must wait for m2 alone, not for m1 and m2 together with it
    succs[2] = [3, 20]
    assert gm.chains(ms, deps, succs) == [[1, 2], [3]]
    # a memset the kernel cannot write (left out of ``ms``) splits the row too
    assert gm.chains({1: ms[1], 3: ms[3]}, deps, {**succs, 2: [3]}) == [[1], [3]]


def test_runs_split_at_the_kernels_capacity_and_at_overlapping_bytes():
    ms = {i: memset(i * 4096) for i in range(1, 7)}
    deps = {i: [i - 1] for i in range(1, 7)}
    succs = {i: [i + 1] for i in range(0, 6)}
    assert gm.chains(ms, deps, succs) == [[1, 2, 3, 4], [5, 6]]
    ms[3] = memset(4096 + 512)  # writes into 2's bytes: a kernel writing both at once would race
    assert gm.chains(ms, deps, succs) == [[1, 2], [3, 4, 5, 6]]


def test_a_memset_after_a_node_with_other_successors_starts_its_own_run():
    ms = {1: memset(0), 2: memset(4096)}
    deps = {1: [0], 2: [1]}
    succs = {0: [1], 1: [2, 9]}  # 1 feeds another node too
    assert gm.chains(ms, deps, succs) == [[1], [2]]


def test_words_repeat_the_value_and_refuse_what_the_kernel_cannot_write():
    assert memset(64, 16, 0x5A).words() == (64, 4, 0x5A5A5A5A)
    assert memset(64, 16, 0x1234, size=2).words() == (64, 4, 0x12341234)
    assert memset(64, 4, 7, size=4).words() == (64, 1, 7)
    assert memset(64, 16, 0x1FF).words() == (64, 4, 0xFFFFFFFF)  # a byte's value is its low 8 bits
    assert memset(66, 16).words() is None  # unaligned
    assert memset(64, 6).words() is None  # not whole words
    assert memset(64, 16, height=2).words() is None  # rows with a pitch


def test_the_fill_kernel_assembles(tmp_path):
    """The PTX is loaded by the driver at run time; Triton's own ptxas checks it here."""
    triton = pytest.importorskip("triton")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    ptxas = ptxas if os.path.exists(ptxas) else shutil.which("ptxas")
    if ptxas is None:
        pytest.skip("no ptxas")
    src = tmp_path / "fill.ptx"
    src.write_bytes(gm.PTX)
    out = subprocess.run(
        [ptxas, "-arch=sm_90", str(src), "-o", str(tmp_path / "fill.cubin")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr


def test_the_environment_chooses(monkeypatch, caplog):
    for value, on in [("kernels", True), ("1", True), ("keep", False), ("0", False)]:
        monkeypatch.setenv(gm.ENV, value)
        assert gm.enabled() is on
    monkeypatch.delenv(gm.ENV)
    assert gm.enabled() is (gm.DEFAULT == "kernels")
    gm._warn_unknown.cache_clear()
    monkeypatch.setenv(gm.ENV, "yes")
    assert gm.enabled() is (gm.DEFAULT == "kernels")
    assert gm.enabled() is (gm.DEFAULT == "kernels")
    assert caplog.text.count("FASTTRAIN_GRAPH_MEMSETS=yes: not kernels or keep") == 1


def _driver_memsets(spans: list[tuple[torch.Tensor, int]]) -> None:
    """cudaMemsetAsync as cuDNN calls it (bytes), on the current stream: memset nodes."""
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuMemsetD8Async.argtypes = [
        ctypes.c_uint64,
        ctypes.c_ubyte,
        ctypes.c_size_t,
        ctypes.c_void_p,
    ]
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    for t, v in spans:
        assert cu.cuMemsetD8Async(t.data_ptr(), v, t.numel() * t.element_size(), stream) == 0


# (offset, bytes, value): three whole words in a row, as cuDNN's, then one the kernel cannot write
SPANS = [(8, 1024, 0), (1200, 1024, 0x5A), (2400, 4, 0), (3001, 7, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("rewrite", ["keep", "kernels"])
def test_a_graph_with_memsets_replays_the_same_either_way(rewrite, monkeypatch):
    """Memsets between kernels, as cuDNN leaves them in the step: the replay writes the same
    bytes with them rewritten as without, the bytes around them stay as they were, and the
    kernel after them reads what they wrote."""
    monkeypatch.setenv(gm.ENV, rewrite)
    dev = torch.device("cuda")
    buf = torch.full((4096,), 3, dtype=torch.uint8, device=dev)
    x = torch.randn(4096, device=dev)
    total = torch.zeros((), dtype=torch.int64, device=dev)

    def body():
        y = x * 2
        _driver_memsets([(buf[lo : lo + n], v) for lo, n, v in SPANS])
        total.copy_(buf.sum(dtype=torch.int64))
        return y

    graph, _ = capture(body, torch.cuda.Stream())
    buf.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    expect = torch.full((4096,), 3, dtype=torch.uint8)
    for lo, n, v in SPANS:
        expect[lo : lo + n] = v
    assert torch.equal(buf.cpu(), expect)
    assert total.item() == int(expect.sum())


@pytest.mark.gpu
def test_the_rewrite_replaces_a_run_of_memsets_by_one_kernel_node():
    """On the raw graph: three whole-word memsets in a row are replaced (one kernel node), none
    is left for a second pass, and the kernels either side see the order kept."""
    dev = torch.device("cuda")
    a = torch.empty(256, dtype=torch.float32, device=dev)
    b = torch.empty(256, dtype=torch.float32, device=dev)
    c = torch.empty(1, dtype=torch.int32, device=dev)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        a.add_(1)
        _driver_memsets([(a, 0), (b, 0), (c, 0)])
        b.add_(1)
    assert gm.as_kernels(graph.raw_cuda_graph()) == 3
    assert gm.as_kernels(graph.raw_cuda_graph()) == 0
    graph.instantiate()
    a.fill_(5), b.fill_(5), c.fill_(5)
    graph.replay()
    torch.cuda.synchronize()
    assert a.eq(0).all() and b.eq(1).all() and c.item() == 0


@pytest.mark.gpu
def test_the_fused_step_graphed_with_fill_kernels_matches_its_base(
    cudnn_frontend, caplog, monkeypatch
):
    """The fused step (fp16, BatchNorm statistics summed by cuDNN's convolutions) graphed with its
    memsets as fill kernels, against its compiled base step, at an LR of 0 so that every step
    runs the same weights on a new batch. cuDNN sums the statistics with atomic adds, so two runs
    of the same step already differ by about 1e-4 of the loss (`--deterministic` refuses the
    fused path for this); with training on, the two runs drift apart step by step, so bitwise
    or free-running comparisons cannot hold. A fill kernel that zeroed the wrong bytes, or none,
    would leave a layer's statistics summed onto the last replay's."""
    from tests.step.test_graphed_step import batches, make, train

    caplog.set_level(logging.DEBUG, logger="fasttrain")
    monkeypatch.setenv(gm.ENV, "kernels")
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)  # the same plain convolutions
    data = batches(10, dtype=torch.float16)
    _, ref_step = make("compiled", amp=torch.float16, fused_bn=True, lr=0.0)
    ref_losses = train(ref_step, data)
    _, step = make("compiled+graph", amp=torch.float16, fused_bn=True, lr=0.0)
    losses = train(step, data)
    assert step.graph is not None and not step.capture_failed
    replaced = [r.args[0] for r in caplog.records if "memsets replaced by fill" in r.getMessage()]
    assert replaced and min(replaced) > 0, "the graph's memsets were not replaced"
    assert "its memsets stay as they are" not in caplog.text
    assert losses == pytest.approx(ref_losses, rel=1e-3)
