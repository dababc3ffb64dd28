"""Temporaries an op allocates and frees while it runs, for the ops whose code we own.

A graph model sees an op's inputs and outputs, not what the op allocates inside.
For aten ops that is inductor's and AOTAutograd's view too. Our codecs' ops run
the aten reference in ``savedhooks.kernels`` on CPU, whose float32 temporaries
are bounded by one chunk of rows but reach a few MiB: enough to decide where a
pack is best placed. So each ``savedhooks::fp8_*`` node's scratch is measured
once per shape class and cached: the reference runs on one chunk of rows of
zeros under the CPU memory profiler (:func:`savedhooks.memory.measure_peak`),
and its peak above the op's own outputs is the scratch. One chunk is enough:
the chunk loop frees everything between chunks. A dispatch mode counting the
tensors the reference creates would see only part of it (aten kernels allocate
inside, e.g. in copies between layouts).

From one chunk of elements on, the ops run the inductor-compiled decomposed form
on CPU instead (``savedhooks.kernels.fp8_inductor``), which allocates little
beyond its outputs (the quantize's per-group amax; two chunks of codes with a
last short block): that figure is counted (``inductor_scratch_bytes``, measured
equal in ``tests/codec/test_inductor_codec.py``), not the reference's.

Some aten ops allocate inside too, on CPU (:data:`MEASURED_ATEN`): a
convolution's forward and backward hold temporaries of the order of their
input, SDPA's CPU backward and layer norm's backward less; a matrix product
nothing. The vit's step under inductor with the codec peaks in its patch
convolution's backward, after every other gradient is made: without its
scratch the model would predict that step well under the measured peak
(``python -m benchmarks.tools.inductor_prediction`` compares them). These are
measured the same way, once per op, shapes, strides, dtypes and arguments: the op runs on zeros
under the CPU memory profiler, and its peak above its outputs is the scratch.
Measured in the layout of the arguments: under inductor (``fused``) the
strides it passed the op where the compile was recorded (:data:`EXTERN_STRIDES`),
else the graph's. The two can differ, and the scratch with them: a depthwise
convolution's CPU backward on a channels_last input (the graph's layout where
the input is a permuted NHWC tensor) allocates several times what it does on
the layout inductor gives the input it computes (how many times depends on the
CPU's convolution kernels).

On CUDA the same holds for other ops (:data:`MEASURED_CUDA_ATEN`): a reduction
that aten splits across thread blocks (``sum(x, [0])`` of a tall tensor, a
Linear's bias gradient in the backward graphs that aot_eager runs) stages
partial results in a buffer from torch's allocator, up to twice the summed
tensor (``test_measured_cuda_training_step_matches_the_prediction`` checks a
Linear-GELU-Linear step against the prediction). cuDNN's convolutions take
their workspace from the same allocator, and SDPA's CUDA kernels some of
theirs (the memory-efficient attention's backward allocates and frees a buffer
inside the call). These are
measured where a GPU is present, on zeros on that device, by the allocator's
peak after one warm-up call (a first call may set up what later calls reuse).
Where a graph is modelled as inductor runs it (``fused``), only the ops it
leaves to aten are (convolutions, SDPA): it compiles reductions and layer
norm's backward into kernels of its own;
without a GPU (fake CUDA tensors) they count 0. Measuring resets CUDA's peak
memory statistics (``torch.cuda.reset_peak_memory_stats``), once per op and
shapes, while a graph is modelled (inside a compile, or ``sh.plan``): a peak
read across a step that compiles starts from there. Unlike the CPU profiler's
case, nothing can tell whether a user is reading that peak.

One aten op is counted too: ``native_dropout`` in training on CPU draws its
mask as a float tensor of the input's size and dtype before casting it to bool
(measured: the scratch equals the input's bytes, at every shape and dtype
tried), also where checkpointing runs it under ``run_and_save_rng_state`` /
``run_with_rng_state``. A placed backward that recomputes a dropout at its peak
measured that much above the model without it (``tests/planner/test_recompute.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import torch.fx

from savedhooks._torch import pytree
from savedhooks._torch.aot import run_and_save_rng_state, run_with_rng_state
from savedhooks._torch.ops import OpOverload
from savedhooks._torch.profiler import profiler_enabled
from savedhooks._torch.tensors import unset_fake_temporarily
from savedhooks.kernels.fp8 import _row_chunks, torch_fp8_dequantize, torch_fp8_quantize
from savedhooks.kernels.fp8_inductor import inductor_scratch_bytes, inductor_serves
from savedhooks.memory.measure import measure_peak
from savedhooks.memory.sizes import allocated_bytes, float_hint, size_hint

__all__ = ["EXTERN_STRIDES", "MEASURED_ATEN", "MEASURED_CUDA_ATEN", "op_scratch_bytes"]

# node meta: the strides of the tensor arguments inductor passed the op (as an extern kernel), in argument
# order; set by the recorder of the compiled graphs (savedhooks.planner.recording)
EXTERN_STRIDES = "savedhooks_extern_strides"

log = logging.getLogger(__name__)

_aten = torch.ops.aten
# aten ops whose CPU kernels allocate temporaries of the order of their inputs (module notes)
MEASURED_ATEN = frozenset({
    _aten.convolution.default,
    _aten.convolution_backward.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    _aten.native_layer_norm_backward.default,
})  # fmt: skip
# aten ops whose CUDA kernels take temporaries from torch's allocator (module notes): those inductor
# compiles into kernels of its own, which stage nothing there this way, and those it leaves to aten
_CUDA_LOWERED = frozenset({
    _aten.sum.default,
    _aten.sum.dim_IntList,
    _aten.mean.default,
    _aten.mean.dim,
    _aten.amax.default,
    _aten.amin.default,
    _aten.native_layer_norm_backward.default,
})  # fmt: skip
_CUDA_EXTERN = frozenset({
    _aten.convolution.default,
    _aten.convolution_backward.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_efficient_attention_backward.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_backward.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_cudnn_attention_backward.default,
})  # fmt: skip
MEASURED_CUDA_ATEN = _CUDA_LOWERED | _CUDA_EXTERN


def _chunk_rows(rows: int, cols: int) -> int:
    return min(rows, _row_chunks(rows, cols).step)


def _scratch(run, device: str = "cpu") -> int:
    """Peak bytes ``run()`` allocates on ``device`` above its own outputs (measured; on CUDA after a warm-up call).

    CUDA's allocator counts each block rounded up to 512 bytes: the outputs are subtracted so rounded.
    """
    if torch.device(device).type == "cuda":
        run()
    held = []
    peak = measure_peak(lambda: held.append(run()), device=device)
    outputs = [t for t in pytree.tree_leaves(held) if isinstance(t, torch.Tensor)]
    return max(0, peak - sum(allocated_bytes(t.untyped_storage().nbytes(), device) for t in outputs))


@functools.lru_cache(maxsize=256)
def _fp8_quantize_scratch(dtype: torch.dtype, rows: int, cols: int, args: tuple, stochastic: bool = False) -> int:
    with unset_fake_temporarily():  # called by compilers, inside AOTAutograd's fake mode
        x = torch.zeros(rows, cols, dtype=dtype)
        seed = torch.zeros((), dtype=torch.int64) if stochastic else None
        return _scratch(lambda: torch_fp8_quantize(x, *args, seed))


@functools.lru_cache(maxsize=256)
def _fp8_dequantize_scratch(
    q_dtype: torch.dtype, rows: int, cols: int, scale_rows: int, scale_cols: int, args: tuple
) -> int:
    with unset_fake_temporarily():
        q = torch.zeros(rows, cols, dtype=q_dtype)
        scale = torch.ones(scale_rows, scale_cols)
        return _scratch(lambda: torch_fp8_dequantize(q, scale, *args))


def _scale_value(node: torch.fx.Node, quantize: bool):
    """The op's fake scale: the quantize's second output, the dequantize's second argument (None if unknown)."""
    if quantize:
        vals = node.meta.get("val")
        return vals[1] if isinstance(vals, (tuple, list)) and len(vals) == 2 else None
    return node.args[1].meta.get("val") if isinstance(node.args[1], torch.fx.Node) else None


