"""Every place that compiles gets inductor's setup (step/inductor_setup.py): the training step
and evaluation, which the `evaluate` command compiles with no step before it."""

import pytest
import torch
from torch import nn

from fasttrain.step import evaluate, inductor_setup, step
from fasttrain.step.optim import Schedule


@pytest.fixture
def calls(monkeypatch):
    """What each piece of the setup was called, in order, with each piece's own call recorded."""
    seen = []
    for name in (
        "keep_coordinate_descent_results",
        "share_ptxas_with_compile_workers",
        "compile_tuning_candidates_ahead",
    ):
        monkeypatch.setattr(inductor_setup, name, lambda name=name: seen.append(name))
    return seen


def test_the_setup_applies_every_piece(calls):
    inductor_setup.prepare_inductor()
    assert calls == [
        "keep_coordinate_descent_results",
        "share_ptxas_with_compile_workers",
        "compile_tuning_candidates_ahead",
    ]


def test_a_compiled_evaluator_and_a_compiled_step_set_inductor_up(calls, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # nothing compiled here
    model = nn.Linear(4, 2)
    evaluate.Evaluator(model, None, False, 8)
    assert calls == []
    evaluate.Evaluator(model, None, True, 8)
    assert len(calls) == 3
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = Schedule(
        0.1,
        steps_per_epoch=1,
        total_steps=1,
        warmup_steps=0,
        kind="cosine",
        step_epochs=1,
        gamma=0.1,
    )
    step.build_step(
        model=model,
        optimizer=optimizer,
        criterion=nn.CrossEntropyLoss(),
        amp_dtype=None,
        scaler=None,
        schedule=schedule,
        compile=True,
    )
    assert len(calls) == 6
