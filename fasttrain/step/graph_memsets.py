"""The memsets in a captured CUDA graph, replaced by fill kernels.

cuDNN zeroes the statistics of each fused convolution (``conv_bn``) before it runs, with three
``cudaMemsetAsync`` calls (the sum, the sum of squares, a 4-byte counter), and zeroes a counter
before some backward convolutions too: about 200 memsets a ResNet-50 step. Captured, each is a
memset node, and in a replay the GPU idles around them, 1.3 µs between two memsets and 3-4 µs
before the convolution (docs/experiments/2026-12-step-options.md), where a kernel after a kernel
waits about 0.5 µs. So after capture, each run of memsets in a row (each the only successor of
the one before) becomes one kernel node that writes the same bytes, with the same predecessors
and successors. Nothing else in the graph changes.

Only memsets that the kernel writes exactly are replaced: one row, 4-byte aligned, a multiple of
4 bytes (every one cuDNN issues in the step); others stay memset nodes. The driver is reached
through ``ctypes`` (``libcuda``, present wherever CUDA runs), the kernel is PTX loaded into the
current context once per process. ``FASTTRAIN_GRAPH_MEMSETS=kernels``, the default, replaces
them (measured: BENCHMARKS.md#graph-memsets); ``keep`` leaves the memset nodes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger("fasttrain")

ENV = "FASTTRAIN_GRAPH_MEMSETS"
DEFAULT = "kernels"
MAX_RANGES = 4  # one kernel node zeroes up to this many memsets' bytes
THREADS = 256
MAX_BLOCKS = 64  # per range; the kernel loops over the rest
MEMSET_NODE = 2  # CU_GRAPH_NODE_TYPE_MEMSET

# fill up to four ranges of 32-bit words, one range per blockIdx.y; a range of length 0 is none
PTX = rb"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry fasttrain_fill_ranges(
  .param .u64 d0, .param .u64 n0, .param .u32 v0,
  .param .u64 d1, .param .u64 n1, .param .u32 v1,
  .param .u64 d2, .param .u64 n2, .param .u32 v2,
  .param .u64 d3, .param .u64 n3, .param .u32 v3)
{
  .reg .pred p<5>;
  .reg .b32 r<8>;
  .reg .b64 rd<9>;
  mov.u32 r1, %ctaid.y;
  setp.eq.u32 p1, r1, 0;
  setp.eq.u32 p2, r1, 1;
  setp.eq.u32 p3, r1, 2;
  ld.param.u64 rd1, [d3];
  ld.param.u64 rd2, [n3];
  ld.param.u32 r2, [v3];
  @p3 ld.param.u64 rd1, [d2];
  @p3 ld.param.u64 rd2, [n2];
  @p3 ld.param.u32 r2, [v2];
  @p2 ld.param.u64 rd1, [d1];
  @p2 ld.param.u64 rd2, [n1];
  @p2 ld.param.u32 r2, [v1];
  @p1 ld.param.u64 rd1, [d0];
  @p1 ld.param.u64 rd2, [n0];
  @p1 ld.param.u32 r2, [v0];
  mov.u32 r3, %ctaid.x;
  mov.u32 r4, %ntid.x;
  mov.u32 r5, %tid.x;
  mov.u32 r6, %nctaid.x;
  mul.wide.u32 rd3, r3, r4;
  cvt.u64.u32 rd4, r5;
  add.u64 rd3, rd3, rd4;
  mul.wide.u32 rd5, r6, r4;
LOOP:
  setp.ge.u64 p4, rd3, rd2;
  @p4 bra DONE;
  shl.b64 rd6, rd3, 2;
  add.u64 rd7, rd1, rd6;
  st.global.u32 [rd7], r2;
  add.u64 rd3, rd3, rd5;
  bra LOOP;
DONE:
  ret;
}
"""
KERNEL = b"fasttrain_fill_ranges"


