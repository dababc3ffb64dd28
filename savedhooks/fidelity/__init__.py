"""Fidelity of lossy codecs: which saved tensors matter for the gradients (``sh.sensitivity``)."""

from savedhooks.fidelity.select import Census, SavedTensor, Selected, keyed_run
from savedhooks.fidelity.sensitivity import SavedGroup, Sensitivity, sensitivity

__all__ = ["Census", "SavedGroup", "SavedTensor", "Selected", "Sensitivity", "keyed_run", "sensitivity"]
