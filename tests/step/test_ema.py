"""--model-ema: the device-side average against a plain Python loop, its two forms (host step
and device counter) held equal, and its place in training: evaluated, checkpointed, resumed,
exported."""

import json

import pytest
import torch
from torch import nn

from fasttrain.run import checkpoint as ckpt
from fasttrain.step.ema import ModelEma
from tests.conftest import FAST


def reference(history, decay, every, warmup):
    """timm's rule written out: one float per update, buffers as the last step left them."""
    ema = [p.clone() for p in history[0]]
    n = 0
    for step, params in enumerate(history[1:]):
        if (step + 1) % every:
            continue
        n += 1
        d = min(decay, (1 + n) / (10 + n)) if warmup else decay
        ema = [e * d + p * (1 - d) for e, p in zip(ema, params, strict=True)]
    return ema


@pytest.mark.parametrize("every, warmup", [(1, False), (3, True)])
@pytest.mark.parametrize("counter", ["host", "device"])
def test_the_average_follows_timms_rule(every, warmup, counter):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    ema = ModelEma(model, decay=0.9, every=every, warmup=warmup)
    history = [[p.detach().clone() for p in model.parameters()]]
    for step in range(10):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
            model[1].running_mean.add_(1.0)
        history.append([p.detach().clone() for p in model.parameters()])
        ema.update(step if counter == "host" else torch.tensor(step))
    for got, want in zip(ema.module.parameters(), reference(history, 0.9, every, warmup),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ema.module[1].running_mean, model[1].running_mean)
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_a_run_with_model_ema_evaluates_checkpoints_resumes_and_exports_it(
    run, tiny_data, tmp_path
):
    common = ["--data", tiny_data, *FAST, "--epochs", "2", "--model-ema", "--model-ema-decay",
              "0.9", "--model-ema-warmup"]  # fmt: skip
    whole = tmp_path / "whole"
    code, err = run(*common, "--output-dir", whole)
    assert code == 0, err
    val = run.records(whole, "val")
    assert {"top1", "ema_top1", "ema_top5"} <= set(val[-1])
    state = ckpt.list_checkpoints(whole)[0]
    saved = torch.load(state, weights_only=True)
    assert set(saved["model_ema"]) == set(saved["model"])
    assert not torch.equal(saved["model_ema"]["fc.weight"], saved["model"]["fc.weight"])
    # interrupted at step 5 and resumed: the same average at the end, bit for bit
    parts = tmp_path / "parts"
    code, err = run(*common, "--output-dir", parts, "--max-steps", "5")
    assert code == 0, err
    code, err = run(*common, "--output-dir", parts, "--resume", "auto")
    assert code == 0, err
    resumed = torch.load(ckpt.list_checkpoints(parts)[0], weights_only=True)
    for k, v in saved["model_ema"].items():
        assert torch.equal(resumed["model_ema"][k], v), k
    # export --ema writes the average; evaluating it gives the run's ema figures
    code, err = run("export", state, tmp_path / "ema.pt", "--ema")
    assert code == 0, err
    exported = torch.load(tmp_path / "ema.pt", weights_only=True)
    assert torch.equal(exported["fc.weight"], saved["model_ema"]["fc.weight"])
    assert "wrote the moving average of its weights" in err
    code, err = run("export", state, tmp_path / "raw.pt")
    assert code == 0 and "wrote its model's weights" in err
    assert "it also holds their moving average, which --ema writes" in err
    out = tmp_path / "eval"
    code, err = run("evaluate", tmp_path / "ema.pt", "--data", tiny_data, *FAST, "--output-dir",
                    out)  # fmt: skip
    assert code == 0, err
    assert json.loads((out / "eval.json").read_text())["top1"] == pytest.approx(val[-1]["ema_top1"])
    # evaluate --model-ema on the checkpoint itself: the average, as the run reported it, and
    # without the flag the model's own weights, each saying which it evaluated
    for flags, key, said in (
        (["--model-ema"], "ema_top1", "evaluating the moving average of its weights"),
        ([], "top1", "the file also holds their moving average, which --model-ema evaluates"),
    ):
        out = tmp_path / f"eval-{key}"
        code, err = run("evaluate", state, "--data", tiny_data, *FAST, *flags, "--output-dir", out)
        assert code == 0, err
        result = json.loads((out / "eval.json").read_text())
        assert result["top1"] == pytest.approx(val[-1][key]) and result["average"] == bool(flags)
        assert said in (out / "log-rank0.txt").read_text()


def test_export_ema_of_a_checkpoint_without_one_is_one_line(run, tiny_data, tmp_path):
    out = tmp_path / "plain"
    code, err = run("--data", tiny_data, *FAST, "--max-steps", "2", "--eval-every", "0",
                    "--output-dir", out)  # fmt: skip
    assert code == 0, err
    code, err = run("export", ckpt.list_checkpoints(out)[0], tmp_path / "e.pt", "--ema")
    assert code == 2 and "holds no EMA weights (train with --model-ema)" in err
