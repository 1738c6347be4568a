"""The kernel classes of a trace's profiled steps (``fasttrain.metrics.kernels``), which the
TensorBoard profile entries and ``bench/kernel_split.py`` show."""

from __future__ import annotations

import pytest

from fasttrain.metrics.kernels import KernelSplit, classify, split


def k(name: str, us: float, cat: str = "kernel") -> dict:
    return {"cat": cat, "name": name, "dur": us}


def two_steps() -> dict:
    return {
        "traceEvents": [
            {"cat": "user_annotation", "name": "ProfilerStep#4"},
            {"cat": "user_annotation", "name": "ProfilerStep#5"},
            k("triton_red_fused__native_batch_norm_legit_functional_0", 3000),
            k("triton_poi_fused_add_relu_1", 1000),
            k("sm90_xmma_fprop_implicit_gemm_f16f16_f32f32", 2000),
            k("sm90_xmma_gemm_f16f16_f32", 400),
            k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 500),
            k("Memcpy DtoD (Device -> Device)", 100, cat="gpu_memcpy"),
            k("void at::native::vectorized_elementwise_kernel", 1000),
            {"cat": "cpu_op", "name": "aten::conv2d", "dur": 9999},  # host work: not counted
        ]
    }


def test_kernel_split_classifies_a_traces_kernels_per_step():
    s = split(two_steps())
    assert s.steps == 2
    assert s.by_class == {
        "Triton (BN, elementwise)": 4.0,
        "convolution": 2.0,
        "GEMM (cuBLAS)": 0.4,
        "NCCL": 0.5,
        "copies and fills": 0.1,
        "other kernels": 1.0,
    }
    assert s.per_step() == pytest.approx(4.0)
    name, label, ms = s.top(1)[0]
    assert label == "Triton (BN, elementwise)" and ms == pytest.approx(1.5)
    assert name.startswith("triton_red_fused__native_batch_norm")
    assert next(iter(s.shares())) == "Triton (BN, elementwise)"
    assert s.shares()["convolution"] == pytest.approx(2.0 / 8.0)


def test_cudnn_engines_and_batchnorm_kernels_have_their_own_classes():
    assert classify("cudnn_generated_fort_native_sdpa") == "convolution"
    assert classify("nhwc_batch_norm_fwd") == "BatchNorm (cuDNN)"
    assert classify("nvjet_hsh_128x256") == "GEMM (cuBLAS)"
    assert classify("Memset (Device)", "gpu_memset") == "copies and fills"
    assert classify("Memcpy HtoD (Pinned -> Device)") == "copies and fills"  # the top list's
    # DALI's decode kernels are the loader's, though their names hold a convolution's needle
    name = "void nvjpeg::rgba2rgb<(nvjpegOutputFormat_t)5, nvjpeg::RGBAToRGBConversion::Launch>"
    assert classify(name) == "data loading (DALI, nvJPEG)"


def test_two_cycles_of_one_rank_add_up():
    a = split(two_steps())
    both = a.add(a)
    assert both.steps == 4 and both.by_class["convolution"] == pytest.approx(4.0)
    assert both.per_step() == pytest.approx(a.per_step())
    assert KernelSplit().add(a).by_name == a.by_name


def test_kernel_split_leaves_out_kernels_launched_before_the_profiled_steps():
    """The host runs ahead of the GPU: a graphed step's trace also records the replay launched
    before profiling began, still running. Counted, it inflated every per-step figure by a third
    (four replays' kernels divided by three steps)."""

    def launch(corr, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5,
                "args": {"correlation": corr}}  # fmt: skip

    def kernel(name, corr, ts, us):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": us,
                "args": {"correlation": corr}}  # fmt: skip

    def step(n, ts):
        return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "ts": ts,
                "dur": 100}  # fmt: skip

    trace = {
        "traceEvents": [
            launch(7, 50),  # the replay before profiling began (its launch may be missing too)
            step(2, 200),
            launch(8, 210),
            step(3, 300),
            launch(9, 310),
            kernel("triton_poi_fused_add_relu_1", 7, 400, 1000),
            kernel("triton_poi_fused_add_relu_1", 6, 1400, 1000),  # launched before the trace
            kernel("triton_poi_fused_add_relu_1", 8, 2400, 1000),
            kernel("sm90_xmma_fprop_implicit_gemm", 8, 3400, 2000),
            kernel("triton_poi_fused_add_relu_1", 9, 5400, 1000),
            kernel("sm90_xmma_fprop_implicit_gemm", 9, 6400, 2000),
        ]
    }
    s = split(trace)
    assert s.steps == 2
    assert s.by_class == {"Triton (BN, elementwise)": 2.0, "convolution": 4.0}
    assert s.by_name["triton_poi_fused_add_relu_1"] == 2.0
    for e in trace["traceEvents"]:  # without correlation ids every kernel counts
        e.pop("args", None)
    assert split(trace).by_class == {"Triton (BN, elementwise)": 4.0, "convolution": 4.0}
