"""Fidelity of lossy codecs: SQNR, and which saved tensors matter for the gradients (``sh.fidelity.sensitivity``)."""

from savedhooks.fidelity.select import Census, SavedTensor, Selected, keyed_run
from savedhooks.fidelity.sensitivity import SavedGroup, Sensitivity, sensitivity
from savedhooks.metrics import sqnr, worst_sqnr

__all__ = [
    "Census",
    "SavedGroup",
    "SavedTensor",
    "Selected",
    "Sensitivity",
    "keyed_run",
    "sensitivity",
    "sqnr",
    "worst_sqnr",
]
