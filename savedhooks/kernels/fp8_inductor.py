"""The fp8 ops ``savedhooks::fp8_quantize`` / ``fp8_dequantize``, and their CPU path for large tensors.

The ops run the aten reference (``savedhooks.kernels.fp8``), or for large CPU
tensors the decomposed form compiled by inductor (below).

Design notes
------------
* Why: the aten reference (``savedhooks.kernels.fp8``) walks a tensor in chunks of
  16384 elements, so that its float32 temporaries stay under 256 KiB, and each
  chunk costs about ten aten calls. On CPU the calls' overhead dominates on
  large tensors (a language model's log-softmax, 4096 x 2048 float32). The
  decomposed form (``savedhooks.kernels.fp8_fused``), compiled by inductor's C++
  backend, is one vectorized pass that writes the outputs and allocates almost
  nothing else (``python -m benchmarks.kernels --cpu`` times both). It is bit-exact with the
  reference, which stays the spec.
* When (:func:`uses_inductor`): CPU tensors of at least
  :data:`INDUCTOR_MIN_ELEMS` elements, outside any compile (inside one the op is
  a graph node, its fake implementation serves, and nothing here runs; the memory
  model's scratch measurement calls the reference itself), outside any dispatch
  mode (fake modes) and outside FX tracing (``make_fx`` runs the op's body on real
  tensors with its mode popped). Below the threshold one chunk of the
  reference is cheaper than the compiled call's guards.
* How: ``torch.compile(dynamic=True, fullgraph=True)`` of each function,
  precompiled with ``aot_compile`` (torch's precompile API), called under
  ``no_grad`` with CPU autocast off, so the global-state guards never matter
  (nothing is recorded for backward, and autocast touches none of these ops); they
  are dropped, as is the guard on the active saved-tensor hooks (with grad off
  nothing is saved, and entering ``savedhooks.saved_tensors_hooks`` must not
  recompile these kernels). One compile serves every size; the codec's constants
  (dtype, granularity, block size, rounding, a last short block) are guarded, each
  a variant (:class:`_Variants`), checked in order with the variant's own guards.
  Why precompiled: a compiled function's entries live in dynamo's per-code cache,
  which ``torch.compiler.reset()`` empties; tracing the codec again then costs
  seconds per variant on a CPU, and test suites and benchmarks reset between cases.
  The precompiled variants are ours and survive the reset. With
  ``torch._inductor.config.force_disable_caches`` set, ``aot_compile`` refuses,
  and the plain compiled function serves (dynamo's cache, emptied by each reset);
  so it does on torch 2.11, which has no ``aot_compile``.
* A last short block (block scales, columns not a multiple of the block size):
  under dynamic shapes inductor joins the two column segments' codes with an aten
  ``cat``, which copies them. Rows then go in chunks of at most
  :data:`CHUNK_ELEMS` elements, each chunk's codes copied into the output and
  freed before the next. (Codes computed in one pass over all columns, each
  reading its block's scale, are bit-exact under dynamic shapes, but torch 2.13's
  inductor miscompiles the last block under static ones.) Stochastic rounding draws its
  bits from the flat index of the whole tensor, so it keeps the reference there.
* Scratch, measured with the CPU profiler (``tests/codec/test_inductor_codec.py``):
  nothing beyond the outputs but the quantize's per-group amax when a row has
  several groups, and with a last short block two chunks of codes
  (:func:`inductor_scratch_bytes`, what the memory model counts).
* Failure: a compile that fails (no C++ compiler, more than :data:`RECOMPILE_LIMIT`
  variants, or dynamo's recompile limit without caches, which raises here instead
  of running the frame eagerly) turns this path off for the process with one
  warning; the reference serves from then on.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import torch

from savedhooks._torch import dynamo, inductor
from savedhooks._torch.fx import is_fx_symbolic_tracing, shapes_config
from savedhooks._torch.ops import current_dispatch_mode
from savedhooks.kernels.fp8 import (
    _check_dequantize_args,
    _check_quantize_args,
    _scale_shape,
    torch_fp8_dequantize,
    torch_fp8_quantize,
)
from savedhooks.kernels.fp8_fused import fused_fp8_dequantize, fused_fp8_quantize

__all__ = [
    "CHUNK_ELEMS",
    "INDUCTOR_MIN_ELEMS",
    "RECOMPILE_LIMIT",
    "fp8_dequantize",
    "fp8_quantize",
    "inductor_fp8_dequantize",
    "inductor_fp8_quantize",
    "inductor_scratch_bytes",
    "inductor_serves",
    "uses_inductor",
]

log = logging.getLogger(__name__)

# Compiled variants per function: each codec variant (dtype, granularity, block size,
# rounding, input dtype, a last short block) is one (dynamo's cache entries when the
# caches are off, whose default limit of 8 a handful of codecs reach in one process).
RECOMPILE_LIMIT = 64
# Elements from which the compiled form runs: one chunk of the reference
# (``fp8._CHUNK_ELEMS``), below which the reference is a single pass of a few
# small calls and the compiled call's guard checks cost as much.
INDUCTOR_MIN_ELEMS = 1 << 14
# Elements per chunk of rows with a last short block: the copies stay near 2 x 64 KiB.
CHUNK_ELEMS = 1 << 16
_state = {"enabled": True}


def uses_inductor(x: torch.Tensor) -> bool:
    """Whether the fp8 ops run their compiled form for ``x`` (see the design notes).

    Args:
        x: the op's first argument (the tensor to quantize, or the codes).

    Returns:
        True for a real CPU tensor of at least :data:`INDUCTOR_MIN_ELEMS` elements,
        outside compiles and dispatch modes, while the path is on.
    """
    if x.dim() != 2 or not inductor_serves(tuple(x.shape), x.device):
        return False
    if torch.compiler.is_compiling() or dynamo.tracing_context() is not None:
        return False
    if is_fx_symbolic_tracing():  # make_fx runs the op's body with its mode popped
        return False
    return current_dispatch_mode() is None


def inductor_serves(shape: tuple[int, int], device: torch.device | str) -> bool:
    """Whether a run of the fp8 ops on a real tensor of this shape and device takes the compiled form.

    The static part of :func:`uses_inductor` (a graph's node runs later, outside the compile).

    Args:
        shape: the op's 2-D input shape.
        device: its device.

    Returns:
        True on CPU from :data:`INDUCTOR_MIN_ELEMS` elements while the path is on.
    """
    return _state["enabled"] and torch.device(device).type == "cpu" and shape[0] * shape[1] >= INDUCTOR_MIN_ELEMS


def _short_block(cols: int, granularity: str, block_size: int) -> bool:
    return granularity == "block" and block_size < cols and cols % block_size != 0


def _chunk_rows(rows: int, cols: int) -> int:
    return max(1, min(rows, CHUNK_ELEMS // max(cols, 1)))


def inductor_scratch_bytes(
    quantize: bool, shape: tuple[int, int], scale_shape: tuple[int, int], block_size: int, stochastic: bool = False
) -> int | None:
    """Bytes the compiled form allocates beyond its outputs (measured: see the design notes).

    Args:
        quantize: the quantize (else the dequantize).
        shape: the 2-D shape quantized.
        scale_shape: the scale's shape.
        block_size: elements per block.
        stochastic: the quantize has a seed.

    Returns:
        0 for the dequantize. The quantize: its float32 amax, held before the
        scales, when a row has several groups; with a last short block that of one
        chunk of rows plus two chunks of codes (the segments and their join), or
        None with a seed, where the reference runs instead.
    """
    rows, groups = scale_shape
    if not quantize or groups <= 1:
        return 0
    if not _short_block(shape[1], "block", block_size):
        return rows * groups * 4
    if stochastic:
        return None
    chunk = _chunk_rows(*shape)
    return chunk * groups * 4 + 2 * chunk * shape[1]


def _keep_guard(entry) -> bool:
    # nothing is saved under no_grad, and every call runs in _steady_state: global state cannot change the kernel
    return not entry.is_global and entry.guard_type != "AUTOGRAD_SAVED_TENSORS_HOOKS"


def _drop_global_guards(entries) -> list[bool]:
    return [_keep_guard(e) for e in entries]


class _Variants:
    """One function's precompiled variants (see the design notes): the first whose guards pass runs."""

    def __init__(self, fn):
        self.compiled = torch.compile(
            fn, dynamic=True, fullgraph=True, options={"guard_filter_fn": _drop_global_guards}
        )
        self.variants = []

    def __call__(self, *args):
        # aot_compile needs the caches, and torch 2.12+ (a compiled function's method)
        if inductor.config.force_disable_caches or not dynamo.has_aot_compile():
            with torch.compiler.set_stance("default"):  # the codec's own compiles, whatever the caller's stance
                return self.compiled(*args)
        for variant in self.variants:
            if variant.guard_check(*args):
                return variant.fn(*args)
        if len(self.variants) >= RECOMPILE_LIMIT:
            raise RuntimeError(f"savedhooks: {RECOMPILE_LIMIT} compiled variants of the fp8 codec, none fits")
        # constants stay constants (a float argument would otherwise restart the analysis, which
        # aot_compile does not do); no duck sizing, so a square first tensor is not a variant of its own
        with dynamo.config.patch(specialize_float=True), \
                shapes_config.patch(use_duck_shape=False):  # fmt: skip
            variant = self.compiled.aot_compile((args, {}))
        self.variants.append(variant)
        return variant.fn(*args)


@functools.cache
def _compiled(fn) -> _Variants:
    return _Variants(fn)


@contextlib.contextmanager
def _steady_state():
    """The global state every call runs in: grad off, CPU autocast off, a recompile limit that raises."""
    with torch.no_grad(), torch.autocast("cpu", enabled=False), \
            dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):  # fmt: skip
        yield


