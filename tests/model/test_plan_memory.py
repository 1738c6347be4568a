"""cuDNN plans remembered across runs (``model/cudnn/plan_memory.py``), on a stand-in graph: the
CPU has no cuDNN. A GPU test (tests/model/test_conv_bn_cudnn.py) builds real graphs."""

from __future__ import annotations

import json

import pytest

from fasttrain.model.cudnn import plan_memory


class Graph:
    """What plan_memory reads of a cuDNN frontend graph: its description and its plans."""

    def __init__(self, shape: str, plans: list[str]):
        self.shape, self.plans = shape, plans

    def __repr__(self) -> str:
        return json.dumps({"nodes": ["conv_fprop"], "x": self.shape})

    def get_execution_plan_count(self) -> int:
        return len(self.plans)

    def get_plan_name_at_index(self, index: int) -> str:
        return self.plans[index]


@pytest.fixture
def memory(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(plan_memory, "context", lambda: ["NVIDIA H200", "91900", "1.32.0"])
    return tmp_path / "cudnn-plans.json"


def test_a_plan_is_remembered_for_its_graph_only(memory):
    a = Graph("256x64x56x56", ["eng0", "eng3_k2", "eng7"])
    plan_memory.remember(a, 1)
    assert json.loads(memory.read_text())[plan_memory.key(a)] == {"index": 1, "name": "eng3_k2"}
    assert plan_memory.recall(Graph("256x64x56x56", ["eng0", "eng3_k2", "eng7"])) == 1
    assert plan_memory.recall(Graph("256x128x28x28", ["eng0", "eng3_k2", "eng7"])) is None
    plan_memory.remember(Graph("256x128x28x28", ["eng5"]), 0)  # merged, not replaced
    assert len(json.loads(memory.read_text())) == 2 and plan_memory.recall(a) == 1


def test_another_gpu_or_cudnn_or_plan_list_misses(memory, monkeypatch):
    a = Graph("256x64x56x56", ["eng0", "eng3_k2"])
    plan_memory.remember(a, 1)
    assert plan_memory.recall(Graph("256x64x56x56", ["eng0", "eng9"])) is None  # renamed plan
    assert plan_memory.recall(Graph("256x64x56x56", ["eng0"])) is None  # fewer plans
    monkeypatch.setattr(plan_memory, "context", lambda: ["NVIDIA H100", "91900", "1.32.0"])
    assert plan_memory.recall(a) is None
    monkeypatch.setattr(plan_memory, "context", lambda: ["NVIDIA H200", "92000", "1.32.0"])
    assert plan_memory.recall(a) is None


def test_a_damaged_or_unwritable_file_costs_only_the_timing(memory, tmp_path, monkeypatch):
    a = Graph("x", ["eng0", "eng1"])
    memory.write_text("{not json")
    assert plan_memory.recall(a) is None
    plan_memory.remember(a, 1)  # replaces the damaged file
    assert plan_memory.recall(a) == 1
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("FASTTRAIN_CACHE", str(blocked / "below-a-file"))
    plan_memory.remember(a, 0)  # logged, not raised
    assert plan_memory.recall(a) is None
