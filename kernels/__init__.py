"""Triton kernels, installed as ``fasttrain.kernels`` (see pyproject.toml for why not ``kernels``).

Each kernel ships with a plain torch reference and a test that holds the two together. None exist
yet: they arrive with the kernels issue.
"""
