"""Triton kernels, installed as ``fasttrain.kernels`` (see pyproject.toml for why not ``kernels``).

Each kernel ships with a plain torch reference and tests that hold the two together
(tests/test_kernels.py, in Triton's interpreter without a GPU):

- ``normalize``: uint8 NHWC -> normalised bf16/fp16 channels_last, optional per-sample flip;
- ``cross_entropy``: softmax cross-entropy with label smoothing, a ``torch.library`` custom op;
- ``sgd``: SGD and LARS over flat buffers, one launch, LR from a device tensor.

None is on by default: ``--triton-kernels`` and ``--opt lars`` opt in (docs/DESIGN.md).
"""
