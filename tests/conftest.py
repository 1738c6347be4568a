"""Shared fixtures: a tiny sample dataset built once per session, and an in-process CLI runner."""

from __future__ import annotations

import glob
import json
import logging
import os
from pathlib import Path

# Without a GPU the Triton kernels run in Triton's interpreter. @triton.jit decides that when a
# function is defined, Triton's own library functions included, which torch imports: so this
# must come before the first import of torch.
if not glob.glob("/dev/nvidia[0-9]*"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from fasttrain.__main__ import main
from fasttrain.data.sample import SampleSpec, build_sample
from fasttrain.data.torchvision import DeviceLoader, build_torchvision_loader

TINY = SampleSpec(classes=4, train_per_class=48, val_per_class=25, min_side=64, max_side=80)
# flags for a fast CPU run: small model, small images, one worker
FAST = [
    "--arch",
    "resnet18",
    "--image-size",
    "32",
    "--batch-size",
    "16",
    "--workers",
    "1",
    "--device",
    "cpu",
]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cudnn_frontend() -> None:
    """The cuDNN frontend, which the fused and cuDNN BatchNorm paths run on a GPU: one of
    fasttrain's dependencies, so a GPU test that needs it fails (not skips) without it."""
    from fasttrain.model.cudnn import graph as cudnn_graph

    assert cudnn_graph.available(), (
        "the cuDNN frontend is not installed, though fasttrain depends on it: pip install -e ."
    )


@pytest.fixture(autouse=True)
def _reset_logging():
    """A run installs its own handlers on the 'fasttrain' logger; give the next test a clean one."""
    yield
    log = logging.getLogger("fasttrain")
    for h in list(log.handlers):
        h.close()
        log.removeHandler(h)
    log.propagate = True
    log.setLevel(logging.NOTSET)
    # a run routes warnings into its log; the next test's are pytest's again
    logging.captureWarnings(False)
    warn_log = logging.getLogger("py.warnings")
    for h in list(warn_log.handlers):
        warn_log.removeHandler(h)
    warn_log.propagate = True


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return build_sample(tmp_path_factory.mktemp("cache"), TINY, workers=2, log=lambda m: None)


class Run:
    """Runs ``python -m fasttrain`` in this process; returns the exit code, reads the run dir."""

    def __init__(self, capsys):
        self.capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str]:
        self.capsys.readouterr()
        code = main([str(a) for a in argv])
        return code, self.capsys.readouterr().err

    @staticmethod
    def records(run_dir: Path, kind: str) -> list[dict]:
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture
def run(capsys) -> Run:
    return Run(capsys)


