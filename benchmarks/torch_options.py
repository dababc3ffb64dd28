"""torch's own ways to cut activation memory, as the benchmarks switch them on: config patches, no hooks.

Each function returns a context manager that patches torch's config for what
compiles inside it; :mod:`benchmarks.configs` turns them into configurations and
:mod:`benchmarks.zoo` measures the fp8 pass on the zoo's models.

* :func:`torch_fp8_pass`: the partitioner's fp8 activation quantization
  (``torch._inductor.config.post_grad_fusion_options["activation_quantization_aten_pass"]``,
  ``enable_activation_quantization`` in ``torch/_functorch/partitioners.py``):
  saved values cast to fp8 in the forward and back in the backward.
* :func:`torch_offload_pass`: the partitioner's activation offloading
  (``torch._functorch.config.enable_activation_offloading``): saved values
  copied to host memory after their last forward use and back in the backward,
  on a transfer stream with prefetch. torch picks the values a joint-graph pass
  marks (``node.meta["should_offload"]``); :func:`mark_for_offload` marks every
  forward value of at least ``min_bytes``, and torch's own checks leave out
  what it cannot move (views, non-contiguous values, static inputs, the model's outputs).
  CUDA only: the copies use torch's ``ao`` ops and a CUDA stream.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch._functorch.config
import torch._inductor.config

__all__ = ["OFFLOAD_MIN_BYTES", "TORCH_FP8", "TORCH_FP8_DEFAULTS", "TORCH_FP8_SEEN", "mark_for_offload",
           "torch_fp8_pass", "torch_offload_pass"]

# Both fp8 configurations let the pass see the tensors sh.fp8() packs: every floating saved value at any size,
# the graph's inputs (primals: parameters, the batch) excluded, as savedhooks never hooks them under compile.
TORCH_FP8_SEEN = {"allowed_dtypes": "torch.float32;torch.bfloat16;torch.float16", "size_in_mb": 0.0,
                  "exclude_primals": True}
# e4m3 with one scale per row of the innermost dim. ``use_scaling`` is set: torch 2.13's forward defaults it
# to True and its backward to False, so left unset the forward scales and the backward never divides back
# (docs/torch-issues.md; tests/compile/test_torch_fp8_pass.py).
TORCH_FP8 = {**TORCH_FP8_SEEN, "quant_type": "torch.float8_e4m3fn", "use_scaling": True}
TORCH_FP8_DEFAULTS = dict(TORCH_FP8_SEEN)  # torch's defaults otherwise: e5m2, use_scaling unset
OFFLOAD_MIN_BYTES = 1024  # the smallest value torch offload moves: sh.offload()'s default min_bytes


def torch_fp8_pass(options: dict[str, Any]) -> contextlib.AbstractContextManager:
    """torch's fp8 activation pass turned on with ``options``, for what compiles inside the block.

    Args:
        options: the pass's options
            (``post_grad_fusion_options["activation_quantization_aten_pass"]``).

    Returns:
        The inductor config patch, a context manager.
    """
    return torch._inductor.config.patch(post_grad_fusion_options={"activation_quantization_aten_pass": dict(options)})


def _nbytes(value: Any) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    return value.numel() * value.element_size()


def mark_for_offload(gm: torch.fx.GraphModule, joint_inputs: Any = None, *,
                     min_bytes: int = OFFLOAD_MIN_BYTES) -> torch.fx.GraphModule:  # fmt: skip
    """A joint-graph pass: mark every computed value of at least ``min_bytes`` for torch's offload.

    The partitioner offloads the marked values that the forward saves for the
    backward and that its own checks admit; the rest of the marks are ignored.

    Args:
        gm: the joint forward-backward graph (``torch._functorch.config.joint_custom_pass``'s argument).
        joint_inputs: the joint graph's inputs (unused; part of the pass's signature).
        min_bytes: smaller values are not marked.

    Returns:
        ``gm``, its nodes' ``meta["should_offload"]`` set.

    Raises:
        ValueError: ``min_bytes`` is negative.
    """
    if min_bytes < 0:
        raise ValueError(f"mark_for_offload: min_bytes must be >= 0, got {min_bytes}")
    for node in gm.graph.nodes:
        if node.op == "call_function" and _nbytes(node.meta.get("val")) >= max(min_bytes, 1):
            node.meta["should_offload"] = True
    return gm


def torch_offload_pass(min_bytes: int = OFFLOAD_MIN_BYTES) -> contextlib.AbstractContextManager:
    """torch's partitioner offload of every saved value of at least ``min_bytes``, with its transfer stream.

    Turns on ``enable_activation_offloading`` with the separate stream
    (``activation_offload_separate_stream``: torch's ``ao.offload`` /
    ``ao.reload`` / ``ao.wait_tensor`` ops), the forward's waits sunk to the
    graph's end (``activation_offload_sink_wait``) and the backward's reloads
    prefetched (``activation_reload_prefetch``), and installs
    :func:`mark_for_offload` as ``joint_custom_pass``.

    Args:
        min_bytes: the smallest value offloaded.

    Returns:
        The ``torch._functorch.config`` patch, a context manager; it applies to
        graphs compiled inside it.

    Raises:
        ValueError: ``min_bytes`` is negative.
    """
    if min_bytes < 0:
        raise ValueError(f"torch_offload_pass: min_bytes must be >= 0, got {min_bytes}")
    return torch._functorch.config.patch(
        enable_activation_offloading=True,
        activation_offload_separate_stream=True,
        activation_offload_sink_wait=True,
        activation_reload_prefetch=True,
        joint_custom_pass=functools.partial(mark_for_offload, min_bytes=min_bytes),
    )