def op_scratch_bytes(node: torch.fx.Node, fused: bool = False) -> int:
    """Bytes an op allocates and frees inside itself (0 for the ops not modelled).

    Args:
        node: an FX node; its arguments carry ``meta["val"]``.
        fused: the graph is modelled as inductor runs it: on CUDA only the ops
            it leaves to aten (convolutions, SDPA) are measured, not the
            reductions and layer norm's backward it compiles itself.

    Returns:
        The scratch bytes of ``savedhooks::fp8_quantize`` / ``fp8_dequantize``
        nodes (their aten reference, or from one chunk of elements on CPU their
        compiled form), of ``aten::native_dropout`` training on CPU, and of the
        aten ops of :data:`MEASURED_ATEN` on CPU and :data:`MEASURED_CUDA_ATEN`
        on CUDA where a GPU is present (see the module notes), else 0.

    Raises:
        Nothing: a node whose arguments lack fake values or have data-dependent
        sizes counts 0, an op that fails to run on zeros counts 0, and so does a
        measurement on the CPU while a profiler is active (it would nest profilers).
    """
    if node.op != "call_function":
        return 0
    dropout = _dropout_scratch(node)
    if dropout or not isinstance(node.target, OpOverload):
        return dropout
    name = node.target.name()
    if node.target in MEASURED_ATEN or node.target in MEASURED_CUDA_ATEN:
        return _aten_scratch(node, fused)
    if name not in ("savedhooks::fp8_quantize", "savedhooks::fp8_dequantize") or _profiling(name):
        return 0
    first = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    if not isinstance(first, torch.Tensor) or first.dim() != 2:
        return 0
    rows, cols = (size_hint(s) for s in first.shape)
    if rows * cols == 0:
        return 0
    quantize = name == "savedhooks::fp8_quantize"
    # the seed (stochastic rounding) is a graph node: only whether there is one
    stochastic = quantize and (node.args[5] if len(node.args) > 5 else node.kwargs.get("seed")) is not None
    scale = _scale_value(node, quantize)
    if inductor_serves((rows, cols), first.device):
        if not isinstance(scale, torch.Tensor):
            return 0
        scale_shape = tuple(size_hint(s) for s in scale.shape)
        # block_size is argument 3 of both ops; None: the reference runs (stochastic, short last block)
        compiled = inductor_scratch_bytes(quantize, (rows, cols), scale_shape, node.args[3], stochastic)
        if compiled is not None:
            return compiled
    chunk = _chunk_rows(rows, cols)
    if quantize:
        return _fp8_quantize_scratch(first.dtype, chunk, cols, tuple(node.args[1:5]), stochastic)
    if not isinstance(scale, torch.Tensor):
        return 0
    scale_rows = chunk if size_hint(scale.shape[0]) != 1 else 1
    return _fp8_dequantize_scratch(
        first.dtype, chunk, cols, scale_rows, size_hint(scale.shape[1]), tuple(node.args[2:])
    )


