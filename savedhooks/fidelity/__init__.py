"""Fidelity of lossy codecs: SQNR, the user's gradient check (``sh.fidelity.check``), and which saved tensors matter (``sh.fidelity.sensitivity``)."""

from savedhooks.fidelity.check import GradientCheck, check
from savedhooks.fidelity.select import Census, SavedTensor, Selected, keyed_run
from savedhooks.fidelity.sensitivity import SavedGroup, Sensitivity, sensitivity
from savedhooks.metrics import sqnr, worst_sqnr

__all__ = [
    "Census",
    "GradientCheck",
    "SavedGroup",
    "SavedTensor",
    "Selected",
    "Sensitivity",
    "check",
    "keyed_run",
    "sensitivity",
    "sqnr",
    "worst_sqnr",
]
