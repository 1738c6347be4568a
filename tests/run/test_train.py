"""End to end on the CPU: learning, eager vs compiled, exact resume, and the run directory."""

import copy
import json
import math
import os
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from fasttrain.data.folder import scan_folder
from fasttrain.metrics.log import Metrics
from fasttrain.metrics.meter import DeviceMeter, StepTimer
from fasttrain.metrics.rates import progress_text
from fasttrain.model.build import build_model
from fasttrain.run import checkpoint as ckpt
from fasttrain.step.step import build_step
from tests.conftest import (
    FAST,
    assert_exact_resume,
    constant_lr,
    last_checkpoint,
    train_loader,
)

params = last_checkpoint


def test_tiny_run_learns_and_writes_its_run_directory(run, tiny_data, tmp_path):
    out = tmp_path / "run"
    code, err = run(
        "--data",
        tiny_data,
        *FAST,
        "--epochs",
        "6",
        "--lr",
        "1.6",  # peak 0.1 at batch 16; zero-init residual blocks (the default) train well there
        "--warmup-epochs",
        "1",
        "--lr-schedule",
        "cosine",
        "--log-every",
        "6",
        "--output-dir",
        out,
    )
    assert code == 0, err
    train = run.records(out, "train")
    losses = [r["loss"] for r in train]
    assert len(train) == 12  # 72 steps, logged every 6
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    val = run.records(out, "val")
    assert [v["epoch"] for v in val] == list(range(6))
    assert val[-1]["images"] == 100
    # chance is 25% (4 classes); with 100 images 45% is ~5 standard deviations above it
    # (57-77% seen over seeds 0-3)
    assert val[-1]["top1"] > 45.0, val
    # run directory: resolved config, per-rank log, TensorBoard scalars, checkpoints, summary
    assert (out / "config.yaml").is_file() and (out / "log-rank0.txt").is_file()
    # the LR the run uses, and how it follows from --lr
    assert "peak LR 0.1 (--lr 1.6 x global batch 16 / 256)" in (out / "log-rank0.txt").read_text()
    tb = EventAccumulator(str(out / "tb"))
    tb.Reload()
    tags = set(tb.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "perf/img_per_s",
        "perf/img_per_s_per_gpu",
        "perf/loader_wait_frac",
        "perf/copy_in_frac",
        "val/top1",
        "val/top5",
    } <= tags
    assert len(tb.Scalars("train/loss")) == 12
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 72 and summary["img_per_s"] > 0
    assert summary["val"]["top1"] == val[-1]["top1"]
    assert [p.name for p in ckpt.list_checkpoints(out)] == [
        "ckpt-00000072.pt",
        "ckpt-00000060.pt",
        "ckpt-00000048.pt",
    ]  # keep the last 3
    state = params(out)
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in state["model"])
    assert state["loader"] == {"epoch": 6, "start_batch": 0, "steps_per_epoch": 12}
    assert state["world_size"] == 1 and state["global_batch"] == 16


def test_a_log_step_writes_the_interval_before_it_and_log_sync_writes_its_own(tmp_path):
    """Metrics on the CPU, three intervals of 10 steps (loss = the step, 2 of 4 correct, a stop
    request in the second): by default each log step writes the interval before it and
    ``settle`` the last; with ``sync`` each its own. The same records either way."""
    cpu = torch.device("cpu")
    written, records = {}, {}
    for sync in (False, True):
        out = tmp_path / f"sync-{sync}"
        out.mkdir()
        metrics = Metrics(
            out, is_main=True, total_steps=30, start_step=0, world_size=1, device=cpu, sync=sync
        )
        meter = DeviceMeter(cpu)
        written[sync] = []
        for step in range(1, 31):
            meter.add_device(torch.tensor(float(step)), torch.tensor(2.0), 4)
            meter.samples += 4
            metrics.step_done(4, 0.0, 0.0)
            if step % 10 == 0:
                logged = metrics.log_train(step, 0, meter, 0.1, stop=step == 20)
                written[sync].append([(e.record["step"], e.stop) for e in logged])
        written[sync].append([(e.record["step"], e.stop) for e in metrics.settle()])
        metrics.close()
        records[sync] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert written[False] == [[], [(10, False)], [(20, True)], [(30, False)]]
    assert written[True] == [[(10, False)], [(20, True)], [(30, False)], []]
    for sync in (False, True):
        assert [(r["step"], r["loss"], r["top1"]) for r in records[sync]] == [
            (10, 5.5, 50.0),
            (20, 15.5, 50.0),
            (30, 25.5, 50.0),
        ]
        assert all(r["img_per_s"] > 0 and r["nonfinite_losses"] == 0 for r in records[sync])
    # an interval in flight can be dropped unread (--on-nan skip after a restore)
    out = tmp_path / "dropped"
    out.mkdir()
    metrics = Metrics(out, is_main=True, total_steps=2, start_step=0, world_size=1, device=cpu)
    meter = DeviceMeter(cpu)
    meter.add_device(torch.tensor(1.0), torch.tensor(1.0), 4)
    meter.samples += 4
    assert metrics.log_train(1, 0, meter, 0.1) == []
    assert metrics.discard_pending() == 1 and metrics.settle() == []
    metrics.close()
    assert (out / "metrics.jsonl").read_text() == ""


