"""Triton kernels and their ``torch.library`` ops, installed as ``savedhooks.kernels``.

The folder sits at the repository's top level but is never importable as a bare
``kernels``: PyPI has an unrelated distribution of that name. pyproject maps this
folder to ``savedhooks.kernels`` (setuptools ``package-dir``).
"""