@dataclasses.dataclass(frozen=True)
class _Zeros:
    """A tensor argument of a measured call: rebuilt as zeros of this shape, stride and dtype on this device."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"


def _profiling(name: str) -> bool:
    """Whether a profiler is active: measuring on the CPU starts one, and a nested one would end the user's."""
    if profiler_enabled():
        # count none (the model without scratch) rather than disturb their trace
        log.info("savedhooks: a profiler is active; %s scratch not measured (counted 0)", name)
        return True
    return False


def _can_measure(device: torch.device) -> bool:
    """Whether aten ops can run on ``device`` here (CUDA: a GPU is present; fake CUDA tensors have none)."""
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())


def _measured_on(node: torch.fx.Node, fused: bool) -> torch.device | None:
    """The device ``node``'s op is measured on: that of all its tensor arguments, if the op is measured there."""
    vals = [
        a.meta.get("val")
        for a in pytree.tree_leaves((node.args, node.kwargs))
        if isinstance(a, torch.fx.Node)
    ]
    if not vals or not all(isinstance(v, torch.Tensor) for v in vals) or len({v.device for v in vals}) != 1:
        return None
    device = vals[0].device
    ops = {"cpu": MEASURED_ATEN, "cuda": _CUDA_EXTERN if fused else MEASURED_CUDA_ATEN}.get(device.type, ())
    return device if node.target in ops and _can_measure(device) else None


