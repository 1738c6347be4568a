"""Which BatchNorm path a run takes (--fused-bn auto|on|off, --cudnn-bn) and the precision that
goes with it (--amp auto), on a GPU whose cuDNN takes every fused convolution, one that declines
some, one without the frontend, and the CPU."""

from __future__ import annotations

import re

import pytest
import yaml

from fasttrain.config.cli import parse_args, save_resolved
from fasttrain.errors import UserError
from fasttrain.model.fused_support import ConvShape
from tests.config.test_config import cudnn_takes, resolved

STEM_LIKE = ConvShape((256, 3, 224, 224), (64, 3, 7, 7), 2, 3)
NO_FRONTEND = cudnn_takes(unavailable="the cuDNN frontend is not installed (pip install ...)")


def path(cfg) -> tuple[str, str]:
    return cfg.model.fused_bn, cfg.train.amp


def test_auto_takes_the_fused_path_in_fp16_where_cudnn_takes_every_layer():
    notes = []
    cfg = resolved(["--data", "/d"], notes=notes)
    assert path(cfg) == ("on", "fp16")
    assert cfg.typed.bn_path == "folded into the convolutions (--fused-bn auto)"
    assert notes == []


@pytest.mark.parametrize(
    "flags, fused, reason",
    [
        ([], NO_FRONTEND, "the cuDNN frontend is not installed"),
        ([], cudnn_takes(declined=[STEM_LIKE]), "cuDNN 9.19 on this GPU .* for 1 of the model's 2"
         " convolution shapes: 7x7 conv 3->64 stride 2 on 256x3x224x224"),
        (["--amp", "bf16"], None, r"--amp bf16 \(cuDNN fuses BatchNorm into convolutions in fp16"),
        (["--amp", "off"], None, "--amp off"),
        (["--deterministic"], None, "--deterministic .*atomic adds"),
        (["--no-channels-last"], None, "--no-channels-last .*NHWC"),
    ],
)  # fmt: skip
def test_auto_takes_the_plain_path_where_the_fused_one_cannot_run_and_says_why(
    flags, fused, reason
):
    cfg = resolved(["--data", "/d", *flags], fused=fused)
    assert cfg.model.fused_bn == "off"
    assert cfg.train.amp == (flags[1] if flags[:1] == ["--amp"] else "bf16")
    assert cfg.typed.bn_path.startswith("plain (--fused-bn auto: ")
    assert re.search(reason, cfg.typed.bn_path), cfg.typed.bn_path


def test_auto_under_sync_bn_or_cudnn_bn_takes_their_path():
    cfg = resolved(["--data", "/d", "--sync-bn"], world=2)
    assert path(cfg) == ("off", "bf16") and "--sync-bn" in cfg.typed.bn_path
    cfg = resolved(["--data", "/d", "--cudnn-bn"])
    assert path(cfg) == ("off", "bf16") and cfg.model.cudnn_bn
    assert cfg.typed.bn_path == "cuDNN's BatchNorm kernels (--cudnn-bn)"


def test_auto_on_the_cpu_is_the_plain_path_without_amp():
    notes = []
    cfg = resolved(["--data", "/d"], cuda=False, notes=notes)
    assert path(cfg) == ("off", "off")
    assert cfg.typed.bn_path == "plain (--fused-bn auto: on the CPU)"
    assert notes == []


def test_an_explicit_amp_beside_auto_is_kept():
    assert path(resolved(["--data", "/d", "--amp", "fp16"])) == ("on", "fp16")
    declined = cudnn_takes(declined=[STEM_LIKE])
    assert path(resolved(["--data", "/d", "--amp", "fp16"], fused=declined)) == ("off", "fp16")
    assert path(resolved(["--data", "/d"], fused=declined)) == ("off", "bf16")


