"""The workflow after training, through the CLI: export a checkpoint's weights for
torchvision, evaluate weights on a val set, and start a run from weights (fine-tuning)."""

import json
import sys

import pytest
import torch
import torchvision

from fasttrain.model.build import build_model
from fasttrain.run import checkpoint as ckpt
from tests.conftest import FAST


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data):
    """A tiny resnet18 run on the 4-class sample set, 2 epochs, evaluated each epoch."""
    from fasttrain.__main__ import main

    out = tmp_path_factory.mktemp("trained") / "run"
    argv = ["--data", tiny_data, *FAST, "--epochs", "2", "--lr", "1.6", "--output-dir", out]
    assert main([str(a) for a in argv]) == 0
    return out


def test_export_writes_torchvisions_state_dict_with_the_same_logits(run, trained, tmp_path):
    checkpoint = ckpt.list_checkpoints(trained)[0]
    code, err = run("export", checkpoint, tmp_path / "w" / "resnet18.pt")
    assert code == 0, err
    assert "wrote its model's weights, 122 tensors" in err
    state = torch.load(tmp_path / "w" / "resnet18.pt", weights_only=True)
    plain = torchvision.models.resnet18(num_classes=4)
    plain.load_state_dict(state, strict=True)  # torchvision's keys, nothing else
    ours = build_model("resnet18", 4, True, torch.device("cpu"))
    ours.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    x = torch.randn(3, 3, 32, 32)
    plain.eval(), ours.eval()
    torch.testing.assert_close(plain(x), ours(x))


def test_export_refuses_what_it_cannot_write(run, trained, tmp_path, monkeypatch):
    checkpoint = ckpt.list_checkpoints(trained)[0]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = run("export", checkpoint, blocker / "w.pt")
    assert code == 2 and "cannot write there" in err and "Traceback" not in err
    code, err = run("export", tmp_path / "missing.pt", tmp_path / "w.pt")
    assert code == 2 and "export " in err and "no such file" in err
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # as if not installed
    code, err = run("export", checkpoint, tmp_path / "w.safetensors")
    assert code == 2 and "needs the safetensors package" in err


def test_evaluate_gives_the_runs_own_val_figures(run, trained, tiny_data, tmp_path):
    """The checkpoint, its export, and the val folder given directly: each is the run's last
    evaluation, counted over every image once, and written to eval.json."""
    last = run.records(trained, "val")[-1]
    checkpoint = ckpt.list_checkpoints(trained)[0]
    code, err = run("export", checkpoint, tmp_path / "w.pt")
    assert code == 0, err
    cases = {
        "checkpoint": ("evaluate", checkpoint, "--data", tiny_data),
        "export": ("--test-only", "--weights", tmp_path / "w.pt", "--data", tiny_data),
        "val folder": ("evaluate", tmp_path / "w.pt", "--data", tiny_data / "val"),
    }
    for name, argv in cases.items():
        out = tmp_path / name.replace(" ", "-")
        code, err = run(*argv, *FAST, "--output-dir", out)
        assert code == 0, err
        result = json.loads((out / "eval.json").read_text())
        assert result["images"] == 100, name
        assert result["top1"] == pytest.approx(last["top1"]) and result["top5"] == pytest.approx(
            last["top5"]
        ), name
        assert f"top-1 {last['top1']:.2f}%" in (out / "log-rank0.txt").read_text()
        assert not list(out.glob("ckpt-*.pt"))  # nothing trained, nothing saved


def test_evaluate_refuses_weights_of_another_model_in_one_line(run, trained, tiny_data, tmp_path):
    checkpoint = ckpt.list_checkpoints(trained)[0]
    flags = [*FAST, "--data", tiny_data, "--output-dir", tmp_path / "e"]
    code, err = run("evaluate", checkpoint, *flags, "--arch", "resnet34")
    assert code == 2 and "not weights for this model" in err and "--arch" in err
    assert "Traceback" not in err and not (tmp_path / "e").exists()
    code, err = run("--test-only", *flags)
    assert code == 2 and "--test-only evaluates the model in --weights FILE" in err


def test_fine_tuning_from_weights_replaces_a_classifier_of_another_size(
    run, trained, tiny_data, tmp_path
):
    """--weights into a 3-class dataset: every layer but the classifier comes from the file,
    which the log says; the first step's weights are the file's."""
    three = tmp_path / "three"
    for split in ("train", "val"):
        for c in ("class_000", "class_001", "class_002"):
            (three / split / c).mkdir(parents=True)
            for f in sorted((tiny_data / split / c).iterdir()):
                (three / split / c / f.name).symlink_to(f)
    checkpoint = ckpt.list_checkpoints(trained)[0]
    out = tmp_path / "ft"
    code, err = run("--data", three, *FAST, "--weights", checkpoint, "--max-steps", "1",
                    "--lr", "0", "--output-dir", out)  # fmt: skip
    assert code == 0, err
    log = (out / "log-rank0.txt").read_text()
    assert "its classifier has 4 classes, this model 3: the classifier (fc) starts from" in log
    tuned = ckpt.list_checkpoints(out)[0]
    start, after = (
        torch.load(checkpoint, weights_only=True)["model"],
        torch.load(tuned, weights_only=True)["model"],
    )
    assert after["fc.weight"].shape == (3, 512)
    torch.testing.assert_close(after["layer1.0.conv1.weight"], start["layer1.0.conv1.weight"])


@pytest.mark.parametrize(
    "content, message",
    [
        (b"not a torch file", "torch.load cannot read it as weights"),
        ({"epoch": torch.tensor(3), "note": "x"}, "not a state dict"),
    ],
)
def test_a_weights_file_that_is_not_weights_is_one_line(run, tiny_data, tmp_path, content, message):
    path = tmp_path / "w.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    code, err = run("--data", tiny_data, *FAST, "--weights", path, "--output-dir", tmp_path / "o")
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    code, err = run("--data", tiny_data, *FAST, "--weights", tmp_path / "none.pt")
    assert code == 2 and "--weights" in err and "no such file" in err


def test_evaluate_takes_torchvisions_val_sizes(run, trained, tiny_data, tmp_path):
    checkpoint = ckpt.list_checkpoints(trained)[0]
    out = tmp_path / "sizes"
    code, err = run("evaluate", checkpoint, "--data", tiny_data, *FAST, "--val-resize-size",
                    "44", "--val-crop-size", "40", "--output-dir", out)  # fmt: skip
    assert code == 0, err
    assert json.loads((out / "eval.json").read_text())["images"] == 100
    saved = (out / "config.yaml").read_text()
    assert "val_resize_size: 44" in saved and "val_crop_size: 40" in saved


def test_export_to_safetensors_loads_into_torchvision(run, trained, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    checkpoint = ckpt.list_checkpoints(trained)[0]
    code, err = run("export", checkpoint, tmp_path / "resnet18.safetensors")
    assert code == 0, err
    plain = torchvision.models.resnet18(num_classes=4)
    plain.load_state_dict(load_file(str(tmp_path / "resnet18.safetensors")), strict=True)
    saved = torch.load(checkpoint, weights_only=True)["model"]
    torch.testing.assert_close(plain.state_dict()["fc.weight"], saved["fc.weight"])