class _Mark:
    """A stand-in for a CUDA event: a time in ms."""

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, end: "_Mark") -> float:
        return end.ms - self.ms


def test_data_wait_is_the_hosts_share_and_gpu_idle_the_gpus(tmp_path):
    """On a GPU an interval is timed by events, over less time than the host spent in it when the
    host runs ahead: the loader wait and the copy-in are shares of the host's own time (at most
    the 10 and 5 ms it spent on them of the 20+ ms it slept here, not 200% of a 5 ms GPU
    interval), and each says its own per-step figure. The GPU's idle share is the
    interval less its steps' GPU time: 10 steps of 0.3 and 0.5 ms in turn in 5 ms, 20% idle, and
    their spread 0.1 ms. A step outside any interval (the first, which compiles) is not counted
    in the next one's GPU time."""
    cpu = torch.device("cpu")
    timer = StepTimer(cpu)
    metrics = Metrics(
        tmp_path, is_main=True, total_steps=10, start_step=0, world_size=1, device=cpu, timer=timer
    )
    metrics.clock.seconds = lambda start, end: 0.005  # the interval as a GPU timed it
    timer.pairs.append((_Mark(0), _Mark(4000)))  # the first step, compiling
    metrics.restart_interval()
    meter = DeviceMeter(cpu)
    for step in range(1, 11):
        time.sleep(0.002)
        meter.add_device(torch.tensor(1.0), torch.tensor(1.0), 4)
        meter.samples += 4
        metrics.step_done(4, 0.001, 0.0005)
        timer.pairs.append((_Mark(step), _Mark(step + (0.3 if step % 2 else 0.5))))
    metrics.log_train(10, 0, meter, 0.1)
    (logged,) = metrics.settle()
    metrics.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record == logged.record
    assert 0 < record["loader_wait_frac"] <= 0.5 and 0 < record["copy_in_frac"] <= 0.25
    assert record["loader_wait_frac"] == pytest.approx(2 * record["copy_in_frac"])
    assert record["loader_wait_ms"] == pytest.approx(1.0)
    assert record["copy_in_ms"] == pytest.approx(0.5)
    assert record["gpu_step_ms"] == pytest.approx(0.4)
    assert record["gpu_step_ms_sd"] == pytest.approx(0.1)
    assert record["gpu_idle_frac"] == pytest.approx(0.2)


def test_the_progress_line_names_the_loader_only_when_the_run_waits_for_it():
    """A graphed run with DALI: the host waits in the loader almost all the time while the GPU
    is busy, which is not a bottleneck and is not shown. A starved GPU shows the host's time
    getting data, the loader's wait and the copy to the device apart; so does the CPU (no GPU
    figures), where the host itself does the work."""
    busy = {"gpu_idle_frac": 0.002, "loader_wait_frac": 0.97, "copy_in_frac": 0.01}
    busy["gpu_step_ms"] = 36.94
    assert progress_text(7250.4, busy) == "7,250 img/s, GPU busy 99.8% (36.9 ms/step)"
    starved = {"gpu_idle_frac": 0.3, "loader_wait_frac": 0.6, "copy_in_frac": 0.05}
    starved["gpu_step_ms"] = 30.0
    assert progress_text(5000, starved) == (
        "5,000 img/s, GPU busy 70.0% (30.0 ms/step), host waiting for the loader 60% and "
        "copying to the device 5% of the time"
    )
    cpu = {"gpu_idle_frac": None, "loader_wait_frac": 0.01, "copy_in_frac": 0.02}
    cpu["gpu_step_ms"] = None
    assert progress_text(123, cpu) == "123 img/s"
    assert progress_text(123, {**cpu, "copy_in_frac": 0.4}).endswith(
        "host waiting for the loader 1% and copying to the device 40% of the time"
    )


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.norm(a - b) / torch.norm(b)).item()