@pytest.mark.parametrize(
    "flags, fused, message",
    [
        ([], cudnn_takes(declined=[STEM_LIKE]), "--fused-bn on: cuDNN 9.19 .* 7x7 conv 3->64 .*"
         "would run the plain-PyTorch reference. Use --fused-bn auto"),
        ([], NO_FRONTEND, "--fused-bn on: the cuDNN frontend is not installed"),
        (["--amp", "bf16"], None, "--fused-bn trains in fp16 .* not --amp bf16"),
        (["--sync-bn"], None, "cannot synchronise them: leave out --sync-bn or --fused-bn"),
        (["--no-channels-last"], None, "take NHWC tensors: leave out --no-channels-last"),
        (["--deterministic"], None, r"atomic adds .* leave out --deterministic or --fused-bn"),
        (["--cudnn-bn"], None, "two ways to run BatchNorm: choose one"),
    ],
)  # fmt: skip
def test_on_insists_on_the_fused_path_and_refuses_what_cannot_run(flags, fused, message):
    world = 2 if "--sync-bn" in flags else 1
    with pytest.raises(UserError, match=message):
        resolved(["--data", "/d", "--fused-bn", "on", *flags], fused=fused, world=world)


def test_on_runs_in_fp16_on_a_gpu_and_as_a_reference_on_the_cpu():
    cfg = resolved(["--data", "/d", "--fused-bn"])  # the bare flag is "on"
    assert path(cfg) == ("on", "fp16")
    assert cfg.typed.bn_path == "folded into the convolutions (--fused-bn on)"
    notes = []
    cfg = resolved(["--data", "/d", "--fused-bn", "on"], cuda=False, notes=notes)
    assert path(cfg) == ("on", "off") and "plain PyTorch (a reference" in notes[0]


def test_off_is_the_plain_path():
    for flags in (["--fused-bn", "off"], ["--no-fused-bn"]):
        cfg = resolved(["--data", "/d", *flags], fused=NO_FRONTEND)
        assert path(cfg) == ("off", "bf16") and cfg.typed.bn_path == "plain (--fused-bn off)"


@pytest.mark.parametrize("written, read", [("true", "on"), ("false", "off"), ("auto", "auto")])
def test_yaml_takes_the_switch_as_a_boolean_or_a_word(tmp_path, written, read):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  fused_bn: {written}\n")
    assert parse_args(["--config", str(recipe)], True)[0].model.fused_bn == read


def test_the_resolved_config_records_the_path_taken(tmp_path):
    cfg = resolved(["--data", "/d"])
    save_resolved(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["fused_bn"] == "on" and saved["train"]["amp"] == "fp16"
    # the file says on: reproducing the run insists on the fused path, it does not decide again
    with pytest.raises(UserError, match="--fused-bn on: the cuDNN frontend is not installed"):
        resolved(["--config", str(tmp_path / "config.yaml")], fused=NO_FRONTEND)
    assert path(resolved(["--config", str(tmp_path / "config.yaml")])) == ("on", "fp16")


def test_cudnn_bn_runs_in_bf16_or_fp16_and_refuses_what_it_cannot_run(monkeypatch):
    from fasttrain.model.cudnn import graph as cudnn_graph

    monkeypatch.setattr(cudnn_graph, "available", lambda: True)
    assert path(resolved(["--data", "/d", "--cudnn-bn"])) == ("off", "bf16")
    assert resolved(["--data", "/d", "--cudnn-bn", "--amp", "fp16"]).train.amp == "fp16"
    refusals = {
        ("--amp", "off"): "bf16 or fp16: use --amp bf16 or fp16 .* not --amp off",
        ("--fused-bn",): "two ways to run BatchNorm: choose one",
        ("--sync-bn",): "cannot synchronise them: leave out --sync-bn or --cudnn-bn",
        ("--deterministic",): "no fixed order .* leave out --deterministic or --cudnn-bn",
        ("--no-channels-last",): "take NHWC tensors: leave out --no-channels-last",
    }
    for extra, message in refusals.items():
        with pytest.raises(UserError, match=message):
            world = 2 if "--sync-bn" in extra else 1
            resolved(["--data", "/d", "--cudnn-bn", *extra], world=world)
    monkeypatch.setattr(cudnn_graph, "available", lambda: False)
    with pytest.raises(UserError, match="--cudnn-bn needs the cuDNN frontend"):
        resolved(["--data", "/d", "--cudnn-bn"])
    notes = []
    cfg = resolved(["--data", "/d", "--cudnn-bn"], cuda=False, notes=notes)
    assert cfg.train.amp == "off" and "plain PyTorch (a reference" in notes[0]
