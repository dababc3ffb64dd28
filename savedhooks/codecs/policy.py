"""Choose a codec per saved tensor: by dtype, by size, and by the op that made it.

Under ``torch.compile`` the hook context gives the saved value's FX node, so the
policy can keep what is small but precision-critical (normalization statistics)
as it is. In eager mode there is no graph: the policy decides by dtype and size.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from savedhooks._torch.ops import schema_of
from savedhooks.codecs.backends import inductor_traces, uses_fused
from savedhooks.codecs.base import Codec, as_codec
from savedhooks.codecs.bitmask import Bitmask
from savedhooks.codecs.centered import Centered
from savedhooks.codecs.fp8 import Float8
from savedhooks.codecs.indices import PoolIndices
from savedhooks.codecs.int8 import Int8Blocks, Int8Rows
from savedhooks.codecs.placement import decodes_twice, saved_for_an_eager_loss
from savedhooks.codecs.tolerance import compiled_error, eager_error, normalized
from savedhooks.hooks import eager_largest_saved, eager_readers, eager_saved_as, eager_savers, hook_context
from savedhooks.hooks.contract import HookContext
from savedhooks.hooks.eager import VIEW_NODES
from savedhooks.memory.graph import backward_uses, op_name, producing_op, through_aliases, uses_through_aliases

__all__ = [
    "ATTENTION_NODES",
    "ATTENTION_OPS",
    "BATCH_NORM_OPS",
    "DEFAULT_KEEP_OPS",
    "Policy",
    "SDPA_OPS",
    "is_attention_operand",
    "is_batch_norm_input",
    "is_cast_of_input",
    "is_narrow_softmax",
    "is_periodic_argument",
    "is_softmax_output",
    "is_statistic_of",
    "largest_saved_bytes",
    "policy",
    "producing_op",
    "readers_error",
    "readers_tolerate",
]

# The SDPA kernels (each returns its output, then its logsumexp)
SDPA_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)

# Statistics saved by normalization and fused attention: small, and their error is
# amplified (rstd multiplies every element of a row; the logsumexp of attention
# re-normalizes every probability in backward).
DEFAULT_KEEP_OPS = (
    *SDPA_OPS,
    "native_layer_norm",
    "native_group_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training",
    "_fused_rms_norm",
)

# Batch norm in graphs: as one op (aot_eager) or decomposed with these as original_aten (inductor)
BATCH_NORM_OPS = (
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional",
    "cudnn_batch_norm",
    "miopen_batch_norm",
)

# Fused attention ops: their backward recomputes the probabilities from the saved query and key (against the saved
# logsumexp) and each row's correction rowsum(grad_out * out) from the saved output
ATTENTION_OPS = (
    *SDPA_OPS,
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "_cudnn_attention_forward",
)
# The autograd nodes of the same ops, by which eager mode recognizes their output
ATTENTION_NODES = tuple(
    "".join(part.capitalize() for part in op.removesuffix("_forward").strip("_").split("_")) + "Backward0"
    for op in ATTENTION_OPS
)

# Periodic functions whose argument the backward may recompute from a saved value (rotary angles)
_PERIODIC_OPS = ("sin", "cos", "tan")

# Ops that change a value's dtype, layout or shape and nothing else (what autocast does to a weight), and the
# autograd nodes of the same in eager mode; the casts among them
_CAST_OR_VIEW_OPS = (
    "convert_element_type", "_to_copy", "clone", "alias", "detach", "view", "_unsafe_view", "reshape", "permute",
    "t", "transpose", "expand", "unsqueeze", "squeeze", "slice", "select",
)  # fmt: skip
_CAST_OPS = ("convert_element_type", "_to_copy")
_CAST_OR_VIEW_NODES = VIEW_NODES | {"ToCopyBackward0", "CloneBackward0"}

# (log-)softmax outputs: autograd node names in eager mode, aten op names in graphs
_SOFTMAX_NODES = ("LogSoftmaxBackward0", "SoftmaxBackward0")
_SOFTMAX_OPS = ("_log_softmax", "_softmax", "log_softmax", "softmax")
# softmax outputs alone (probabilities), with the masked softmax of SDPA's math path
_PROBABILITY_NODES = ("SoftmaxBackward0", "SafeSoftmaxBackward0")
_PROBABILITY_OPS = ("_softmax", "softmax", "_safe_softmax")
# matrix products: attention's probabilities times its values
_MATMUL_OPS = ("bmm", "mm", "matmul", "baddbmm", "addmm", "einsum")


def is_statistic_of(node: torch.fx.Node, ops: tuple[str, ...]) -> bool:
    """Whether a saved value is a statistic of one of ``ops``.

    A statistic is an output after the first of a multi-output op (layer norm's
    mean and rstd, not its normalized output), or the output of a single-output
    op. Under inductor the op arrives decomposed (``var_mean``, ``rsqrt``, ...):
    then its nodes carry ``meta["original_aten"]``, and a statistic is a value
    smaller than the largest tensor the decomposed op reads.

    Args:
        node: the saved value's node in the forward graph.
        ops: aten overload-packet names.

    Returns:
        True when the value should be kept as it is.
    """
    node = through_aliases(node)
    if producing_op(node) in ops:
        index = node.args[1] if node.op == "call_function" and node.target is operator.getitem else None
        return index != 0
    original = node.meta.get("original_aten")
    if op_name(original) not in ops:
        return False
    if len(schema_of(original).returns) == 1:
        return True
    return _numel(node) < _largest_input_numel(node, original)


def is_batch_norm_input(node: torch.fx.Node) -> bool:
    """Whether a saved value is the input of a batch norm in the forward graph.

    Batch norm subtracts each channel's mean from it in the backward (under
    inductor also to recompute the normalized values and a following ReLU's
    mask), so a lossy copy should hold its deviation from that mean
    (:class:`~savedhooks.codecs.centered.Centered`).

    Args:
        node: the saved value's node in the forward graph.

    Returns:
        True when a batch norm (one op, or the nodes inductor decomposed it into)
        reads the value as its input and the value is not itself made inside one.
    """
    node = through_aliases(node)
    if op_name(node.meta.get("original_aten")) in BATCH_NORM_OPS or producing_op(node) in BATCH_NORM_OPS:
        return False
    for user in node.users:
        if op_name(user.target) in BATCH_NORM_OPS:
            if user.args and user.args[0] is node:
                return True
        elif op_name(user.meta.get("original_aten")) in BATCH_NORM_OPS:
            return True
    return False


def is_attention_operand(x: torch.Tensor, node: torch.fx.Node | None) -> bool:
    """Whether a saved value is an operand of fused attention: its query, key, value or output.

    The backward of fused attention recomputes the probabilities from the
    saved query and key against the saved logsumexp, and subtracts from each
    row of the probabilities' gradient ``rowsum(grad_out * out)`` computed from
    the saved output. fp8's relative error of up to 2**-4 in these operands
    puts the recomputed probabilities and the saved statistics out of step,
    and the query's and key's gradients take the whole error. The policy's
    :class:`~savedhooks.codecs.Int8Rows` (a scale per head vector, 255
    levels) holds each value to 2**-8 of its row's largest at fp8's byte per
    value; ``sh.fidelity.sensitivity`` measures what each costs on a given
    model.

    Args:
        x: the saved tensor.
        node: its node in the forward graph under compile; None in eager mode,
            where the output is recognized by the autograd node that made it
            (:data:`ATTENTION_NODES`, output 0), and the query, key and value,
            which are saved before the op runs, by that node reading them
            (:func:`savedhooks.hooks.eager_readers`, known when the policy's
            ``eager_window`` held them until the op saved its output).

    Returns:
        Under compile, True when the value (looking through ``detach`` /
        ``alias``) is one of the first three arguments of an op of
        :data:`ATTENTION_OPS`, or that op's first output; in eager mode, True
        for that op's output and for a tensor one of those ops reads.
    """
    if node is None:
        if x.grad_fn is not None and x.output_nr == 0 and type(x.grad_fn).__name__ in ATTENTION_NODES:
            return True
        return not eager_readers().isdisjoint(ATTENTION_NODES)
    node = through_aliases(node)
    if (
        node.op == "call_function"
        and node.target is operator.getitem
        and node.args[1] == 0
        and op_name(getattr(node.args[0], "target", None)) in ATTENTION_OPS
    ):
        return True
    return any(
        op_name(user.target) in ATTENTION_OPS and any(a is value for a in user.args[:3])
        for user, value in uses_through_aliases([node])  # a saved ``detach`` of what the op read
    )


def is_cast_of_input(x: torch.Tensor, node: torch.fx.Node | None, bw_graph: torch.fx.Graph | None = None) -> bool:
    """Whether a saved value is a parameter cast (autocast's bf16 copy of a weight), through casts and views only.

    Without autocast the graph saves a weight as the forward input it is,
    which no codec packs; under autocast it saves the weight's low-precision
    copy for the matmul's input gradient. fp8's rounding of a weight is the
    same error for every token: it does not average out over the batch in the
    gradients, as an activation's does, and it passes into every gradient
    upstream, a layer's share each (bf16 autocast under inductor, the worst
    parameter gradient of the tests' decoder in
    ``test_policy_keeps_autocast_s_weight_copies``).

    Args:
        x: the saved tensor.
        node: its node in the forward graph under compile; None in eager mode.
        bw_graph: under compile, the backward graph, whose outputs tell which
            forward inputs get a gradient (None: any input counts).

    Returns:
        Under compile, True when walking back from the value through
        :data:`_CAST_OR_VIEW_OPS` passes a dtype cast and reaches a placeholder
        of the forward graph that gets a gradient (a parameter; the batch's own
        inputs get none, and their copies are packed as activations are; a
        placeholder reached through views alone may be an activation that an
        earlier graph handed over, which is packed too). In eager
        mode, True when the autograd nodes from ``x.grad_fn`` back are casts
        and views (:data:`_CAST_OR_VIEW_NODES`) down to a leaf's
        ``AccumulateGrad`` (a leaf that requires grad).
    """
    if node is None:
        fn, steps = x.grad_fn, 0
        while fn is not None and type(fn).__name__ in _CAST_OR_VIEW_NODES:
            inputs = [f for f, _ in fn.next_functions if f is not None]
            fn, steps = (inputs[0] if len(inputs) == 1 else None), steps + 1
        return steps > 0 and type(fn).__name__ == "AccumulateGrad"
    cast = False
    while node.op == "call_function" and op_name(node.target) in _CAST_OR_VIEW_OPS and node.args:
        cast = cast or op_name(node.target) in _CAST_OPS
        node = node.args[0]
        if not isinstance(node, torch.fx.Node):
            return False
    return cast and node.op == "placeholder" and (bw_graph is None or _gets_a_gradient(node, bw_graph))


def _gets_a_gradient(placeholder: torch.fx.Node, bw_graph: torch.fx.Graph) -> bool:
    """Whether the backward graph returns a gradient for this forward input (its outputs follow the inputs).

    True where the backward's outputs do not line up with the forward's inputs (unknown: kept).
    """
    inputs = [n for n in placeholder.graph.nodes if n.op == "placeholder"]
    output = next((n for n in reversed(bw_graph.nodes) if n.op == "output"), None)
    grads = output.args[0] if output is not None and output.args else None
    if not isinstance(grads, (tuple, list)) or len(grads) != len(inputs):
        return True
    return grads[inputs.index(placeholder)] is not None


def is_periodic_argument(name: str, bw_graph: torch.fx.Graph) -> bool:
    """Whether the backward computes a sine, cosine or tangent of a saved value (rotary angles).

    Rounding keeps a relative error (up to 2**-4 for fp8 e4m3), so an angle of
    200 radians moves by up to 12 and the recomputed sine and cosine are noise.
    Llama's rotary angles (positions times frequencies, up to the sequence length),
    saved by the partitioner, which recomputes cos and sin in the backward, are
    such values (``sh.fidelity.sensitivity`` on the benchmark's llama shows
    what packing them costs).

    Args:
        name: the saved value's name (a placeholder of ``bw_graph``).
        bw_graph: the backward graph being compiled.

    Returns:
        True when a backward user of the value (looking through ``detach``) is
        ``sin``, ``cos`` or ``tan``.
    """
    return any(op_name(user.target) in _PERIODIC_OPS for user, _ in backward_uses(name, bw_graph))


def is_narrow_softmax(x: torch.Tensor, node: torch.fx.Node | None, classes: int) -> bool:
    """Whether a saved value is a (log-)softmax output over at most ``classes`` values per row.

    A classifier's loss head saves its log-softmax (``(batch, 10)`` after 10
    classes); the values of a row sit in a few binades, so fp8's rounding errors
    share a sign and add up over the batch in every gradient (on a 10-class classifier,
    ``sh.fidelity.sensitivity`` finds that keeping it recovers more than 20 dB).

    Under compile, a softmax whose output feeds a matrix product (through casts
    and views) is attention's probabilities, not a loss head: a sequence of at
    most ``classes`` positions does not make it one (``P @ V`` is a weighted
    sum, whose rounding errors do not share a sign), so it is packed.

    Args:
        x: the saved tensor (its last dim is the softmax dim).
        node: its node in the forward graph under compile, None in eager mode
            (then the autograd node that made ``x`` decides).
        classes: the largest row length that counts as narrow.

    Returns:
        True when ``x`` should be kept as it is.
    """
    if x.dim() == 0 or not isinstance(x.shape[-1], int) or x.shape[-1] > classes:
        return False
    if node is None:
        return type(x.grad_fn).__name__ in _SOFTMAX_NODES
    if producing_op(node) not in _SOFTMAX_OPS and op_name(node.meta.get("original_aten")) not in _SOFTMAX_OPS:
        return False
    return not _feeds_a_matmul(node)


def is_softmax_output(x: torch.Tensor, node: torch.fx.Node | None) -> bool:
    """Whether a saved value is a softmax's output: probabilities, such as attention's written out.

    Its backward ``y * (g - sum(g * y))`` is linear in ``y``, and where a row
    is spread evenly (attention at initialization) the difference cancels, so
    each value's error should be small against the row's largest, not only
    against itself: the policy packs such values in its ``attention`` codec
    (:class:`~savedhooks.codecs.Int8Rows`: 2**-8 of the row's largest, where
    fp8 gives each value 2**-4 of itself).

    Args:
        x: the saved tensor.
        node: its node in the forward graph under compile; None in eager mode,
            where the autograd node that made ``x`` decides.

    Returns:
        True for the output of ``softmax`` or ``_safe_softmax`` (the masked
        softmax of SDPA's math path), under inductor also a value that
        the decomposed softmax made (``meta["original_aten"]``); False for
        ``log_softmax``.
    """
    if node is None:
        return type(x.grad_fn).__name__ in _PROBABILITY_NODES
    node = through_aliases(node)
    return producing_op(node) in _PROBABILITY_OPS or op_name(node.meta.get("original_aten")) in _PROBABILITY_OPS


def _feeds_a_matmul(node: torch.fx.Node) -> bool:
    """Whether a forward value reaches a matrix product's input through casts and views only."""
    seen, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user in seen or user.op != "call_function":
                continue
            seen.add(user)
            name = op_name(user.target)
            if name in _MATMUL_OPS:
                return True
            if name in _CAST_OR_VIEW_OPS:
                todo.append(user)
    return False


def readers_tolerate(x: torch.Tensor, allow: tuple[str, ...] = (), centred: bool = False) -> bool:
    """Whether every backward reader of the saved tensor being packed tolerates a lossy codec.

    Under compile, the forward ops whose backward (or recomputation) reads it
    in the backward graph; in eager mode, the autograd nodes that saved it,
    known only while a codec's ``eager_window`` held it
    (:func:`savedhooks.hooks.eager_savers`).

    Args:
        x: the tensor a pack hook received.
        allow: op names allowed besides :data:`savedhooks.codecs.tolerance.FAMILIES`.
        centred: the codec packs the value's deviation from its mean (a layer,
            group or batch norm's input is tolerated only then).

    Returns:
        True when the readers are known and each is tolerant; False otherwise.
    """
    return readers_error(x, allow, centred) is not None


def readers_error(x: torch.Tensor, allow: tuple[str, ...] = (), centred: bool = False) -> str | None:
    """The error every backward reader of the saved tensor being packed tolerates (see :func:`readers_tolerate`).

    Args:
        x: the tensor a pack hook received.
        allow: op names allowed besides :data:`savedhooks.codecs.tolerance.FAMILIES`.
        centred: the codec packs the value's deviation from its mean.

    Returns:
        ``"block"`` (each reader is linear in the value: an error relative to
        its block's largest will do), ``"relative"`` (some reader needs each
        value's own relative precision), or None (some reader is not known to
        tolerate either, or cannot be told).
    """
    ctx = hook_context()
    if ctx is not None:
        return compiled_error(ctx, allow, centred)
    return eager_error(x, eager_savers(), allow, centred, eager_saved_as())


def largest_saved_bytes(bw_graph: torch.fx.Graph, fw_graph: torch.fx.Graph | None = None) -> int | None:
    """Bytes of the largest tensor a compiled forward saves for its backward that a pack hook packs.

    With ``fw_graph``, a saved value that is an input of the forward (a
    parameter: the caller holds it) or that the forward also returns so that a
    decoded copy would hold its bytes twice (a causal LM's logits, saved for
    the loss's backward and returned; stored as they are,
    :func:`savedhooks.codecs.placement.decodes_twice`) does not count: no codec
    packs it, and a rule relative to it would keep every activation smaller
    than a sixteenth of the logits.

    Args:
        bw_graph: the backward graph being compiled (its placeholders are the
            saved values and the tangents).
        fw_graph: the forward graph, whose nodes have the saved values' names;
            None: every saved value counts.

    Returns:
        The size in bytes, or None when a saved size is symbolic.
    """
    largest = 0
    fw_nodes = {n.name: n for n in fw_graph.nodes} if fw_graph is not None else {}
    for node in bw_graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if node.name.startswith("tangents") or not isinstance(val, torch.Tensor):
            continue
        fw_node = fw_nodes.get(node.name)
        if fw_node is not None and (
            fw_node.op == "placeholder" or decodes_twice(HookContext(fw_node, fw_graph, bw_graph))
        ):
            continue
        numel = val.numel()
        if not isinstance(numel, int):
            return None
        largest = max(largest, numel * val.element_size())
    return largest


def _numel(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _largest_input_numel(node: torch.fx.Node, original: Any, limit: int = 64) -> int:
    """Largest tensor read by the nodes decomposed from the same op as ``node``."""
    name = str(original)  # compared by name: the meta holds equal but not always identical op objects
    largest, frontier, seen = 0, [node], set()
    while frontier and len(seen) < limit:
        current = frontier.pop()
        if current in seen:
            continue
        seen.add(current)
        for arg in current.all_input_nodes:
            largest = max(largest, _numel(arg))
            # getitem nodes carry no original_aten: they are structure, walk through them
            if str(arg.meta.get("original_aten")) == name or arg.target is operator.getitem:
                frontier.append(arg)
    return largest


@dataclasses.dataclass(frozen=True)
class Policy(Codec):
    """Configuration of the policy codec (see :func:`policy`)."""

    floating: Codec | None = Float8()
    boolean: Codec | None = Bitmask()
    integer: Codec | None = PoolIndices()
    min_bytes: int = 1024
    keep_ops: tuple[str, ...] = DEFAULT_KEEP_OPS
    narrow_softmax: int = 256
    relative_bytes: float = 1 / 16
    centered: Codec | None = Centered()
    attention: Codec | None = Int8Rows()
    allow: tuple[str, ...] = ()
    blocks: Codec | None = Int8Blocks()

    def __post_init__(self) -> None:
        for name in ("floating", "boolean", "integer", "centered", "attention", "blocks"):
            object.__setattr__(self, name, as_codec(getattr(self, name), f"policy({name}=...)"))
        if self.centered is not None and not isinstance(self.centered, Centered):
            raise TypeError(f"policy: centered must be a savedhooks.codecs.Centered codec or None, got {self.centered!r}")
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"policy: min_bytes must be a non-negative int, got {self.min_bytes!r}")
        if isinstance(self.keep_ops, str) or not all(isinstance(op, str) for op in self.keep_ops):
            raise ValueError(f"policy: keep_ops must be a tuple of op names, got {self.keep_ops!r}")
        object.__setattr__(self, "keep_ops", tuple(self.keep_ops))
        if not isinstance(self.narrow_softmax, int) or isinstance(self.narrow_softmax, bool) or self.narrow_softmax < 0:
            raise ValueError(f"policy: narrow_softmax must be a non-negative int, got {self.narrow_softmax!r}")
        if not isinstance(self.relative_bytes, (int, float)) or not 0 <= self.relative_bytes < 1:
            raise ValueError(f"policy: relative_bytes must be a number in [0, 1), got {self.relative_bytes!r}")
        if isinstance(self.allow, str) or not all(isinstance(op, str) and op.strip("_") for op in self.allow):
            raise ValueError(f"policy: allow must be a tuple of op names, got {self.allow!r}")
        object.__setattr__(self, "allow", tuple(sorted({normalized(op) for op in self.allow})))

    @property
    def eager_window(self) -> int:
        """In eager mode, how many saved tensors are held before packing, until the nodes that saved them are known.

        A lossy codec needs every node that saved a tensor to be known
        (:func:`savedhooks.hooks.eager_savers`); autograd saves a node's inputs
        before the node exists, so a tensor is held until later saves show
        its savers: at most 6 at a time (a layer's query, key and value
        projections save one input three times, fused attention its query,
        key, value and output). None without a lossy codec.
        """
        lossy = (self.floating, self.centered, self.attention, self.blocks)
        return 6 if any(c.lossy for c in self.codecs() if c in lossy) else 0

    def eager_holds(self, x: torch.Tensor) -> bool:
        """Whether eager mode holds ``x`` until its savers are known: its codec would be lossy."""
        codec = self._candidate(x)
        return codec is not None and codec.lossy and codec.accepts(x)

    def codecs(self) -> tuple[Codec, ...]:
        """The configured codecs, in the fixed order floating, boolean, integer, centered, attention, blocks."""
        every = (self.floating, self.boolean, self.integer, self.centered, self.attention, self.blocks)
        return tuple(c for c in every if c is not None)

    def keeps(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is stored as it is whatever its dtype (the rules of :func:`policy`)."""
        nbytes = x.numel() * x.element_size()
        # a symbolic size (dynamic shapes) is small only if it is at every size: comparing it would add a guard
        if statically_known_true(nbytes < self.min_bytes):
            return True
        ctx = hook_context()
        node = ctx.node if ctx is not None else None
        if x.is_floating_point() and is_narrow_softmax(x, node, self.narrow_softmax):
            return True
        if saved_for_an_eager_loss(x, ctx):
            return True
        if x.is_floating_point() and is_cast_of_input(x, node, ctx.bw_graph if ctx is not None else None):
            return True
        if ctx is None:  # eager: small next to the largest tensor saved so far
            largest = eager_largest_saved() if self.relative_bytes and x.is_floating_point() else None
            return largest is not None and nbytes < self.relative_bytes * largest
        if is_statistic_of(ctx.node, self.keep_ops):
            return True
        if x.is_floating_point() and is_periodic_argument(ctx.node.name, ctx.bw_graph):
            return True
        largest = largest_saved_bytes(ctx.bw_graph, ctx.fw_graph) if self.relative_bytes else None
        return largest is not None and isinstance(nbytes, int) and nbytes < self.relative_bytes * largest

    def _centers(self, x: torch.Tensor, ctx: Any) -> bool:
        """Whether ``x`` goes to ``centered``: a batch norm's input, while the codec's decomposed form is traced.

        Inductor then fuses the subtraction into the quantize kernel. Elsewhere it
        would be a full-size temporary in the forward (the cnn's step under
        aot_eager would peak above no hooks), for little fidelity there,
        where the graph saves ReLU's output and batch norm is not recomputed.
        """
        return (
            self.centered is not None
            and ctx is not None
            and uses_fused(getattr(self.centered.inner, "backend", "auto"), x)
            and self.centered.accepts(x)
            and is_batch_norm_input(ctx.node)
        )

    def _candidate(self, x: torch.Tensor) -> Codec | None:
        """The codec for ``x`` by the rules above, before asking whether its backward readers tolerate it."""
        if self.keeps(x):
            return None
        if x.dtype == torch.bool:
            return self.boolean
        if not x.is_floating_point():
            return self.integer
        codec = self.floating
        ctx = hook_context()
        if codec is not None and self._centers(x, ctx):
            return self.centered
        node = ctx.node if ctx is not None else None
        if codec is not None and self.attention is not None and (
            is_attention_operand(x, node) or is_softmax_output(x, node)
        ):
            return self.attention
        return codec

    def tolerated(self, x: torch.Tensor, codec: Codec | None = None) -> bool:
        """Whether every backward reader of ``x`` tolerates a lossy codec (:mod:`savedhooks.codecs.tolerance`).

        Under compile, the forward ops whose backward (or recomputation)
        reads the value in the backward graph; in eager mode, the autograd
        nodes that saved it, all of them known (:attr:`eager_window`). Each
        must be in :data:`savedhooks.codecs.tolerance.FAMILIES` or ``allow``.
        Unknown readers, custom ``autograd.Function`` s among them: False.
        ``codec``: the codec that would pack ``x`` (a :class:`Centered` one
        is tolerated by a layer, group or batch norm too).
        """
        return readers_tolerate(x, self.allow, centred=isinstance(codec, Centered))

    def choose(self, x: torch.Tensor) -> int:
        """Pick the codec for ``x`` (index into :meth:`codecs`), or -1 to keep it as is.

        A lossy codec is picked only where :meth:`tolerated` says its readers
        tolerate it. Where every reader is linear in the value
        (:func:`readers_error` is ``"block"``), ``blocks`` replaces
        ``floating`` (except while inductor traces the hooks: fp8's fused form
        there); ``attention`` is used only there, else the value is kept.
        Lossless codecs wherever they accept ``x``.
        """
        codec = self._candidate(x)
        if codec is None or not codec.accepts(x):
            return -1
        if codec.lossy:
            error = readers_error(x, self.allow, centred=isinstance(codec, Centered))
            if error is None or (codec is self.attention and error != "block"):
                return -1  # int8 rows round a row's small values to 0: only for readers linear in the value
            # not while inductor traces: the fp8 codec's fused form is the one made to compile without
            # full-size buffers (docs/results/zoo_torch_fp8.md measures it)
            blocks = self.blocks is not None and not inductor_traces() and self.blocks.accepts(x)
            if error == "block" and codec is self.floating and blocks:
                codec = self.blocks
        return self.codecs().index(codec)


def policy(
    floating: Any = Float8(),
    boolean: Any = Bitmask(),
    integer: Any = PoolIndices(),
    min_bytes: int = 1024,
    keep_ops: tuple[str, ...] = DEFAULT_KEEP_OPS,
    narrow_softmax: int = 256,
    relative_bytes: float = 1 / 16,
    centered: Any = Centered(),
    attention: Any = Int8Rows(),
    allow: tuple[str, ...] = (),
    blocks: Any = Int8Blocks(),
):
    """Hooks that pick a codec for each saved tensor, and keep the ones that lossy packing hurts.

    Kept as they are (the rules, from ``sh.fidelity.sensitivity`` on the benchmark
    models, which ``python -m benchmarks.sensitivity`` runs): tensors under ``min_bytes``; normalization and
    attention statistics (``keep_ops``); a (log-)softmax over at most
    ``narrow_softmax`` classes (a classifier's loss head; under compile, not
    one that feeds a matrix product: attention's probabilities); tensors
    smaller than ``relative_bytes`` of the largest one the same graph saves (a
    rotary table shared by the whole batch: its error is the same in every
    sequence; a classifier's pooled input, whose few rows the weight's gradient
    sums without averaging; the largest counted is the largest that a codec
    packs, not a parameter or a value the forward also returns; in eager mode
    the largest floating one saved so far); under compile, the argument
    of a sine, cosine or tangent that the backward recomputes (rotary angles:
    :func:`is_periodic_argument`); a parameter's copy through casts and views
    (autocast's bf16 weight: its rounding error is the same for every token,
    :func:`is_cast_of_input`); in eager mode, a log-softmax's output (an
    eager loss's, which every codec stores as it is: packing it only adds memory
    at the loss's peak, :func:`savedhooks.codecs.placement.saved_for_an_eager_loss`).
    Every lossy choice below is made only where each op that reads the tensor in
    the backward is on :data:`savedhooks.codecs.tolerance.FAMILIES` or ``allow``
    (:meth:`Policy.tolerated`): under compile the readers come from the
    backward graph, in eager mode from the autograd nodes that saved it; where
    they cannot be told, the tensor is kept.
    The rest: int8 blocks for floating tensors whose every reader is linear
    in the value (a product's factor, a smooth activation's input, a sum, RMS
    norm: ``blocks``, an error of at most 1/254 of each block's largest, at
    least 30 dB a block), fp8 for the other floating tensors (each value to
    2**-4 of itself, what a mask or exp's output needs; under inductor, a batch norm's input as
    its deviation from each channel's mean: ``centered``), the value of fused
    attention and a softmax's probabilities in ``attention`` (int8 rows:
    :func:`is_attention_operand`, :func:`is_softmax_output`; fused attention's
    query, key and output are kept by the tolerance rules; in eager mode the
    operands are held until the op saves its output: :attr:`Policy.eager_window`),
    bitmasks for bool ones, max-pool
    indices in int16 or int32 and inductor's
    max-pool window offsets in 2 or 4 bits (lossless).

    Args:
        floating: codec for floating tensors (default fp8 e4m3 block 128), or None.
        boolean: codec for bool tensors (default bitmask), or None.
        integer: codec for integer tensors (default: max-pool indices narrowed to
            int16 / int32 and inductor's int8 pool offsets packed to bits, under
            compile, lossless; others stored as they are), or None.
        min_bytes: tensors smaller than this are stored as they are (a kernel
            launch costs more than it saves). Under dynamic shapes a symbolic
            size counts only if it is smaller at every size (no guard is added).
        keep_ops: ops (aten overload-packet names) whose saved statistics are
            stored as they are: the outputs after the first of a multi-output op
            (layer norm's mean and rstd, not its normalized output), the output
            of a single-output op (add ``"_softmax"`` to keep attention
            probabilities). Known only under ``torch.compile``.
        narrow_softmax: (log-)softmax outputs whose last dim is at most this are
            stored as they are (0: none).
        relative_bytes: tensors smaller than this fraction of the largest
            tensor saved by the same graph (in eager mode: floating tensors, and
            the largest saved so far in the context) are stored as they are
            (0: none): packing them saves little, and a small tensor is often
            one a reduction reads whole (a classifier's pooled input).
        centered: the codec for a batch norm's input instead of ``floating``
            while the codec's decomposed form is traced (under inductor, which
            fuses the subtraction into the quantize kernel and recomputes batch
            norm from the saved input): a :class:`~savedhooks.codecs.Centered`, by
            default fp8 of ``x`` minus each channel's mean, the means kept in
            float32 (fp8's error then scales with each channel's spread, not
            its mean). None: ``floating``. Unused when
            ``floating`` is None.
        attention: the codec for the value of a fused attention op
            (:func:`is_attention_operand`; the tolerance rules keep its
            query, key and output) and for a softmax's output
            (:func:`is_softmax_output`: probabilities, whose backward's row
            sum cancels where a row is spread evenly), instead of ``floating``,
            where every reader is linear in the value; default :class:`~savedhooks.codecs.Int8Rows`
            (int8 codes, a float32 scale per row; rows under 8
            values are kept as they are). None: ``floating``. Unused
            when ``floating`` is None.
        allow: further forward op names (aten names, leading underscores
            optional: ``("cumprod",)``) whose backward may read lossy values,
            in any role; pick them from a measurement (``sh.fidelity.check``).
            Their values get ``floating``.
        blocks: the codec for floating tensors whose every backward reader
            tolerates an error relative to its block's largest
            (:attr:`savedhooks.codecs.tolerance.Family.error` ``"block"``:
            products, smooth activations, sums, powers, RMS norm), instead of
            ``floating``; default :class:`~savedhooks.codecs.Int8Blocks`
            (int8 codes, a float32 scale per 64 values). None: ``floating``.
            In eager mode and graphs run op by op (aot_eager); under inductor
            ``floating`` (its fused fp8 form holds no full-size buffers).
            Unused when ``floating`` is None.

    Returns:
        The cached :class:`~savedhooks.HookPair`.

    Raises:
        TypeError: a codec argument is not a savedhooks codec, or ``centered``
            is not a :class:`~savedhooks.codecs.Centered`.
        ValueError: ``min_bytes``, ``keep_ops``, ``narrow_softmax``,
            ``relative_bytes`` or ``allow`` is malformed.
    """
    return Policy(
        floating, boolean, integer, min_bytes, tuple(keep_ops), narrow_softmax, relative_bytes, centered, attention,
        allow if isinstance(allow, str) else tuple(allow), blocks,
    ).hooks()
