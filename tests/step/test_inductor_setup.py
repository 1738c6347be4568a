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


@pytest.fixture
def compiles(monkeypatch, calls):
    """torch.compile recorded: each call's caching precompile setting (dynamo's saved trace)."""
    import torch._dynamo.config as dynamo_config

    seen = []

    def fake_compile(fn, **kwargs):
        seen.append(dynamo_config.caching_precompile)
        if dynamo_config.caching_precompile and fake_compile.fails:
            raise TypeError("assigned grad expected to be a Tensor or None")
        return fn

    fake_compile.fails = False
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(dynamo_config, "caching_precompile", True)
    return seen, fake_compile


def test_evaluation_compiles_without_dynamo_s_saved_trace(compiles):
    seen, _ = compiles
    evaluate.Evaluator(nn.Linear(4, 2), None, True, 8)
    assert seen == [False]


def test_a_saved_trace_that_fails_to_load_is_traced_afresh(compiles, caplog):
    seen, fake_compile = compiles
    fn = inductor_setup.compile_function(len, None, what="the step", keep_trace=True)
    assert fn is len and seen == [True]  # loaded, or traced and saved: torch's to decide
    fake_compile.fails = True
    with caplog.at_level("WARNING", logger="fasttrain"):
        fn = inductor_setup.compile_function(len, None, what="the step", keep_trace=True)
    assert fn is len and seen == [True, True, False]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("dynamo's saved trace of the step could not be loaded (TypeError: ")
    assert line.endswith("; tracing it afresh (--no-trace-cache skips the lookup)")