@pytest.mark.slow
def test_compiled_step_matches_eager_step_by_step(tiny_data):
    """The compiled step follows the eager trajectory, checked one step at a time.

    Free-running fp32 trajectories of this tiny model are chaotic: at 32 px, layer4's BatchNorm
    normalises 16 values per channel, and after 6 steps even eager fp32 sits a third of the whole
    update away from an fp64 run. So each step starts the compiled model from the eager model's
    exact state (weights, BN buffers, momentum) on the same batch, and the loss and the update must
    agree. Gradients are also held to an fp64 reference. Both fp32 paths carry up to ~2% error
    there (BN backward over tiny batches cancels; measured: eager 1e-5 / compiled 2.2% at 32 px,
    eager 1.2% / compiled 0.5% at 64 px), so the bound is 5%: a wrong gradient is off by O(1).
    """
    loader = train_loader(scan_folder(tiny_data).train)
    loader.set_epoch(0)
    batches = list(loader)[:6]
    torch.manual_seed(0)
    eager_model = build_model("resnet18", 4, True, torch.device("cpu"))
    models = {
        "eager": eager_model,
        "compiled": copy.deepcopy(eager_model),
        "fp64": copy.deepcopy(eager_model).double(),
    }
    opts = {
        k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
        for k, m in models.items()
    }
    steps = {
        k: build_step(
            model=m,
            optimizer=opts[k],
            criterion=nn.CrossEntropyLoss(label_smoothing=0.1),
            amp_dtype=None,
            scaler=None,
            schedule=constant_lr(0.01),
            compile=k == "compiled",
        )
        for k, m in models.items()
    }
    meter = DeviceMeter(torch.device("cpu"))

    # one backward from identical weights: compiled gradients as close to fp64 as eager's
    x, y = batches[0]
    grads = {}
    for k, m in models.items():
        loss, _ = steps[k].forward(x.double() if k == "fp64" else x, y)
        loss.backward()
        grads[k] = torch.cat([p.grad.double().flatten() for p in m.parameters()])
        m.zero_grad(set_to_none=False)
    for k in ("eager", "compiled"):
        assert rel(grads[k], grads["fp64"]) < 5e-2, k

    for x, y in batches:
        models["compiled"].load_state_dict(eager_model.state_dict())
        # deepcopy: load_state_dict would share eager's momentum tensors rather than copy them
        opts["compiled"].load_state_dict(copy.deepcopy(opts["eager"].state_dict()))
        before = flat(eager_model)
        losses = {}
        for k in ("eager", "compiled"):
            steps[k]([(x, y)], meter, 0)
            losses[k] = meter.flush()[0]
        assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5)
        update_e = flat(eager_model) - before
        update_c = flat(models["compiled"]) - before
        assert rel(update_c, update_e) < 5e-2, rel(update_c, update_e)


@pytest.mark.slow
def test_compile_flag_trains_and_saves_unprefixed_checkpoints(run, tiny_data, tmp_path):
    first = {}
    for mode, extra in (("eager", []), ("compiled", ["--compile"])):
        out = tmp_path / mode
        code, err = run(
            "--data",
            tiny_data,
            *FAST,
            "--epochs",
            "1",
            "--max-steps",
            "4",
            "--log-every",
            "1",
            "--output-dir",
            out,
            *extra,
        )
        assert code == 0, err
        losses = [r["loss"] for r in run.records(out, "train")]
        assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
        first[mode] = losses[0]
        assert run.records(out, "val")[-1]["images"] == 100
    assert first["compiled"] == pytest.approx(first["eager"], rel=1e-5)  # same weights, same batch
    state = params(tmp_path / "compiled")
    assert not any(k.startswith(("_orig_mod.", "module.")) for k in state["model"])
    text = (tmp_path / "compiled" / "log-rank0.txt").read_text()
    assert "step compiled, strategy none |" in text
    # the wait is announced before the first step, and its length said after
    announce = text.index("compiling the step (--compile-mode default): the first step waits")
    assert announce < text.index("(compiling it, and tuning if on)")
    assert "compiling the step" not in (tmp_path / "eager" / "log-rank0.txt").read_text()


