"""Non-finite values: a NaN loss stops with a diagnostic or restores the newest checkpoint, and
no checkpoint is ever written with non-finite weights."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import FAST, last_checkpoint


def nan_once(call: int):
    """CrossEntropyLoss.forward, returning NaN on one call (one step: no accumulation)."""
    forward = torch.nn.CrossEntropyLoss.forward
    calls = [0]

    def patched(self, logits, labels):
        loss = forward(self, logits, labels)
        calls[0] += 1
        return loss * float("nan") if calls[0] == call else loss

    return patched


def nan_run(run, tiny_data, out, policy, monkeypatch):
    monkeypatch.setattr(torch.nn.CrossEntropyLoss, "forward", nan_once(call=6))  # step 6
    return run(
        "--data",
        tiny_data,
        *FAST,
        "--max-steps",
        "10",
        "--eval-every",
        "0",
        "--log-every",
        "2",
        "--ckpt-every-steps",
        "4",
        "--on-nan",
        policy,
        "--output-dir",
        out,
    )


@pytest.mark.slow
def test_nonfinite_loss_stops_with_a_diagnostic_and_no_bad_checkpoint(
    run, tiny_data, tmp_path, monkeypatch
):
    out = tmp_path / "nan-stop"
    code, err = nan_run(run, tiny_data, out, "stop", monkeypatch)
    assert code == 3
    line = [x for x in err.splitlines() if x.startswith("fasttrain: error:")]
    assert len(line) == 1 and "NaN or infinite between steps 4 and 6" in line[0]
    diagnostic = json.loads((out / "nonfinite.json").read_text())
    assert diagnostic["between_steps"] == [4, 6] and diagnostic["last_finite_loss_step"] == 4
    assert diagnostic["last_finite_loss"] > 0
    assert last_checkpoint(out)["step"] == 4  # the NaN weights were never saved


@pytest.mark.slow
def test_nonfinite_loss_skip_restores_the_checkpoint_and_trains_on(
    run, tiny_data, tmp_path, monkeypatch
):
    out = tmp_path / "nan-skip"
    code, err = nan_run(run, tiny_data, out, "skip", monkeypatch)
    assert code == 0, err
    log = (out / "log-rank0.txt").read_text()
    assert "NaN or infinite between steps 4 and 6" in log and "(step 4)" in log
    assert "restored the weights and optimizer of" in log
    final = last_checkpoint(out)
    assert final["step"] == 10
    assert all(torch.isfinite(v).all() for v in final["model"].values() if v.is_floating_point())
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    bad = [r["step"] for r in records if r.get("nonfinite_losses")]
    assert bad == [6]  # once, and the steps after it are finite again


POISON_TARGETS: dict[str, torch.Tensor] = {}


def poison_after(call: int, name: str):
    """torch's SGD step, which on its ``call``-th call leaves ``name``'s tensor infinite after the
    update: the weights break while the loss of that step, computed before, is still finite."""
    step = torch.optim.SGD.step
    calls = [0]

    def patched(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        calls[0] += 1
        if calls[0] == call:
            target = POISON_TARGETS[name]
            with torch.no_grad():
                target[(0,) * target.dim()] = float("inf")
        return out

    return patched


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_checkpoint_is_never_written_with_nonfinite_weights(
    run, tiny_data, tmp_path, monkeypatch, policy
):
    """Weights that break in the step right before a checkpoint are never saved: stop exits 3
    naming the tensor; skip restores the newest finite checkpoint and trains on."""
    import fasttrain.run.build as builder

    build = builder.build_training

    def remember(*args, **kwargs):
        training = build(*args, **kwargs)
        POISON_TARGETS["layer1.0.conv1.weight"] = training.model.layer1[0].conv1.weight
        return training

    monkeypatch.setattr(builder, "build_training", remember)
    monkeypatch.setattr(torch.optim.SGD, "step", poison_after(8, "layer1.0.conv1.weight"))
    out = tmp_path / policy
    code, err = run(
        "--data", tiny_data, *FAST, "--max-steps", "10", "--eval-every", "0", "--log-every",
        "5", "--ckpt-every-steps", "4", "--on-nan", policy, "--output-dir", out,
    )  # fmt: skip
    steps = sorted(torch.load(p, weights_only=True)["step"] for p in out.glob("ckpt-*.pt"))
    for p in out.glob("ckpt-*.pt"):
        state = torch.load(p, weights_only=True)
        assert all(
            torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point()
        )
    if policy == "stop":
        assert code == 3, err
        assert "layer1.0.conv1.weight holds NaN or infinite values at step 8" in err
        assert json.loads((out / "nonfinite.json").read_text())["first_nonfinite_tensor"] == (
            "layer1.0.conv1.weight"
        )
        assert steps == [4]
    else:
        assert code == 0, err
        assert "restored the weights and optimizer of" in (out / "log-rank0.txt").read_text()
        assert 8 not in steps and steps[-1] == 10
