"""One Triton kernel module as inductor writes one, for the tuning tests: a pointwise kernel
that coordinate descent tunes, loaded without a GPU for an sm_90 target."""

from __future__ import annotations

from types import SimpleNamespace

NAME = "triton_poi_fused_mul_relu_0"
# a kernel module as inductor writes one (pure tl: torch's own jitted helpers were made for
# Triton's interpreter when the tests imported torch without a GPU)
SOURCE = f"""
import triton
import triton.language as tl
from torch._inductor.runtime import triton_heuristics
from torch._inductor.runtime.hints import DeviceProperties

@triton_heuristics.pointwise(
    size_hints={{'x': 1048576}},
    filename=__file__,
    triton_meta={{'signature': {{'in_ptr0': '*fp16', 'in_ptr1': '*fp32', 'out_ptr0': '*fp16',
        'xnumel': 'i32', 'XBLOCK': 'constexpr'}}, 'device': DeviceProperties(type='cuda', index=0,
        multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32),
        'constants': {{}}, 'configs': [{{}}]}},
    inductor_meta={{'kernel_name': '{NAME}', 'coordinate_descent_tuning': True,
        'autotune_local_cache': False, 'force_disable_caches': True}},
    min_elem_per_thread=0,
)
@triton.jit
def {NAME}(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    tmp0 = tl.load(in_ptr0 + xindex, xmask).to(tl.float32)
    tmp1 = tl.load(in_ptr1 + (xindex % 256), xmask, eviction_policy='evict_last')
    tmp2 = tl.maximum(tmp0 * tmp1, 0.0)
    tl.store(out_ptr0 + xindex, tmp2.to(tl.float16), xmask)
"""


def launched(kernel, *configs):
    """``kernel`` as after its precompile in the training process: one launcher per config."""
    kernel.launchers = [SimpleNamespace(config=c) for c in configs]
    return kernel
