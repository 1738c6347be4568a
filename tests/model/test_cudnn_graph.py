"""cudnn_graph.select_fastest: which of a graph's plans it keeps."""

from __future__ import annotations

import pytest
import torch

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