def _aten_scratch(node: torch.fx.Node, fused: bool) -> int:
    """An op of :data:`MEASURED_ATEN` on CPU or of :data:`MEASURED_CUDA_ATEN` on CUDA: its measured scratch
    at the node's shapes, on the device of its tensor arguments (0 if they are unknown, on several devices,
    or on one where the op is not measured or cannot run here)."""
    device = _measured_on(node, fused)
    if device is None or (device.type == "cpu" and _profiling(node.target.name())):
        return 0

    tensors = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.fx.Node)]
    recorded = node.meta.get(EXTERN_STRIDES) if fused else None
    strides = dict(zip(tensors, recorded, strict=True)) if recorded and len(recorded) == len(tensors) else {}

    def spec(arg):
        if isinstance(arg, torch.fx.Node):
            val = arg.meta["val"]
            shape = tuple(map(size_hint, val.shape))
            stride = strides.get(arg) or tuple(map(size_hint, val.stride()))
            return _Zeros(shape, tuple(stride), val.dtype, str(device))
        if isinstance(arg, torch.SymFloat):
            return float_hint(arg)
        return size_hint(arg) if isinstance(arg, torch.SymInt) else arg

    try:
        args = pytree.tree_map(spec, (node.args, node.kwargs))
    except RuntimeError as error:  # a data-dependent size (no hint)
        log.info("savedhooks: scratch of %s not measured (%s); counted 0", node.target, error)
        return 0
    return _measured_aten_scratch(node.target, _frozen(args))


def _frozen(value):
    """Lists as tuples and dicts as sorted pairs, so that a call's arguments can key a cache."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


@functools.lru_cache(maxsize=256)
def _measured_aten_scratch(op: OpOverload, frozen: tuple) -> int:
    """The scratch of ``op`` on zeros (0, cached too, where it fails: an argument it cannot rebuild, no memory).

    Every tensor argument is on one device (:func:`_measured_on`).
    """

    def real(value):
        if isinstance(value, _Zeros):
            return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device=value.device).zero_()
        return [real(v) for v in value] if isinstance(value, tuple) else value

    device = torch.device(next(z.device for z in pytree.tree_leaves(frozen) if isinstance(z, _Zeros)))
    generators = [device.index or 0] if device.type == "cuda" else []
    try:
        # compilers call this inside AOTAutograd's fake mode; a random op (dropout in SDPA) must not
        # advance the user's generators
        with unset_fake_temporarily(), torch.random.fork_rng(devices=generators):
            args, kwargs = real(frozen[0]), {k: real(v) for k, v in frozen[1]}
            return _scratch(lambda: op(*args, **kwargs), str(device))
    except (RuntimeError, TypeError, ValueError) as error:  # an argument this cannot rebuild, out of memory
        log.info("savedhooks: scratch of %s not measured (%s); counted 0", op, error)
        return 0


def _dropout_scratch(node: torch.fx.Node) -> int:
    """The float mask ``aten::native_dropout`` draws on CPU in training: the input's bytes (else 0)."""
    op, args, kwargs = node.target, node.args, node.kwargs
    if op is run_with_rng_state:  # (rng state, op, *args): a checkpointed op recomputed
        op, args = args[1], args[2:]
    elif op is run_and_save_rng_state:  # (op, *args)
        op, args = args[0], args[1:]
    if op is not torch.ops.aten.native_dropout.default or not args or not isinstance(args[0], torch.fx.Node):
        return 0
    train = args[2] if len(args) > 2 else kwargs.get("train")
    x = args[0].meta.get("val")
    if train is False or not isinstance(x, torch.Tensor) or x.device.type != "cpu":
        return 0
    return size_hint(x.numel()) * x.element_size()
