"""bench/traffic.py counts the bytes of the compiled step's generated kernels per model path, as
inductor's Triton backend schedules them (a GPU's kernels, on the CPU) or as its C++ backend
compiles them."""

import importlib.util
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "bench_traffic", Path(__file__).parents[2] / "bench" / "traffic.py"
)
traffic = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = traffic  # its dataclass looks its module up
SPEC.loader.exec_module(traffic)


def test_one_pass_is_every_batchnorm_output():
    """The unit: resnet18 at 32 px has 20 BNs; their outputs' sizes, summed by hand."""
    import torch

    x = torch.randn(2, 3, 32, 32)
    # stem 64x16x16; layer1 4 BNs of 64x8x8; layer2 4 of 128x4x4 + downsample; layer3 4 of
    # 256x2x2 + downsample; layer4 4 of 512x1x1 + downsample
    per_image = 64 * 256 + 4 * 64 * 64 + 5 * 128 * 16 + 5 * 256 * 4 + 5 * 512 * 1
    assert traffic.bn_elements("resnet18", x) == 2 * per_image


def measure_resnet18(path: str, backend: str = "triton"):
    """``path``'s traffic for resnet18 at 32 px, batch 2, on the CPU (in a worker process)."""
    return traffic.measure("resnet18", path, 32, 2, "cpu", backend=backend)


@pytest.mark.slow
def test_each_fusion_moves_less_than_the_path_before_it():
    """Summing BN's statistics in the convolutions removes a read of each conv output: the
    fused step's kernels, with a plain ReLU, move at least a third of a pass less than the plain
    step's (resnet18 at 32 px, where the stem's share is large: about half a pass). Masking the
    ReLU gradient by the pass's input removes a read of each normalised activation from both BN
    backward kernels: at least a quarter of a pass less (about half here); were inductor to
    store the masked gradient as a buffer instead, it would move more, not less. Storing each
    block end's masked gradient once, instead of inductor recomputing it in each of its
    readers, moves at least 0.15 of a pass less (0.29 here); the stem's BN run as the others at
    least 0.3 less (1.6 here, where the stem is large); both, less than either alone. What
    ``--fused-bn`` builds keeps each block end's ReLU mask as bits as well, which the Triton
    backend writes in the block end's own kernel: at least 0.15 of a pass less again (0.26
    here), and it counts every BN's batch in one kernel, where each BN's count was a kernel of
    one element: 19 per-channel or one-element kernels fewer in resnet18's 20 BNs. Inductor's
    C++ backend (``--backend cpp``), which groups no ``_foreach`` op, keeps those 20 kernels."""
    paths = ("plain", "fused-relu", "mask", "stored", "stem", "unpacked", "fused", "fused")
    backends = ("triton",) * 7 + ("cpp",)
    # a compile each, most of a minute on one core: two processes at once
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        counted = list(pool.map(measure_resnet18, paths, backends))
    plain, relu, mask, stored, stem, both, fused, fused_cpp = counted
    print(
        [
            (t.path, b, round(t.kernel_passes, 2), t.kernels, t.small)
            for t, b in zip(counted, backends, strict=True)
        ]
    )
    assert plain.kernels > 20 and relu.kernels > 20
    assert plain.kernel_passes > 5  # a BN step reads and writes each activation several times
    assert relu.kernel_passes < plain.kernel_passes - 0.33
    assert mask.kernel_passes < relu.kernel_passes - 0.25
    assert stored.kernel_passes < mask.kernel_passes - 0.15
    assert stem.kernel_passes < mask.kernel_passes - 0.3
    assert both.kernel_passes < min(stored.kernel_passes, stem.kernel_passes) - 0.15
    assert fused.kernel_passes < both.kernel_passes - 0.15
    assert both.small - fused.small >= 19 and fused.small > 0
    assert fused.top and all(passes > 0 for passes, _ in fused.top)
    assert fused_cpp.kernels > 20 and fused_cpp.small >= fused.small + 19
