"""The installed torch release, the releases savedhooks supports, and the torch bugs it meets per release.

Design notes
------------
* **Releases.** savedhooks runs on torch 2.11 through 2.14 (``SUPPORTED``).
  What differs between them is read once, here and in the module that wraps
  the piece (a feature check such as an import or an ``hasattr``, never a
  version compare where the feature itself can be asked), and listed in
  ``docs/compatibility.md``.
* **Bugs.** :data:`BUGS` lists each torch bug that savedhooks works around or
  pins with a strict xfail, with the first release that fixed it. A
  work-around runs only where :func:`has_bug` says the bug is present, so a
  release that fixed it runs torch's own code; the strict xfail that pins it
  uses the same condition, and starts failing on a release that fixes a bug
  this table still lists as present.
"""

from __future__ import annotations

import dataclasses
import re

import torch

__all__ = ["BUGS", "SUPPORTED", "TorchBug", "has_bug", "release", "supported"]

SUPPORTED: tuple[tuple[int, int], tuple[int, int]] = ((2, 11), (2, 14))  # first and last release, inclusive


def release(version: str | None = None) -> tuple[int, int]:
    """The (major, minor) of a torch version string.

    Args:
        version: a version such as ``"2.14.1+cu130"`` or ``"2.15.0.dev20261201"``;
            None reads ``torch.__version__``.

    Returns:
        ``(2, 14)`` for the example.

    Raises:
        ValueError: a string that does not start with ``major.minor``.
    """
    text = str(torch.__version__ if version is None else version)
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(match.group(1)), int(match.group(2))


def supported(version: str | None = None) -> bool:
    """Whether savedhooks supports a torch release (``SUPPORTED``, inclusive).

    Args:
        version: a torch version string; None reads ``torch.__version__``.

    Returns:
        True for 2.11.x through 2.14.x.
    """
    return SUPPORTED[0] <= release(version) <= SUPPORTED[1]


@dataclasses.dataclass(frozen=True)
class TorchBug:
    """A torch bug met on savedhooks' paths.

    Attributes:
        summary: what goes wrong, in one line.
        fixed_in: the first release without it; None: present up to the last supported release.
        pinned_by: the strict xfail test that shows it.
        work_around: what savedhooks does about it (``"none"``: only pinned).
        since: the first release with it; None: present from the first supported release.
    """

    summary: str
    fixed_in: tuple[int, int] | None
    pinned_by: str
    work_around: str
    since: tuple[int, int] | None = None

    def present(self, version: str | None = None) -> bool:
        """Whether a torch release has this bug.

        Args:
            version: a torch version string; None reads ``torch.__version__``.

        Returns:
            True from ``since`` (or always) up to before ``fixed_in`` (or always).
        """
        at = release(version)
        return (self.since is None or at >= self.since) and (self.fixed_in is None or at < self.fixed_in)


BUGS: dict[str, TorchBug] = {
    "rng_state_names": TorchBug(
        "inlined saved-tensor hooks cannot find a checkpointed random op's saved generator state",
        fixed_in=(2, 14),
        pinned_by="tests/hooks/test_composability.py::test_torch_inlined_hooks_fail_on_checkpointed_random_ops",
        work_around="savedhooks._torch.fixes.align_rng_state_names renames the forward's states",
    ),
    "dtype_propagation_setup": TorchBug(
        "inductor's DtypePropagationOpsHandler runs its whole set-up each time it is constructed",
        fixed_in=None,
        pinned_by="tests/package/test_torchfixes.py",
        work_around="savedhooks._torch.fixes.set_up_dtype_propagation_once",
    ),
    "reorder_conv_relu_maxpool": TorchBug(
        "inductor's reorder_for_peak_memory gives wrong conv gradients for conv -> relu -> max_pool (CPU)",
        fixed_in=(2, 14),
        pinned_by="tests/compile/test_compile.py::test_torch_inductor_reorder_bug_conv_relu_maxpool",
        work_around="none: the tests' CNN runs under inductor turn reorder_for_peak_memory off",
        since=(2, 13),
    ),
    "cpp_loop_split_remainder": TorchBug(
        "inductor's C++ loop split drops the columns past the last whole block (CPU)",
        fixed_in=None,
        pinned_by="tests/compile/test_compile.py::"
        "test_torch_inductor_loop_split_bug_drops_the_columns_past_the_last_whole_block",
        work_around="the decomposed fp8 codec never pads to whole blocks",
    ),
    "fp8_pass_use_scaling": TorchBug(
        "the fp8 activation pass defaults use_scaling to True in the forward and to False in the backward",
        fixed_in=None,
        pinned_by="tests/compile/test_torch_fp8_pass.py::test_torch_fp8_pass_with_use_scaling_unset_unscales_what_it_scaled",
        work_around="none: benchmarks.torch_options sets use_scaling",
    ),
    "fp8_pass_infinite_amax": TorchBug(
        "the fp8 activation pass scales a saved tensor holding -inf by 0, which makes NaN",
        fixed_in=None,
        pinned_by="tests/compile/test_torch_fp8_pass.py::test_torch_fp8_pass_keeps_a_saved_additive_mask_finite",
        work_around="none: the benchmark marks such rows",
    ),
    "ao_wait_tensor_alias": TorchBug(
        "ao::wait_tensor returns an alias of its input, which functionalization refuses inside traced hooks",
        fixed_in=None,
        pinned_by="tests/codec/test_codec_models.py::test_torch_async_offload_ops_cannot_run_inside_traced_hooks",
        work_around="savedhooks.compiler.overlap rewrites copies after functionalization",
        since=(2, 12),  # the ops themselves are 2.12+
    ),
    "autocast_batch_norm_fake_dtype": TorchBug(
        "CPU autocast batch norm's fake kernel says bf16 statistics, the real one returns float32",
        fixed_in=None,
        pinned_by="tests/codec/test_codec_models.py::test_torch_autocast_batch_norm_fake_dtype_mismatch",
        work_around="none",
    ),
}


def has_bug(name: str, version: str | None = None) -> bool:
    """Whether a torch release has a bug of :data:`BUGS`.

    Args:
        name: a key of :data:`BUGS`.
        version: a torch version string; None reads ``torch.__version__``.

    Returns:
        ``BUGS[name].present(version)``.

    Raises:
        KeyError: an unknown name.
    """
    if name not in BUGS:
        raise KeyError(f"unknown torch bug {name!r}; known: {sorted(BUGS)}")
    return BUGS[name].present(version)
