"""Triton kernels, installed as ``fasttrain.kernels`` (see pyproject.toml for why not ``kernels``).

Each kernel ships with a plain torch reference and tests that hold the two together
(tests/kernels/test_kernels.py, in Triton's interpreter without a GPU):

- ``normalize``: uint8 NHWC -> normalised bf16/fp16 channels_last, optional per-sample flip;
- ``cross_entropy``: softmax cross-entropy with label smoothing, a ``torch.library`` custom op;
- ``sgd``: SGD and LARS over flat buffers, one launch, LR from a device tensor;
- ``maxpool``: the stem's max-pool, forward (int8 argmax offsets kept) and backward (a gather),
  ``torch.library`` custom ops; ``maxpool_rows`` runs ResNet's 3x3/2 pad-1 pool streamed by rows,
  held to ``maxpool``'s window kernels.

``--triton-kernels auto`` (the default) uses those measured faster in the step on an H200:
maxpool on a GPU with channels_last, normalize with the torchvision loader; the others are
options (``--triton-kernels``, ``--opt lars``; docs/DESIGN.md).
"""