@pytest.mark.parametrize(
    "flag, note",
    [
        ("--fused-bn", "--fused-bn on the CPU runs the fused decomposition"),
        ("--cudnn-bn", "--cudnn-bn on the CPU runs its BatchNorm op in plain PyTorch"),
    ],
)
def test_bn_paths_train_like_the_plain_model_and_save_torchvisions_state_dict(
    run, tiny_data, tmp_path, flag, note
):
    """--fused-bn and --cudnn-bn on the CPU run their references in plain PyTorch: from the same
    weights the losses follow the plain model's, and the checkpoint loads into torchvision's
    ResNet as it is."""
    losses = {}
    for name, extra in (("plain", []), ("path", [flag])):
        out = tmp_path / name
        code, err = run(
            "--data", tiny_data, *FAST, "--epochs", "1", "--max-steps", "4",
            "--log-every", "1", "--output-dir", out, *extra,
        )  # fmt: skip
        assert code == 0, err
        losses[name] = [r["loss"] for r in run.records(out, "train")]
    assert len(losses["path"]) == 4
    assert losses["path"][0] == pytest.approx(losses["plain"][0], rel=1e-5)
    assert losses["path"] == pytest.approx(losses["plain"], rel=1e-3)
    assert note in err
    # the start-up line names the BatchNorm path, and why --fused-bn auto took it
    line = "BatchNorm plain (--fused-bn auto: on the CPU), step eager"
    assert line in (tmp_path / "plain" / "log-rank0.txt").read_text()
    named = {"--fused-bn": "folded into the convolutions (--fused-bn on)",
             "--cudnn-bn": "cuDNN's BatchNorm kernels (--cudnn-bn)"}[flag]  # fmt: skip
    assert f"BatchNorm {named}, step eager" in (tmp_path / "path" / "log-rank0.txt").read_text()
    plain = build_model("resnet18", 4, True, torch.device("cpu"))
    plain.load_state_dict(params(tmp_path / "path")["model"], strict=True)


def test_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one(run, tiny_data, tmp_path):
    # accumulation, warmup and cosine make the position inside the schedule and epoch matter
    common = [
        "--data",
        tiny_data,
        *FAST,
        "--epochs",
        "2",
        "--accum-steps",
        "2",
        "--warmup-epochs",
        "1",
        "--lr-schedule",
        "cosine",
        "--label-smoothing",
        "0.1",
        "--log-every",
        "2",
        "--seed",
        "7",
    ]
    # 6 steps per epoch: step 4 is mid-epoch 0, step 6 an epoch boundary
    assert_exact_resume(run, common, tmp_path, steps=12)


def test_a_synthetic_epoch_counts_optimizer_steps_under_accumulation(run, tmp_path):
    """--synthetic-steps 3 with --accum-steps 2: three optimizer steps an epoch (six
    micro-batches), as the flag says."""
    out = tmp_path / "accum"
    code, err = run("--loader", "synthetic", "--synthetic-steps", "3", "--accum-steps", "2",
                    "--epochs", "2", "--arch", "resnet18", "--image-size", "32", "--batch-size",
                    "4", "--device", "cpu", "--log-every", "1", "--output-dir", out)  # fmt: skip
    assert code == 0, err
    assert [r["epoch"] for r in run.records(out, "train")] == [0, 0, 0, 1, 1, 1]


def test_synthetic_loader_trains_without_val(run, tmp_path):
    out = tmp_path / "synth"
    code, err = run(
        "--loader",
        "synthetic",
        "--synthetic-steps",
        "3",
        "--max-steps",
        "3",
        "--arch",
        "resnet18",
        "--image-size",
        "32",
        "--batch-size",
        "4",
        "--device",
        "cpu",
        "--log-every",
        "1",
        "--output-dir",
        out,
    )
    assert code == 0, err
    assert len(run.records(out, "train")) == 3 and run.records(out, "val") == []
    assert params(out)["model"]["fc.weight"].shape == (1000, 512)


def test_checkpoint_every_steps_and_keep(run, tiny_data, tmp_path):
    out = tmp_path / "ck"
    code, err = run(
        "--data",
        tiny_data,
        *FAST,
        "--epochs",
        "1",
        "--max-steps",
        "7",
        "--ckpt-every-steps",
        "2",
        "--keep-checkpoints",
        "2",
        "--eval-every",
        "0",
        "--output-dir",
        out,
    )
    assert code == 0, err
    assert [p.name for p in ckpt.list_checkpoints(out)] == ["ckpt-00000007.pt", "ckpt-00000006.pt"]
    state = params(out)
    assert state["loader"] == {"epoch": 0, "start_batch": 7, "steps_per_epoch": 12}
    assert {"python", "numpy", "torch"} <= set(state["rng"])
    assert state["config"]["train"]["max_steps"] == 7


