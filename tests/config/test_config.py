import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fasttrain.config import OPTIONS, SECTIONS, Config
from fasttrain.config.cli import build_parser, load_yaml, parse_args, save_resolved
from fasttrain.config.parse import inductor_options
from fasttrain.config.paths import config_dir
from fasttrain.dist.state import DistState
from fasttrain.errors import UserError
from fasttrain.run.resolve import FASTEST_COMPILE_MODE, resolve
from fasttrain.run.runs import place_run
from fasttrain.step.step import compile_kwargs


def launch(cuda: bool = True, world: int = 1, nodes: int = 1) -> DistState:
    """The distributed state of rank 0 of a launch, on a GPU or the CPU (no process group)."""
    device = torch.device("cuda" if cuda else "cpu", 0 if cuda else None)
    return DistState(0, 0, world, device, local_world_size=world // nodes)


def cudnn_takes(declined=(), unavailable=None):
    """A stand-in for ``fused_support.check``: cuDNN takes every convolution but ``declined``
    (or, with ``unavailable``, is not there to ask)."""
    from fasttrain.model.fused_support import ConvShape, FusedSupport

    shapes = (ConvShape((256, 64, 56, 56), (64, 64, 3, 3), 1, 1), *declined)
    return lambda *args: FusedSupport(shapes, tuple(declined), unavailable, 91900)


def resolved(
    argv, cuda=True, world=1, gpus=None, cpus=2, dali=True, notes=None, fused=None, nodes=1
) -> Config:
    """``argv`` resolved as a launch on a GPU (an H200 whose cuDNN takes every fused
    convolution, unless ``fused`` says otherwise) or on the CPU."""
    cfg = parse_args(argv, cuda_available=cuda)[0]
    gpus = (max(world, 1) if cuda else 0) if gpus is None else gpus
    fused = fused or cudnn_takes()
    resolve(cfg, launch(cuda, world, nodes), gpus=gpus, cpus=cpus, dali=dali, notes=notes,
            fused_support=fused)  # fmt: skip
    place_run(cfg, [] if notes is None else notes)
    return cfg


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return p


def test_defaults_with_data_match_the_dataclasses():
    cfg, notes = parse_args(["--data", "/d"], cuda_available=True)
    expected = Config()
    expected.data.path = "/d"
    assert cfg == expected
    assert notes == []


def test_flags_override_the_recipe_which_overrides_defaults(tmp_path):
    recipe = write(tmp_path, "train:\n  batch_size: 64\n  epochs: 3\noptim:\n  lr: 0.5\n")
    cfg, _ = parse_args(
        [
            "--config",
            str(recipe),
            "--data",
            "/d",
            "--batch-size",
            "32",
            "--no-channels-last",
            "--amp",
            "fp16",
        ],
        cuda_available=True,
    )
    assert cfg.train.batch_size == 32  # flag beats recipe
    assert cfg.train.epochs == 3  # recipe beats default
    assert cfg.optim.lr == 0.5
    assert cfg.optim.momentum == 0.9  # default
    assert cfg.model.channels_last is False
    assert cfg.train.amp == "fp16"


def test_every_field_declares_its_option_once():
    keys = {o.key for o in OPTIONS}
    fields = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert keys == fields
    assert len({o.flag for o in OPTIONS}) == len(OPTIONS)
    assert all(o.help and o.type in (int, float, str, bool) for o in OPTIONS)
    assert next(o for o in OPTIONS if o.key == "train.batch_size").type is int


def test_the_schema_imports_nothing_of_the_package_and_parsing_no_torch():
    code = (
        "import sys, fasttrain.config as c; "
        "print(sorted(m for m in sys.modules if m.startswith('fasttrain'))); "
        "import fasttrain.config.cli; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, torch_loaded = out.stdout.split("\n")[:2]
    outside = [m for m in eval(loaded) if m != "fasttrain" and not m.startswith("fasttrain.config")]
    assert outside == [] and "fasttrain.config.schema" in loaded
    assert torch_loaded == "False"


def test_flags_that_measured_no_gain_are_gone():
    for flag in ("--dali-handoff", "--dali-pipelines", "--no-dali-antialias", "--log-sync"):
        with pytest.raises(SystemExit) as e:
            parse_args(["--data", "/d", flag, *(["2"] if "pipelines" in flag else [])], True)
        assert e.value.code == 2, flag
    with pytest.raises(SystemExit):
        parse_args(["--data", "/d", "--ddp-compile", "compiled-autograd"], True)


def test_help_documents_every_flag_named_as_the_references_do():
    text = build_parser().format_help()
    for opt in OPTIONS:
        assert opt.flag in text
    for flag in [
        "--config",
        "--data",
        "--arch",
        "--num-classes",
        "--image-size",
        "--loader",
        "--workers",
        "--epochs",
        "--max-steps",
        "--batch-size",
        "--lr",
        "--momentum",
        "--weight-decay",
        "--no-bn-weight-decay",
        "--warmup-epochs",
        "--lr-schedule",
        "--lr-step-epochs",
        "--label-smoothing",
        "--accum-steps",
        "--amp",
        "--channels-last",
        "--no-channels-last",
        "--compile",
        "--compile-mode",
        "--inductor-options",
        "--cuda-graphs",
        "--output-dir",
        "--resume",
        "--seed",
        "--log-every",
        "--eval-every",
        "--ckpt-every-steps",
    ]:
        assert flag in text, flag
    flat = " ".join(text.split())  # argparse wraps the description
    assert "python -m fasttrain env" in flat and "python -m fasttrain check-data DIR" in flat


@pytest.mark.parametrize(
    "text, message",
    [
        ("trian:\n  epochs: 1\n", "unknown section 'trian'"),
        ("train:\n  epoch: 1\n", "unknown key 'train.epoch'"),
        ("train:\n  batch_size: big\n", "train.batch_size: expected an integer"),
        ("train:\n  batch_size: 0\n", "train.batch_size must be at least 1"),
        ("optim:\n  lr_schedule: linear\n", "'linear' is not allowed; choose one of step, cosine"),
        ("model:\n  channels_last: 3\n", "model.channels_last: expected true or false"),
        ("train: 5\n", "section 'train' must map keys to values"),
        ("- a\n- b\n", "expected sections"),
        ("train: [\n", "not valid YAML"),
    ],
)
def test_bad_recipe_names_the_key_and_what_is_allowed(tmp_path, text, message):
    recipe = write(tmp_path, text)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
        parse_args(["--config", str(recipe), "--data", "/d"], cuda_available=False)
    assert "\n" not in str(e.value)
    assert str(recipe) in str(e.value) or "not valid YAML" in str(e.value)


def test_unknown_key_lists_the_allowed_keys(tmp_path):
    recipe = write(tmp_path, "train:\n  epoch: 1\n")
    with pytest.raises(UserError, match="allowed in train: epochs, max_steps"):
        load_yaml(recipe)


def test_bad_flag_values_exit_2(capsys):
    for argv in (["--batch-size", "0"], ["--lr-schedule", "linear"], ["--epochs", "x"]):
        if argv[0] == "--batch-size":
            with pytest.raises(UserError, match="--batch-size must be at least 1"):
                parse_args(["--data", "/d", *argv], cuda_available=False)
        else:
            with pytest.raises(SystemExit) as e:
                parse_args(["--data", "/d", *argv], cuda_available=False)
            assert e.value.code == 2


def test_no_data_picks_the_sample_recipe_for_the_hardware():
    gpu, notes = parse_args([], cuda_available=True)
    assert notes == []
    assert gpu.train.epochs == 8 and gpu.data.image_size == 224
    cpu, notes = parse_args([], cuda_available=False)
    assert cpu.data.image_size == 64 and cpu.train.max_steps == 60
    assert "no CUDA GPU found" in notes[0]
    assert cpu.data.path is None  # the sample dataset is built by __main__


def test_resolve_fills_auto_values_for_the_device():
    cfg = resolved(["--data", "/d"], cuda=False, cpus=2)
    assert cfg.train.device == "cpu" and cfg.train.amp == "off" and cfg.data.workers == 2
    assert cfg.run.output_dir.startswith("runs/")
    cfg = resolved(["--data", "/d", "--name", "x"], cuda=True, cpus=64)
    assert cfg.train.device == "cuda" and cfg.train.amp == "fp16" and cfg.data.workers == 16
    assert cfg.model.fused_bn == "on"  # the fused path, where cuDNN takes every layer
    assert cfg.run.output_dir == "runs/x"
    with pytest.raises(UserError, match="--amp fp16 needs a CUDA GPU"):
        resolved(["--data", "/d", "--amp", "fp16"], cuda=False)


def test_device_cuda_without_a_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="--device cuda: no CUDA GPU"):
        DistState.from_env("cuda")
    assert DistState.from_env("auto").device.type == "cpu"


def test_resolved_config_round_trips_through_config(tmp_path):
    cfg = resolved(["--data", "/d", "--lr", "0.3", "--max-steps", "7"], cuda=False)
    save_resolved(cfg, tmp_path / "config.yaml")
    again, _ = parse_args(["--config", str(tmp_path / "config.yaml")], cuda_available=False)
    assert again == cfg


def test_shipped_recipes_are_valid():
    names = sorted(p.name for p in config_dir().glob("*.yaml"))
    assert names == [
        "resnet50_fast.yaml",
        "resnet50_imagenet.yaml",
        "resnet50_mlperf.yaml",
        "resnet50_tv_v2.yaml",
        "sample.yaml",
        "sample_cpu.yaml",
    ]
    for name in names:
        values = load_yaml(config_dir() / name)
        assert values
        resolved(["--config", str(config_dir() / name), "--data", "/d"])  # resolves too
    v2 = resolved(["--config", str(config_dir() / "resnet50_tv_v2.yaml"), "--data", "/d"])
    # torchvision's recipe at its own global batch (8 x 128): its LR of 0.5
    from fasttrain.step.optim import build_schedule

    assert build_schedule(v2.optim, 1024, 1251, 600).peak_lr == pytest.approx(0.5)
    assert (v2.data.image_size, v2.data.val_resize_size, v2.data.val_crop_size) == (176, 232, 224)
    # FFCV's 40-epoch ResNet-50 at its global batch (8 x 512): its LR of 1.7, its ramp
    fast = resolved(["--config", str(config_dir() / "resnet50_fast.yaml"), "--data", "/d"])
    ffcv = build_schedule(fast.optim, 4096, 312, 40)
    assert ffcv.peak_lr == pytest.approx(1.7) and ffcv.kind == "poly" and ffcv.power == 1
    from fasttrain.config.resolution import train_resolution

    ramp = train_resolution(fast.data)
    assert [ramp.size_at(e) for e in (0, 29, 30, 31, 32, 33, 34, 39)] == [160] * 4 + [192] * 4
    assert (fast.data.val_resize_size, fast.data.val_crop_size) == (292, 256)
    # NVIDIA's MLPerf DGX H100 submission at its global batch (8 x 400): LARS at LR 11.0
    mlperf = resolved(["--config", str(config_dir() / "resnet50_mlperf.yaml"), "--data", "/d"])
    assert mlperf.optim.opt == "lars" and mlperf.train.batch_size == 400
    lars = build_schedule(mlperf.optim, 3200, 400, 37)
    assert lars.peak_lr == pytest.approx(11.0) and lars.power == 2
    imagenet = yaml.safe_load((config_dir() / "resnet50_imagenet.yaml").read_text())
    assert imagenet["train"]["batch_size"] == 256 and imagenet["train"]["epochs"] == 90
    assert imagenet["optim"]["lr"] == 0.1 and imagenet["optim"]["warmup_epochs"] == 5
    assert imagenet["optim"]["label_smoothing"] == 0.1


def test_auto_loader_prefers_dali_on_a_gpu_and_says_when_it_cannot(monkeypatch):
    import fasttrain.data.dali_install as dali_module

    def loader(cuda, dali):
        notes = []
        cfg = resolved(["--data", "/d"], cuda=cuda, dali=dali, notes=notes)
        return cfg.data.loader, notes

    installed = {"nvidia-dali-cuda130": "2.4.0"}
    monkeypatch.setattr(dali_module, "installed_dali_builds", lambda: installed)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert loader(True, True) == ("dali", [])
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a DALI for another CUDA: said at start
    chosen, notes = loader(True, True)
    assert chosen == "dali" and notes == [
        "DALI (nvidia-dali-cuda130) is built for another CUDA major version than torch (CUDA "
        "12.8); its GPU decode may fail to load: pip uninstall -y nvidia-dali-cuda130 && pip "
        "install nvidia-dali-cuda120"
    ]
    chosen, notes = loader(True, False)
    assert chosen == "torchvision" and "pip install nvidia-dali-cuda130 (for a CUDA 13" in notes[0]
    assert loader(False, True) == ("torchvision", [])  # no GPU: the CPU reference loader
    explicit = resolved(["--data", "/d", "--loader", "torchvision"], dali=True)
    assert explicit.data.loader == "torchvision"  # explicit wins


def test_hw_decoder_load_is_a_fraction(tmp_path):
    with pytest.raises(UserError, match="--dali-hw-decoder-load must be at most 1"):
        parse_args(["--data", "/d", "--dali-hw-decoder-load", "1.5"], cuda_available=True)


def _resolved(*flags, cuda=True, notes=None, world=1, gpus=None):
    return resolved(["--data", "/d", *flags], cuda=cuda, notes=notes, world=world, gpus=gpus)


def test_compile_settings_are_checked_together():
    t = _resolved(
        "--compile", "--inductor-options", "conv_1x1_as_mm,max_autotune_gemm_backends=ATEN,TRITON"
    ).train
    assert inductor_options(t.inductor_options) == {
        "coordinate_descent_tuning": True,  # --compile-mode auto's, on a GPU
        "conv_1x1_as_mm": True,
        "max_autotune_gemm_backends": "ATEN,TRITON",
    }
    default = _resolved("--compile", "--compile-mode", "default").train.inductor_options
    assert inductor_options(default) == {}
    assert _resolved().train.inductor_options is None  # nothing to compile, nothing claimed
    for flags, message in [
        (["--compile-mode", "max-autotune-no-cudagraphs"], "add --compile"),
        (["--inductor-options", "conv_1x1_as_mm"], "add --compile"),
        (["--compile", "--inductor-options", "conv_1x1_as_nn"], "'conv_1x1_as_nn' is not"),
        (["--compile", "--inductor-options", "conv_1x1_as_mm=7"], "should be a bool"),
        (["--compile", "--cuda-graphs", "--compile-mode", "reduce-overhead"], "cannot nest"),
    ]:
        with pytest.raises(UserError, match=message):
            _resolved(*flags)


def test_cuda_graphs_on_the_cpu_warns_once_and_trains_without():
    notes = []
    cfg = _resolved("--cuda-graphs", cuda=False, notes=notes)
    assert cfg.train.cuda_graphs is False  # the saved config says what actually ran
    assert notes == ["--cuda-graphs needs a CUDA GPU: training without CUDA graphs"]
    assert _resolved("--cuda-graphs", "--compile").train.cuda_graphs is True


def test_compile_kwargs_merge_a_mode_with_options():
    assert compile_kwargs("default", {}) == {}
    assert compile_kwargs("max-autotune-no-cudagraphs", {}) == {
        "mode": "max-autotune-no-cudagraphs"
    }
    merged = compile_kwargs("max-autotune-no-cudagraphs", {"conv_1x1_as_mm": True})
    assert merged["options"]["max_autotune"] is True and merged["options"]["conv_1x1_as_mm"]
    assert merged["options"].get("triton.cudagraphs", False) is False


def test_auto_compile_mode_is_the_fastest_measured_except_where_tuning_outlasts_the_run():
    def chosen(*flags, cuda=True, sample=False):
        t = resolved([*(() if sample else ("--data", "/d")), *flags], cuda=cuda).train
        return t.compile_mode, inductor_options(t.inductor_options)

    tuned = {"coordinate_descent_tuning": True}
    assert chosen("--compile") == (FASTEST_COMPILE_MODE, tuned)
    assert chosen("--compile", cuda=False) == ("default", {})
    assert chosen("--compile", sample=True) == ("default", {})  # the built-in demo
    assert _resolved().train.compile_mode == "default"  # no --compile: the neutral value
    # an explicit mode is taken as it is, with no tuning added
    assert chosen("--compile", "--compile-mode", "default") == ("default", {})
    max_autotune = chosen("--compile", "--compile-mode", "max-autotune-no-cudagraphs")
    assert max_autotune == ("max-autotune-no-cudagraphs", {})
    # auto adds the tuning to --inductor-options, unless they set it or say none
    assert chosen("--compile", "--inductor-options", "conv_1x1_as_mm") == (
        "default",
        {**tuned, "conv_1x1_as_mm": True},
    )
    off = chosen("--compile", "--inductor-options", "coordinate_descent_tuning=False")
    assert off == ("default", {"coordinate_descent_tuning": False})
    assert chosen("--compile", "--inductor-options", "none") == ("default", {})


def test_parallel_settings_are_checked_against_the_launch():
    assert _resolved(world=1).train.strategy == "none"
    assert _resolved(world=4).train.strategy == "ddp"
    assert _resolved("--strategy", "ddp", world=1).train.strategy == "none"
    assert _resolved("--strategy", "dp", gpus=2).train.strategy == "dp"
    for flags, world, gpus, message in [
        (["--strategy", "none"], 2, 2, "each process would otherwise train its own copy"),
        (["--strategy", "dp", "--cuda-graphs"], 1, 2, "cannot run --cuda-graphs"),
        (["--strategy", "dp", "--compile"], 1, 2, "cannot run --compile"),
        (["--strategy", "dp"], 1, 1, "it needs at least 2"),
    ]:
        with pytest.raises(UserError, match=message):
            _resolved(*flags, world=world, gpus=gpus)
    with pytest.raises(UserError, match="needs CUDA GPUs"):
        _resolved("--strategy", "dp", cuda=False)


def test_triton_kernels_are_named_checked_and_need_a_gpu():
    t = _resolved("--triton-kernels", "xent,sgd", "--loader", "synthetic").train
    assert t.triton_kernels == "sgd,xent"  # canonical order
    for flags, cuda, message in [
        (["--triton-kernels", "softmax"], True, "unknown softmax"),
        (["--triton-kernels", "xent"], False, "need a CUDA GPU"),
        (["--triton-kernels", "normalize", "--loader", "dali"], True, "torchvision loader's"),
    ]:
        with pytest.raises(UserError, match=message):
            _resolved(*flags, cuda=cuda)
    with pytest.raises(UserError, match="flat buffer"):
        _resolved("--triton-kernels", "sgd", world=2)


@pytest.mark.parametrize(
    "flags, cuda, world, expected",
    [
        (["--loader", "dali"], True, 1, "maxpool"),  # sgd and xent: not faster in the step
        (["--loader", "dali", "--no-channels-last"], True, 1, "none"),  # maxpool wants NHWC
        (["--loader", "torchvision"], True, 1, "normalize,maxpool"),
        (["--loader", "torchvision"], True, 2, "normalize,maxpool"),  # DDP owns the gradients
        (["--loader", "torchvision"], False, 1, "none"),  # the CPU: no Triton
        (["--triton-kernels", "xent", "--loader", "dali"], True, 2, "xent"),  # as asked
        (["--loader", "dali", "--opt", "lars"], True, 1, "maxpool"),  # foreach LARS: faster
        (["--loader", "dali", "--opt", "lars"], True, 2, "maxpool"),  # DDP: foreach LARS
        (["--opt", "lars"], False, 1, "none"),  # the CPU: foreach LARS
    ],
)
def test_auto_kernels_are_the_measured_faster_ones_where_they_apply(flags, cuda, world, expected):
    assert _resolved(*flags, cuda=cuda, world=world).train.triton_kernels == expected


def test_auto_batch_size_needs_a_gpu():
    assert _resolved("--batch-size", "auto").train.batch_size is None
    with pytest.raises(UserError, match="--batch-size auto measures GPU memory"):
        _resolved("--batch-size", "auto", cuda=False)


def test_ddp_bucket_size_auto_is_100_mb_on_one_node_and_25_across_nodes(monkeypatch):
    from fasttrain.config import TrainConfig
    from fasttrain.dist.parallel import ddp_bucket_cap_mb

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    here = DistState.from_env("cpu")  # one process: no process group
    assert here.one_node and here.local_world_size == 1
    two_nodes = launch(False, world=4, nodes=2)
    assert not two_nodes.one_node
    assert ddp_bucket_cap_mb(TrainConfig(), launch(False, world=2)) == 100
    assert ddp_bucket_cap_mb(TrainConfig(), two_nodes) == 25
    assert ddp_bucket_cap_mb(TrainConfig(bucket_cap_mb=40), two_nodes) == 40
    for flag, want in (("auto", None), ("50", 50)):
        cfg, _ = parse_args(["--data", "/d", "--bucket-cap-mb", flag], cuda_available=True)
        assert cfg.train.bucket_cap_mb == want
    # resolved for DDP, so config.yaml and the compile cache's key hold the number
    assert _resolved(world=2).train.bucket_cap_mb == 100
    assert resolved(["--data", "/d"], world=4, nodes=2).train.bucket_cap_mb == 25
    assert _resolved("--bucket-cap-mb", "40", world=2).train.bucket_cap_mb == 40
    assert _resolved().train.bucket_cap_mb is None  # one process: no DDP


def test_ddp_only_settings_without_ddp_are_named_in_a_note():
    notes: list[str] = []
    cfg = _resolved("--ddp-comm-hook", "bf16", "--sync-bn", notes=notes)
    assert cfg.train.strategy == "none" and cfg.train.ddp_comm_hook == "bf16"
    assert notes == [
        "--sync-bn, --ddp-comm-hook: unused with --strategy none (1 process): DDP's own"
    ]
    quiet: list[str] = []  # with DDP they are used, and defaults are never named
    _resolved("--ddp-comm-hook", "bf16", world=2, notes=quiet)
    _resolved(notes=quiet)
    assert quiet == []
    with pytest.raises(SystemExit) as e:  # an unknown hook is refused by the parser
        parse_args(["--data", "/d", "--ddp-comm-hook", "powersgd"], True)
    assert e.value.code == 2


def test_dali_and_torch_cuda_versions_are_checked_against_each_other():
    from fasttrain.data.dali_install import dali_cuda_mismatch

    assert dali_cuda_mismatch("13.0", ["nvidia-dali-cuda130"]) is None
    assert dali_cuda_mismatch("12.4", ["nvidia-dali-cuda120"]) is None
    assert dali_cuda_mismatch(None, ["nvidia-dali-cuda120"]) is None  # a CPU build of torch
    assert dali_cuda_mismatch("13.0", []) is None  # no pip-installed DALI
    assert "pip uninstall -y nvidia-dali-cuda120 && pip install nvidia-dali-cuda130" in (
        dali_cuda_mismatch("13.0", ["nvidia-dali-cuda120"])
    )
    both = dali_cuda_mismatch("13.0", ["nvidia-dali-cuda130", "nvidia-dali-cuda120"])
    assert "share one module" in both and "pip uninstall -y nvidia-dali-cuda120" in both
    assert "pip install --force-reinstall nvidia-dali-cuda130" in both


def test_the_reference_trainers_flags_mean_the_same_here():
    """torchvision's train.py and timm spellings set the same config keys as fasttrain's own,
    on the command line; torchvision's scheduler names are taken in YAML too."""
    theirs = parse_args(
        ["--data", "/d", "--model", "resnet18", "-b", "64", "-j", "4", "--lr-warmup-epochs", "5",
         "--lr-scheduler", "cosineannealinglr", "--lr-step-size", "20", "--train-crop-size", "176",
         "--print-freq", "50", "--smoothing", "0.1"],
        cuda_available=True,
    )[0]  # fmt: skip
    ours = parse_args(
        ["--data", "/d", "--arch", "resnet18", "--batch-size", "64", "--workers", "4",
         "--warmup-epochs", "5", "--lr-schedule", "cosine", "--lr-step-epochs", "20",
         "--image-size", "176", "--log-every", "50", "--label-smoothing", "0.1"],
        cuda_available=True,
    )[0]  # fmt: skip
    assert theirs == ours
    assert parse_args(["--data", "/d", "--sched", "steplr"], True)[0].optim.lr_schedule == "step"


def test_yaml_takes_torchvisions_scheduler_names(tmp_path):
    cfg, _ = parse_args(
        ["--config", str(write(tmp_path, "optim:\n  lr_schedule: CosineAnnealingLR\n"))], True
    )
    assert cfg.optim.lr_schedule == "cosine"


@pytest.mark.parametrize("scaling, peak", [("linear", 0.4), ("none", 0.1)])
def test_lr_scaling_reads_lr_per_256_images_or_as_the_rate_itself(scaling, peak):
    from fasttrain.step.optim import build_schedule

    cfg = parse_args(["--data", "/d", "--lr", "0.1", "--lr-scaling", scaling], True)[0]
    schedule = build_schedule(cfg.optim, global_batch=1024, steps_per_epoch=10, epochs=2)
    assert schedule.peak_lr == pytest.approx(peak)


def test_a_schedules_own_settings_with_another_schedule_are_named():
    notes = []
    resolved(["--data", "/d", "--lr-schedule", "cosine", "--lr-gamma", "0.5", "--lr-power", "3"],
             notes=notes)  # fmt: skip
    assert "--lr-gamma, --lr-power: unused with --lr-schedule cosine" in notes
    notes = []
    resolved(["--data", "/d", "--lr-schedule", "poly", "--lr-power", "3"], notes=notes)
    assert notes == []


def test_model_ema_settings_without_model_ema_are_named():
    notes = []
    resolved(["--data", "/d", "--model-ema-decay", "0.99"], notes=notes)
    assert "--model-ema-decay: unused without --model-ema" in notes


def test_mixing_settings_without_an_alpha_are_named():
    notes = []
    resolved(["--data", "/d", "--mixup-prob", "0.5"], notes=notes)
    assert "--mixup-prob: unused without --mixup-alpha or --cutmix-alpha" in notes
    notes = []
    resolved(["--data", "/d", "--cutmix-alpha", "1.0", "--mixup-prob", "0.5"], notes=notes)
    assert notes == []


def test_auto_augment_needs_images():
    with pytest.raises(UserError, match="--loader synthetic has no images to augment"):
        resolved(["--loader", "synthetic", "--auto-augment", "ta_wide"])
