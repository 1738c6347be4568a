"""`python -m fasttrain env` and what it reports of the machine."""

from __future__ import annotations

import torch

from fasttrain.__main__ import main


def test_env_report(capsys, monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    code = main(["env"])
    out = capsys.readouterr().out
    assert code == 0
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32" in out  # main claimed the hardware queues
    for field in ("torch", "CUDA", "cuDNN", "NCCL", "triton", "DALI", "GPUs"):
        assert field in out
    assert torch.__version__ in out


def test_env_warns_when_dali_is_built_for_another_cuda(capsys, monkeypatch):
    import fasttrain.data.dali_install as dali

    monkeypatch.setattr(dali, "installed_dali_builds", lambda: {"nvidia-dali-cuda120": "2.4.0"})
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "  warning: DALI (nvidia-dali-cuda120) is built for another CUDA major version" in out


def test_a_users_hardware_queue_setting_is_kept(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert main(["env"]) == 0
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8" in capsys.readouterr().out


def test_env_writes_cudnns_version_as_it_is_written():
    from fasttrain.envreport import _cudnn_version

    assert _cudnn_version(92400) == "9.24.0" and _cudnn_version(91900) == "9.19.0"
    assert _cudnn_version(8907) == "8.9.7"