@dataclass(frozen=True)
class Memset:
    """One memset node's parameters (``CUDA_MEMSET_NODE_PARAMS``)."""

    dst: int
    pitch: int
    value: int
    element_size: int
    width: int
    height: int

    @property
    def nbytes(self) -> int:
        return self.width * self.element_size

    def words(self) -> tuple[int, int, int] | None:
        """(address, 32-bit words, 32-bit value) that write the same bytes; None where the
        kernel cannot (several rows, unaligned, a size not a multiple of 4 bytes)."""
        if (
            self.height != 1
            or self.dst % 4
            or self.nbytes % 4
            or self.element_size not in (1, 2, 4)
        ):
            return None
        v = self.value & ((1 << (8 * self.element_size)) - 1)
        word = {1: v * 0x01010101, 2: v | (v << 16), 4: v}[self.element_size]
        return self.dst, self.nbytes // 4, word


def chains(
    memsets: dict[int, Memset], deps: dict[int, list[int]], succs: dict[int, list[int]]
) -> list[list[int]]:
    """The memset nodes to replace, grouped into runs that one kernel node writes: each run's
    nodes in order, each the only successor of the one before and it their only predecessor,
    at most ``MAX_RANGES`` long, with byte ranges that do not overlap (one kernel writes them
    all at once). ``memsets``: the replaceable memset nodes by handle; ``deps`` and ``succs``:
    every node's predecessors and successors."""

    def linked(a: int, b: int) -> bool:
        return succs.get(a) == [b] and deps.get(b) == [a]

    starts = [m for m in memsets if not any(linked(d, m) for d in deps.get(m, []) if d in memsets)]
    out = []
    for start in starts:
        run = [start]
        node = start
        while True:
            nxt = succs.get(node, [])
            if len(nxt) != 1 or nxt[0] not in memsets or not linked(node, nxt[0]):
                break
            node = nxt[0]
            if len(run) == MAX_RANGES or _overlaps(memsets[node], [memsets[m] for m in run]):
                out.append(run)
                run = []
            run.append(node)
        out.append(run)
    return out


def _overlaps(m: Memset, others: Sequence[Memset]) -> bool:
    return any(m.dst < o.dst + o.nbytes and o.dst < m.dst + m.nbytes for o in others)


def enabled() -> bool:
    """Whether captured graphs get their memsets replaced: ``FASTTRAIN_GRAPH_MEMSETS`` is
    ``kernels`` (or 1) or ``keep`` (or 0); unset, ``DEFAULT``."""
    value = os.environ.get(ENV, DEFAULT).strip().lower()
    if value in ("kernels", "1"):
        return True
    if value not in ("keep", "0"):
        _warn_unknown(value)
        return DEFAULT == "kernels"
    return False


@functools.cache
def _warn_unknown(value: str) -> None:
    """Once per value: a run captures several graphs and asks each time."""
    log.warning("%s=%s: not kernels or keep, so %s", ENV, value, DEFAULT)


class _MemsetParams(ctypes.Structure):
    _fields_ = [
        ("dst", ctypes.c_uint64),
        ("pitch", ctypes.c_size_t),
        ("value", ctypes.c_uint),
        ("elementSize", ctypes.c_uint),
        ("width", ctypes.c_size_t),
        ("height", ctypes.c_size_t),
    ]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS, the first version's layout
    _fields_ = [
        ("func", ctypes.c_void_p),
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.POINTER(ctypes.c_void_p)),
        ("extra", ctypes.POINTER(ctypes.c_void_p)),
    ]