def _call(fn, reference, *args):
    if _state["enabled"]:
        try:
            with _steady_state():
                return _compiled(fn)(*args)
        except Exception as exc:  # any compile failure: the reference computes the same bytes
            _state["enabled"] = False
            warnings.warn(
                f"savedhooks: compiling the fp8 codec for CPU failed ({type(exc).__name__}: {exc}); "
                "the aten reference runs instead (same bytes, slower)",
                RuntimeWarning,
                stacklevel=3,
            )
            log.debug("savedhooks: inductor fp8 path off", exc_info=True)
    return reference(*args)


def inductor_fp8_quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    block_size: int,
    pow2_scale: bool,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`savedhooks.kernels.fp8.torch_fp8_quantize`, computed by the inductor-compiled decomposed form.

    Args:
        x: ``(rows, cols)`` float32, bfloat16 or float16 CPU tensor.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        granularity: ``"tensor"``, ``"row"`` or ``"block"``.
        block_size: elements per block (``"block"`` only).
        pow2_scale: round scales up to powers of two.
        seed: None (round to nearest even) or a 0-d int64 tensor (stochastic rounding).

    Returns:
        ``(q, scale)`` with the reference's bytes: q of x's shape and ``dtype``
        (contiguous), float32 scale.

    Raises:
        ValueError: as the reference, for invalid arguments (checked before compiling).
    """
    _check_quantize_args(x, dtype, granularity, block_size, seed)

    rows, cols = x.shape
    if not _short_block(cols, granularity, block_size):
        codes, scale = _call(
            fused_fp8_quantize, _reference_quantize, x, dtype, granularity, block_size, pow2_scale, seed
        )
        return codes.view(dtype), scale
    if seed is not None:  # the random bits follow the whole tensor's flat index: no chunks
        return torch_fp8_quantize(x, dtype, granularity, block_size, pow2_scale, seed)
    q = torch.empty((rows, cols), dtype=torch.uint8)
    scale = torch.empty((rows, -(-cols // block_size)), dtype=torch.float32)
    step = _chunk_rows(rows, cols)
    for r in range(0, rows, step):
        codes, s = _call(
            fused_fp8_quantize, _reference_quantize, x[r : r + step], dtype, granularity, block_size, pow2_scale
        )
        q[r : r + step].copy_(codes)
        scale[r : r + step].copy_(s)
        del codes, s  # before the next chunk's call
    return q.view(dtype), scale


def _reference_quantize(*args):
    q, scale = torch_fp8_quantize(*args)
    return q.view(torch.uint8), scale


def inductor_fp8_dequantize(
    q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, block_size: int
) -> torch.Tensor:
    """:func:`savedhooks.kernels.fp8.torch_fp8_dequantize`, computed by the inductor-compiled decomposed form.

    Args:
        q: ``(rows, cols)`` float8 CPU tensor.
        scale: float32 scales as returned by the quantize op.
        out_dtype: dtype of the result.
        block_size: the block size used to quantize.

    Returns:
        ``(rows, cols)`` contiguous tensor of ``out_dtype``, the reference's bytes.

    Raises:
        ValueError: shapes or dtypes of q and scale do not fit together.
    """
    _check_dequantize_args(q, scale)
    codes = q.contiguous().view(torch.uint8)

    def reference(codes, scale, dtype, out_dtype, block_size):
        return torch_fp8_dequantize(codes.view(dtype), scale, out_dtype, block_size)

    return _call(fused_fp8_dequantize, reference, codes, scale, q.dtype, out_dtype, block_size)


# --- ops: one graph node per codec call, traceable inside hook graphs -------------------


@torch.library.custom_op("savedhooks::fp8_quantize", mutates_args=())
def fp8_quantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    granularity: str,
    block_size: int,
    pow2_scale: bool,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.ops.savedhooks.fp8_quantize``: see :func:`torch_fp8_quantize` (large CPU tensors: compiled, same bytes)."""
    quantize = inductor_fp8_quantize if uses_inductor(x) else torch_fp8_quantize
    return quantize(x, dtype, granularity, block_size, pow2_scale, seed)


@fp8_quantize.register_fake
def _(x, dtype, granularity, block_size, pow2_scale, seed=None):
    _check_quantize_args(x, dtype, granularity, block_size, seed)
    rows, cols = x.shape
    scale = x.new_empty(_scale_shape(rows, cols, granularity, block_size), dtype=torch.float32)
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format), scale  # as the real op: contiguous


@torch.library.custom_op("savedhooks::fp8_dequantize", mutates_args=())
def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """``torch.ops.savedhooks.fp8_dequantize``: see :func:`torch_fp8_dequantize` (large CPU tensors: compiled)."""
    dequantize = inductor_fp8_dequantize if uses_inductor(q) else torch_fp8_dequantize
    return dequantize(q, scale, out_dtype, block_size)


@fp8_dequantize.register_fake
def _(q, scale, out_dtype, block_size):
    return torch.empty_like(q, dtype=out_dtype, memory_format=torch.contiguous_format)