@pytest.mark.parametrize("strategy, autotune", [("none", True), ("ddp", True), ("dp", False)])
def test_cudnn_autotuning_is_off_only_under_dataparallel(strategy, autotune, monkeypatch):
    """DataParallel's forward threads are new each step and cuDNN's plan cache is per thread, so
    autotuning would run again every step (BENCHMARKS.md: DP vs DDP)."""
    from fasttrain.run.runtime import configure_backends

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", not autotune)
    precision = torch.get_float32_matmul_precision()
    try:
        configure_backends(torch.device("cuda"), strategy)
    finally:
        torch.set_float32_matmul_precision(precision)  # the rest of the CPU tests stay fp32
    assert torch.backends.cudnn.benchmark is autotune


def test_deterministic_turns_on_every_switch_it_names_and_says_so(
    run, tiny_data, tmp_path, monkeypatch
):
    """--deterministic turns on torch's deterministic algorithms, cuDNN's, inductor's and
    cuBLAS's fixed workspace (and says so in the log); a run without it leaves them off. (Runs
    on the CPU repeat bit for bit either way, so they prove nothing about the flag.)"""
    from torch._inductor import config as inductor_config

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        for flags, on in (([], False), (["--deterministic"], True)):
            out = tmp_path / f"run-{on}"
            code, err = run("--data", tiny_data, *FAST, "--max-steps", "2", "--eval-every", "0",
                            *flags, "--output-dir", out)  # fmt: skip
            assert code == 0, err
            assert torch.are_deterministic_algorithms_enabled() is on
            assert torch.backends.cudnn.deterministic is on
            assert inductor_config.deterministic is on
            assert (os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8") is on
            said = (
                "--deterministic: deterministic algorithms" in (out / "log-rank0.txt").read_text()
            )
            assert said is on
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        from torch._inductor import config as inductor_config

        inductor_config.deterministic = False


def test_lars_trains_on_the_cpu(run, tiny_data, tmp_path):
    """--opt lars without a GPU runs the foreach form and learns (lower loss at the end)."""
    out = tmp_path / "lars"
    code, err = run("--data", tiny_data, *FAST, "--opt", "lars", "--lars-eta", "0.02", "--lr",
                    "3.2", "--epochs", "3", "--log-every", "6", "--eval-every", "0",
                    "--output-dir", out)  # fmt: skip
    assert code == 0, err
    losses = [r["loss"] for r in run.records(out, "train")]
    assert sum(losses[-2:]) / 2 < 0.95 * sum(losses[:2]) / 2, losses


def test_auto_augment_in_the_torchvision_loader_resumes_bitwise(run, tiny_data, tmp_path):
    common = ["--data", tiny_data, *FAST, "--epochs", "1", "--eval-every", "0", "--log-every",
              "2", "--auto-augment", "ta_wide"]  # fmt: skip
    assert_exact_resume(run, common, tmp_path, steps=12)


def test_tuning_later_runs_in_the_step_it_is_due_and_has_the_step_captured_again(
    run, tmp_path, monkeypatch
):
    """The loop's side of --tune-kernels later, with a stand-in for the tuning (the CPU compiles
    no Triton kernel to put off): asked before every step but the first, the tuning begins in
    the step it is first due, with the training step to capture again, and summary.json keeps
    what the tuning reports at the end."""
    import fasttrain.run.train as loop

    calls = []

    class Late:
        def __init__(self):
            self.asked = 0

        def due(self):
            self.asked += 1
            return self.asked == 3

        def begin(self, step, graphs):
            calls.append(("begin", step, [type(g).__name__ for g in graphs]))

        def done(self, device, began):
            calls.append(("done", device.type))

        def close(self):
            calls.append(("close",))
            return {"step": 4, "kernels": 2}

    monkeypatch.setattr(loop, "tunes_kernels", lambda cfg: True)
    monkeypatch.setattr(loop, "LateTuning", Late)
    out = tmp_path / "late"
    code, err = run("--loader", "synthetic", "--synthetic-steps", "6", "--max-steps", "6",
                    "--arch", "resnet18", "--image-size", "32", "--batch-size", "4", "--device",
                    "cpu", "--tune-kernels", "later", "--output-dir", out)  # fmt: skip
    assert code == 0, err
    assert calls == [("begin", 4, ["EagerStep"]), ("done", "cpu"), ("close",)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["late_tuning"]["step"] == 4 and summary["late_tuning"]["kernels"] == 2