class _Driver:
    """The few driver calls the rewrite needs, and the fill kernel loaded in this context."""

    def __init__(self) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.cu.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(PTX)), "load")
        self.check(self.cu.cuModuleGetFunction(ctypes.byref(func), module, KERNEL), "function")
        self.module, self.func = module, func  # the module stays loaded for the process

    @staticmethod
    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"CUDA driver call for {what} returned {result}")

    def _list(self, fn: ctypes._CFuncPtr, *head: ctypes.c_void_p) -> list[int]:
        n = ctypes.c_size_t(0)
        self.check(fn(*head, None, ctypes.byref(n)), fn.__name__)
        arr = (ctypes.c_void_p * max(1, n.value))()
        self.check(fn(*head, arr, ctypes.byref(n)), fn.__name__)
        return [arr[i] for i in range(n.value)]

    def nodes(self, graph: int) -> list[int]:
        return self._list(self.cu.cuGraphGetNodes, ctypes.c_void_p(graph))

    def kind(self, node: int) -> int:
        t = ctypes.c_int()
        self.check(self.cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "type")
        return t.value

    def memset(self, node: int) -> Memset:
        p = _MemsetParams()
        self.check(
            self.cu.cuGraphMemsetNodeGetParams(ctypes.c_void_p(node), ctypes.byref(p)), "memset"
        )
        return Memset(p.dst, p.pitch, p.value, p.elementSize, p.width, p.height)

    def deps(self, node: int) -> list[int]:
        return self._list(self.cu.cuGraphNodeGetDependencies, ctypes.c_void_p(node))

    def succs(self, node: int) -> list[int]:
        return self._list(self.cu.cuGraphNodeGetDependentNodes, ctypes.c_void_p(node))

    def add_fill(self, graph: int, ranges: list[tuple[int, int, int]], after: list[int]) -> int:
        values = []
        for i in range(MAX_RANGES):
            dst, words, word = ranges[i] if i < len(ranges) else (0, 0, 0)
            values += [ctypes.c_uint64(dst), ctypes.c_uint64(words), ctypes.c_uint32(word)]
        args = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        longest = max(words for _, words, _ in ranges)
        blocks = min(MAX_BLOCKS, max(1, -(-longest // THREADS)))
        params = _KernelParams(
            self.func, blocks, len(ranges), 1, THREADS, 1, 1, 0, args, None
        )  # fmt: skip
        node = ctypes.c_void_p()
        preds = (ctypes.c_void_p * max(1, len(after)))(*after)
        result = self.cu.cuGraphAddKernelNode(
            ctypes.byref(node),
            ctypes.c_void_p(graph),
            preds,
            ctypes.c_size_t(len(after)),
            ctypes.byref(params),
        )
        self.check(result, "a kernel node")
        return node.value

    def link(self, graph: int, a: int, b: int) -> None:
        one = ctypes.c_size_t(1)
        result = self.cu.cuGraphAddDependencies(
            ctypes.c_void_p(graph),
            ctypes.byref(ctypes.c_void_p(a)),
            ctypes.byref(ctypes.c_void_p(b)),
            one,
        )
        self.check(result, "an edge")

    def destroy(self, node: int) -> None:
        self.check(self.cu.cuGraphDestroyNode(ctypes.c_void_p(node)), "destroying a node")


@functools.cache
def _driver() -> _Driver:
    """The driver and the fill kernel, loaded at the first rewrite of the process."""
    return _Driver()


def as_kernels(graph: int) -> int:
    """Replace the memset nodes of the CUDA graph ``graph`` (a ``cudaGraph_t``, before it is
    instantiated) by fill kernel nodes; returns how many memsets were replaced. Each run is
    replaced whole or not at all, so a failure part-way leaves a graph that computes the same:
    the kernel is added beside the memsets it replaces before they go."""
    drv = _driver()
    memsets: dict[int, Memset] = {}
    words: dict[int, tuple[int, int, int]] = {}  # what the kernel writes for each of them
    for node in drv.nodes(graph):
        if drv.kind(node) == MEMSET_NODE:
            m = drv.memset(node)
            if (w := m.words()) is not None:
                memsets[node], words[node] = m, w
    if not memsets:
        return 0
    deps = {n: drv.deps(n) for n in memsets}
    succs = {n: drv.succs(n) for n in memsets}
    replaced = 0
    for run in chains(memsets, deps, succs):
        ranges = [words[m] for m in run]
        # asked again: a run split from the one before now follows that one's kernel
        node = drv.add_fill(graph, ranges, drv.deps(run[0]))
        try:
            for s in drv.succs(run[-1]):
                drv.link(graph, node, s)
        except Exception:
            drv.destroy(node)  # takes its edges with it: the memsets stand as they were
            raise
        for m in run:
            drv.destroy(m)
        replaced += len(run)
    return replaced
