"""cudnn_graph.select_fastest: which of a graph's plans it keeps, and what a later start reuses."""

from __future__ import annotations

import json

import pytest
import torch

from fasttrain.model.cudnn import graph as graph_module
from fasttrain.model.cudnn import plans_kept
from fasttrain.model.cudnn.graph import select_fastest


class _Graph:
    """The calls select_fastest makes of a cuDNN frontend graph, over ``plans`` plans."""

    def __init__(self, plans: int):
        self.plans, self.built = plans, None

    def get_execution_plan_count(self) -> int:
        return self.plans

    def build_plan_at_index(self, index: int) -> None:
        self.built = index

    def get_workspace_size(self) -> int:
        return 0


@pytest.mark.gpu
def test_the_fastest_plan_that_captures_is_kept():
    """A plan that runs eagerly but invalidates a CUDA-graph capture (here: a host sync) is
    passed over although it times fastest, since the trainer replays its step from a graph;
    of the others the faster is kept, and the device captures and replays as before."""
    x = torch.ones(1 << 20, device="cuda")
    graph = _Graph(3)

    def run(workspace: int) -> None:
        if graph.built == 0:  # the fastest: no GPU work, one host sync
            torch.cuda.synchronize()
        else:  # plan 1 is 40 times plan 2's work
            for _ in range(40 if graph.built == 1 else 1):
                x.mul_(1.0)

    select_fastest(graph, run)
    assert graph.built == 2
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        x.add_(1.0)
    captured.replay()
    torch.cuda.synchronize()
    assert float(x[0]) == 2.0  # the capture records the add, the replay runs it once


class _Timed(_Graph):
    """A graph whose plan 1 is the fastest; every plan it builds is recorded."""

    def __init__(self, plans: int):
        super().__init__(plans)
        self.builds: list[int] = []

    def build_plan_at_index(self, index: int) -> None:
        self.builds.append(index)
        super().build_plan_at_index(index)


def _select(graph, monkeypatch, key, runs: list) -> None:
    """select_fastest on the CPU: each plan's time stands in for its GPU time."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(graph_module, "_eager_ms", lambda run, ws: [5.0, 1.0, 3.0][graph.built])
    monkeypatch.setattr(plans_kept, "full_key", lambda key, device: repr(key))
    select_fastest(graph, lambda ws: runs.append(graph.built), key=key, device=torch.device("cpu"))


def test_a_kept_plan_is_built_alone_at_the_next_start(tmp_path, monkeypatch):
    path = tmp_path / "cudnn-plans.json"
    plans_kept.keep_plans(path)
    first, runs = _Timed(3), []
    _select(first, monkeypatch, ("conv", 1), runs)
    assert first.built == 1 and runs == [0, 1, 2]  # every plan timed, the fastest kept
    plans_kept.keep_plans(path)  # the next start reads the file
    second, runs = _Timed(3), []
    _select(second, monkeypatch, ("conv", 1), runs)
    assert second.builds == [1] and runs == []  # built alone, nothing run or timed
    other, runs = _Timed(3), []
    _select(other, monkeypatch, ("conv", 2), runs)  # another graph: timed
    assert runs == [0, 1, 2]
    plans_kept.keep_plans(None)


def test_a_kept_plan_is_timed_again_where_the_ranking_changed(tmp_path, monkeypatch):
    path = tmp_path / "cudnn-plans.json"
    plans_kept.keep_plans(path)
    _select(_Timed(3), monkeypatch, ("conv", 1), [])
    plans_kept.keep_plans(path)
    fewer, runs = _Timed(2), []  # cuDNN ranks another number of plans: not the same list
    monkeypatch.setattr(graph_module, "_eager_ms", lambda run, ws: [5.0, 1.0][fewer.built])
    select_fastest(fewer, lambda ws: runs.append(fewer.built), key=("conv", 1), device="cpu")
    assert runs == [0, 1]
    path.write_text("{not json")
    plans_kept.keep_plans(path)  # unreadable: a warning, and every graph is timed
    again, runs = _Timed(3), []
    _select(again, monkeypatch, ("conv", 1), runs)
    assert runs == [0, 1, 2] and json.loads(path.read_text())  # and the file written anew
    plans_kept.keep_plans(None)


def test_the_kept_key_holds_the_graph_the_versions_and_the_gpu(monkeypatch):
    pytest.importorskip("cudnn")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU A")
    shape = torch.Size([256, 64, 56, 56])
    graph = ("conv_bn", shape, (200704, 1, 3584, 64), torch.float16, True, "nhwc")
    key = plans_kept.full_key(graph, torch.device("cuda", 0))
    assert key == plans_kept.full_key(graph, torch.device("cuda", 0))
    assert "GPU A" in key and "torch.float16" in key and "[256, 64, 56, 56]" in key
    assert key != plans_kept.full_key((*graph[:-1], "nchw"), torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU B")
    assert key != plans_kept.full_key(graph, torch.device("cuda", 0))