def train_loader(
    samples: list[tuple[str, int]],
    *,
    batch_size: int = 16,
    workers: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DeviceLoader:
    """The torchvision train loader at 32 px, channels_last, one process, seed 0."""
    return build_torchvision_loader(
        samples,
        train=True,
        image_size=32,
        batch_size=batch_size,
        workers=workers,
        seed=0,
        rank=0,
        world=1,
        device=torch.device(device),
        dtype=dtype,
        channels_last=True,
    )


def make_tree(root: Path, files: list[str]) -> None:
    """Create ``files`` (paths relative to ``root``) holding one junk byte each."""
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")


def last_checkpoint(run_dir: Path) -> dict:
    from fasttrain.run import checkpoint as ckpt

    return torch.load(ckpt.list_checkpoints(run_dir)[0], weights_only=True)


def assert_exact_resume(run: Run, common: list, tmp_path: Path, steps: int) -> None:
    """Train ``common`` straight through, and again interrupted twice (mid-epoch 0 at step 4,
    then at step 6) and resumed (auto, then by path); the two must end bitwise-equal."""
    code, err = run(*common, "--output-dir", tmp_path / "whole")
    assert code == 0, err
    parts = tmp_path / "parts"
    code, err = run(*common, "--output-dir", parts, "--max-steps", "4")
    assert code == 0, err
    code, err = run(*common, "--output-dir", parts, "--max-steps", "6", "--resume", "auto")
    assert code == 0, err
    assert "resumed from" in (parts / "log-rank0.txt").read_text()
    code, err = run(*common, "--output-dir", parts, "--resume", parts / "ckpt-00000006.pt")
    assert code == 0, err
    whole, resumed = last_checkpoint(tmp_path / "whole"), last_checkpoint(parts)
    assert whole["step"] == resumed["step"] == steps
    for k, v in whole["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
    for i, s in whole["optimizer"]["state"].items():
        momentum = resumed["optimizer"]["state"][i]["momentum_buffer"]
        assert torch.equal(s["momentum_buffer"], momentum)
    losses = [r["loss"] for r in Run.records(tmp_path / "whole", "train")]
    assert [r["loss"] for r in Run.records(parts, "train")] == losses


def constant_lr(lr: float):
    """A schedule that holds ``lr`` at every step, for step-level tests."""
    from fasttrain.step.optim import Schedule

    return Schedule(
        peak_lr=lr,
        steps_per_epoch=10**6,
        total_steps=10**6,
        warmup_steps=0,
        kind="step",
        step_epochs=10**6,
        gamma=0.1,
    )


def assert_matches_torchvision(arch: str, build) -> None:
    """``build(arch, num_classes=7, zero_init_residual=False)`` makes a ResNet with another
    forward (a fused BN path): from the same seed it has torchvision's weights and state dict,
    and in fp64 the same logits, gradients and running statistics after a training step, and
    the same logits in eval mode."""
    import torchvision

    kw = dict(num_classes=7, zero_init_residual=False)
    torch.manual_seed(0)
    ref = getattr(torchvision.models, arch)(weights=None, **kw).double()
    torch.manual_seed(0)
    ours = build(arch, **kw).double()
    ref_state, state = ref.state_dict(), ours.state_dict()
    assert list(state) == list(ref_state)
    assert all(torch.equal(state[k], ref_state[k]) for k in state)
    for model in (ref, ours):
        model.to(memory_format=torch.channels_last)
    # batch 4: layer4's BN then normalises 4 values per channel (2 would make it near-singular,
    # and the gradients chaotic in the last bits)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 32, 32, generator=g, dtype=torch.float64)
    x = x.contiguous(memory_format=torch.channels_last)
    out, out_ref = ours(x), ref(x)
    torch.testing.assert_close(out, out_ref)
    (out * torch.arange(7.0, dtype=torch.float64)).sum().backward()
    (out_ref * torch.arange(7.0, dtype=torch.float64)).sum().backward()
    grads = dict(ours.named_parameters())
    for name, p in ref.named_parameters():  # elementwise, the smallest gradients' last bits differ
        assert (grads[name].grad - p.grad).norm() <= 1e-10 * p.grad.norm(), name
    state, ref_state = ours.state_dict(), ref.state_dict()
    for k in state:
        torch.testing.assert_close(state[k], ref_state[k], msg=k)
    ours.eval()
    ref.eval()
    torch.testing.assert_close(ours(x), ref(x))


def randn_nhwc(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A seeded normal tensor in channels_last, the layout the fused path runs in."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).contiguous(
        memory_format=torch.channels_last
    )


def partitioned_backward(fn, *args, autocast: torch.dtype | None = None) -> torch.fx.GraphModule:
    """The backward graph AOTAutograd partitions ``fn(*args)``'s forward + backward into
    (``partitioned_graphs``)."""
    return partitioned_graphs(fn, *args, autocast=autocast)["bw"]


def partitioned_graphs(
    fn, *args, autocast: torch.dtype | None = None
) -> dict[str, torch.fx.GraphModule]:
    """The forward (``"fw"``) and backward (``"bw"``) graphs AOTAutograd partitions
    ``fn(*args)``'s forward + backward into, as it does for inductor
    (``min_cut_rematerialization_partition``, buffers' mutations kept in the graph), run
    eagerly; under CPU autocast to ``autocast`` where given."""
    import contextlib
    import functools

    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = {}

    def keep(name):
        def compiler(gm, _inputs):
            graphs[name] = gm
            return make_boxed_func(gm.forward)

        return compiler

    def backend(gm, inputs):
        partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
        return aot_module_simplified(
            gm,
            inputs,
            fw_compiler=keep("fw"),
            bw_compiler=keep("bw"),
            partition_fn=partition,
            keep_inference_input_mutations=True,  # as inductor's compile_fx asks
        )

    cast = torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext()
    with cast:
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    out.float().sum().backward()
    return graphs


def start_as_compiled(monkeypatch, start_conv_warmup, before_resolve) -> None:
    """A run's start wired as a compiled one asks for cuDNN's convolutions ahead (compiling here
    would take a minute), with ``start_conv_warmup`` standing in for the thread's start and
    ``before_resolve()`` called as the settings' resolution begins."""
    from fasttrain.commands import train as train_command
    from fasttrain.run import build as build_module
    from fasttrain.run import setup

    def resolve(*args, **kwargs):
        before_resolve()
        return real_resolve(*args, **kwargs)

    real_resolve, real_build = train_command.resolve, setup.build
    monkeypatch.setattr(train_command, "resolve", resolve)
    monkeypatch.setattr(build_module, "start_conv_warmup", start_conv_warmup)
    monkeypatch.setattr(
        setup, "build", lambda *a, **k: real_build(*a, **{**k, "warm_up_convs": True})
    )
