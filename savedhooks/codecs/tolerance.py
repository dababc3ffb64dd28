"""Which saved tensors a lossy codec may pack: those whose every backward reader tolerates a relative error.

A lossy codec (fp8, int8 rows, bf16) returns each value with an error relative
to it, or to its block's largest. Whether the gradients survive depends on the
op that reads the value in the backward, not on the value: a matrix product
sums products whose errors average out; ``exp(log_alpha - nll)`` in a CTC
loss's backward turns an error of 2**-4 of a log-probability of -100 into a
factor of e**6. :data:`FAMILIES` lists the ops whose backward is known to
tolerate such an error, with the reason for each; anything else is kept as it
is.

The reader of a saved value is the forward op whose backward formula reads it:

* under ``torch.compile`` (:func:`compiled_readers`), every node of the
  backward graph carries ``seq_nr``, the sequence number of the forward op it
  belongs to, and ``partitioner_tag``: ``is_backward`` for the op's backward
  formula, ``is_forward`` for a forward op the partitioner recomputes there. A
  recomputed op passes the value's error on to its own readers, so those are
  followed too;
* in eager mode (:func:`eager_reader`), the autograd nodes that saved the
  tensor, found by :mod:`savedhooks.hooks.eager` (``eager_window``), name the
  op: ``MmBackward0`` is ``mm``'s backward. A custom ``autograd.Function`` is
  never on the list.

Where a reader cannot be told (no ``seq_nr``, a saver not found), the value
is kept: lossy only where it is known to be safe.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from savedhooks._torch.autograd import is_custom_function_node, saved_exponent
from savedhooks.memory.graph import backward_uses, op_name, through_aliases

__all__ = [
    "CENTRED_NORMS",
    "FAMILIES",
    "Family",
    "Reader",
    "TOLERANT_OPS",
    "compiled_error",
    "compiled_readers",
    "compiled_tolerates",
    "eager_error",
    "eager_reader",
    "eager_readers_of",
    "eager_tolerates",
    "normalized",
    "tolerates",
    "verdict",
]


@dataclasses.dataclass(frozen=True)
class Family:
    """Ops whose backward tolerates a relative error in the saved values it reads.

    Attributes:
        name: a short name for the docs and logs.
        ops: forward op names as :func:`normalized` spells them (aten
            overload-packet names without leading underscores).
        role: which saved values of the op: ``"any"``, ``"input"`` (a value the
            op read, made elsewhere), ``"result"`` (a value the op made,
            including its intermediates under a decomposition) or
            ``"centred"`` (any, packed by a codec that centres it).
        reason: why the error is tolerated.
        error: which error: ``"relative"`` (each value off by a fraction of
            itself: fp8, bf16) or ``"block"`` (off by a fraction of its
            block's largest, small values to 0: int8 blocks, as well as
            relative). A backward linear in the value (a product's factor)
            takes either; one that compares it with 0 or reads its
            logarithmic range takes only ``"relative"``.
    """

    name: str
    ops: frozenset[str]
    role: str
    reason: str
    error: str = "relative"


# Normalizations that subtract a mean: their input tolerates only a codec that packs its deviation from the mean.
CENTRED_NORMS: frozenset[str] = frozenset({
    "native_layer_norm", "layer_norm", "native_group_norm", "group_norm", "native_batch_norm", "batch_norm",
    "native_batch_norm_legit", "native_batch_norm_legit_functional", "cudnn_batch_norm", "miopen_batch_norm",
    "native_layer_norm_backward", "native_group_norm_backward", "native_batch_norm_backward",
})  # fmt: skip

FAMILIES: tuple[Family, ...] = (
    Family(
        "products", frozenset({
            "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "matmul", "linear", "einsum",
            "convolution", "convolution_backward", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
            "conv_transpose2d", "conv_transpose3d", "cudnn_convolution", "mkldnn_convolution",
            "convolution_overrideable", "mul", "addcmul", "scaled_mm", "grouped_mm",
        }), "any",
        "the saved value is a factor: the gradient it forms is a sum of products, each off by the value's own "
        "relative error, and independent roundings average out over the sum", "block",
    ),  # fmt: skip
    Family(
        "smooth activations", frozenset({
            "gelu", "silu", "mish", "softplus", "elu", "celu", "selu", "hardswish", "hardsigmoid", "glu",
            "log_sigmoid", "log_sigmoid_forward",
        }), "any",
        "the derivative f'(x) is smooth and x * f''(x) is bounded, so an error relative to x moves f'(x) by a "
        "bounded multiple of that error (sigmoid and tanh are not on the list: they save their output s, and "
        "near saturation an error relative to s is a large error relative to 1 - s, so to the derivative "
        "s * (1 - s) or 1 - s**2, the only gradient of a parameter that sets the saturation, such as a "
        "learned attention sink)", "block",
    ),  # fmt: skip
    Family(
        "masks", frozenset({
            "relu", "threshold", "hardtanh", "relu6", "leaky_relu", "clamp", "clamp_min", "clamp_max", "abs",
            "rrelu_with_noise",
        }), "any",
        "the backward only compares the value with constants: rounding keeps its sign, and only values within "
        "a rounding step of a clip point can change side",
    ),  # fmt: skip
    Family(
        "sums", frozenset({"add", "sub", "rsub"}), "any",
        "a sum of values with relative errors is off by at most those errors times the terms' magnitudes: "
        "small against the sum unless the terms cancel, and a cancelling difference matters only where an op "
        "amplifies it (exp, a division), which is off the list and checked as the sum's reader (only a "
        "recomputed sum reads its operands in the backward)", "block",
    ),
    Family(
        "exponential's output", frozenset({"exp"}), "result",
        "the backward multiplies the gradient by the output (grad * exp(x)): the output's relative error, no "
        "more (its input is not on the list: exp of a value of magnitude m turns a relative error e into a "
        "factor exp(m * e))",
    ),
    Family(
        "softmax outputs", frozenset({"softmax", "safe_softmax"}), "result",
        "softmax's backward y * (g - sum(g * y)) is linear in its output y, probabilities of one scale per row: "
        "an error relative to the row's largest will do, and the policy packs them in int8 rows (Int8Rows). "
        "Not fp8: where a row is spread evenly (attention at initialization) g - sum(g * y) is a difference "
        "that cancels, and an error of 2**-4 of each probability, 16 times int8's on such a row, passes into "
        "sum(g * y) whole (narrow softmaxes, a classifier's head, are kept by the policy's narrow_softmax rule)",
        "block",
    ),
    Family(
        "log-softmax outputs", frozenset({"log_softmax"}), "result",
        "log-softmax's backward g - exp(y) * sum(g) moves each probability p by p * |log p| times the error, "
        "at most 1/e of it (narrow log-softmaxes, a classifier's head, are kept by the policy's narrow_softmax "
        "rule)",
    ),
    Family(
        "powers of at least 1", frozenset({"pow"}), "any",
        "x ** p with p >= 1 (square in RMS norm): the derivative p * x ** (p - 1) has a relative error of "
        "(p - 1) times the value's (a smaller or a tensor exponent is not on the list)", "block",
    ),
    Family(
        "RMS normalization", frozenset({"rms_norm", "fused_rms_norm", "fused_rms_norm_backward"}), "any",
        "the backward reads x * rstd: each value keeps its own relative error, and rstd, a mean of squares, "
        "averages the errors out; the statistics themselves are kept (keep_ops)", "block",
    ),
    Family(
        "centred normalization", CENTRED_NORMS, "centred",
        "layer, group and batch norm read (x - mean) * rstd, whose error is the value's relative error times "
        "|x| / std: unbounded where the input's mean is large against its spread (a post-norm residual "
        "stream, embeddings scaled up). Tolerated only from a codec that packs the deviation from the mean "
        "(Centered: a batch norm's input under inductor); otherwise kept",
    ),
    Family(
        "fused attention", frozenset({
            "scaled_dot_product_flash_attention", "scaled_dot_product_flash_attention_for_cpu",
            "scaled_dot_product_efficient_attention", "scaled_dot_product_cudnn_attention",
            "scaled_dot_product_fused_attention_overrideable", "flash_attention_forward",
            "efficient_attention_forward", "cudnn_attention_forward",
        }), "any",
        "the value only: a factor of a product (the output's gradient times the value gives the "
        "probabilities' gradient), packed in int8 rows, a scale per head vector, 2**-8 of its largest. Not "
        "the query and the key: the backward recomputes exp(q . k * scale - logsumexp), and an error relative "
        "to q and k is an error of the logits' magnitude in an exponent (exp's input, off the list). Not the "
        "output: the backward subtracts rowsum(grad_out * out) from each probability's gradient, a difference "
        "that cancels where attention is spread evenly. The logsumexp is kept (keep_ops)", "block",
    ),  # fmt: skip
)

TOLERANT_OPS: frozenset[str] = frozenset().union(*(f.ops for f in FAMILIES))

# Ops that pass a value on unchanged in every element they keep: a recomputed one hands the error to its readers.
_MOVES = frozenset({
    "view", "unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze", "slice",
    "select", "clone", "alias", "detach", "convert_element_type", "to_copy", "contiguous", "as_strided", "split",
    "split_with_sizes", "unbind", "cat", "stack", "constant_pad_nd", "neg", "getitem", "copy", "where",
    "masked_fill",
})  # fmt: skip

_BY_OP: dict[str, Family] = {op: f for f in FAMILIES for op in f.ops}
_ATTENTION = next(f for f in FAMILIES if f.name == "fused attention")


def normalized(name: str | None) -> str | None:
    """An op's name as :data:`FAMILIES` spells it: the overload-packet name without leading underscores.

    Args:
        name: an aten overload-packet name (``"_softmax"``) or None.

    Returns:
        The name (``"softmax"``), or None.
    """
    return None if name is None else name.lstrip("_")


def tolerates(op: str | None, role: str, extra: Iterable[str] = (), centred: bool = False) -> bool:
    """Whether ``op``'s backward tolerates a relative error in a saved value of this role.

    Args:
        op: the reader's forward op, :func:`normalized`.
        role: ``"input"`` or ``"result"``.
        extra: further op names a user allowed (``sh.policy(allow=...)``), any role.
        centred: the codec packs the value's deviation from its mean (:class:`~savedhooks.codecs.Centered`).

    Returns:
        True when the op is in a family of :data:`FAMILIES` for that role
        (a ``"centred"`` family only with ``centred``), or in ``extra``.
    """
    if op is None:
        return False
    if op in extra:
        return True
    family = _BY_OP.get(op)
    if family is None:
        return False
    return centred if family.role == "centred" else family.role in ("any", role)


# --- under torch.compile ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reader:
    """A forward op that reads a saved value in the backward.

    Attributes:
        op: the op's name as :func:`normalized` spells it; None when it cannot be told.
        role: ``"result"`` when the value is the op's own output (or, under a
            decomposition, one of its intermediates), else ``"input"``.
        exponent: for ``pow``, its scalar exponent where known.
        operand: for fused attention, which operand the value is
            (``"query"``, ``"key"``, ``"value"``, ``"output"``; empty where not told).
    """

    op: str | None
    role: str
    exponent: Any = None
    operand: str = ""


# forward graph -> (its node count, its nodes by seq_nr): built once per graph, not once per saved value
_BY_SEQ: weakref.WeakKeyDictionary[torch.fx.Graph, tuple[int, dict[int, list[torch.fx.Node]]]] = (
    weakref.WeakKeyDictionary()
)


def _forward_ops(fw_graph: torch.fx.Graph) -> dict[int, list[torch.fx.Node]]:
    """The forward graph's nodes by ``seq_nr`` (rebuilt when the graph's node count changed)."""
    count = len(fw_graph.nodes)
    cached = _BY_SEQ.get(fw_graph)
    if cached is not None and cached[0] == count:
        return cached[1]
    by_seq: dict[int, list[torch.fx.Node]] = {}
    for node in fw_graph.nodes:
        seq = node.meta.get("seq_nr")
        if seq is not None:
            by_seq.setdefault(seq, []).append(node)
    _BY_SEQ[fw_graph] = (count, by_seq)
    return by_seq


def _op_of(node: torch.fx.Node) -> str | None:
    return normalized(op_name(node.meta.get("original_aten", node.target)))


def _may_have_gradient(node: torch.fx.Node) -> bool:
    """Whether a forward node can be the op a backward formula belongs to.

    Not an in-place op (the copies back into mutated inputs at a functional
    graph's end: buffers) and not an integer value (batch norm's
    ``num_batches_tracked += 1``), which share a neighbour's ``seq_nr``.
    """
    op = _op_of(node) or ""
    val = node.meta.get("val")
    return not op.endswith("_") and not (isinstance(val, torch.Tensor) and not val.is_floating_point())


def _reader(
    user: torch.fx.Node, value: torch.fx.Node, by_seq: dict[int, list[torch.fx.Node]], derived: bool
) -> Reader | None:
    """The forward op that reads ``value`` at a backward-graph node; None when it cannot be told.

    A recomputed forward node (``partitioner_tag`` ``is_forward``) is its own
    op. A node of a backward formula belongs to the forward op of its
    ``seq_nr``. ``derived``: ``value`` was recomputed from the saved value
    (its error is the saved value's, passed through the recomputation).
    """
    seq = user.meta.get("seq_nr")
    same_op = seq is not None and seq == value.meta.get("seq_nr")
    if user.meta.get("partitioner_tag") == "is_forward":
        op = _op_of(user)
        if op == "div" and user.args and user.args[0] is value and all(a is not value for a in user.args[1:]):
            op = "mul"  # a numerator: the quotient keeps its relative error (a divisor is off the list)
        role = "result" if same_op and _op_of(value) == op else "input"
        return Reader(op, role if not derived else "input", _exponent([user]) if op == "pow" else None)
    if seq is None:
        return None
    forward = [n for n in by_seq.get(seq, []) if _may_have_gradient(n)]
    ops = {_op_of(n) for n in forward} - {None, "getitem"} if forward else {_op_of(user)}
    # a backward formula's nodes carry the backward op (native_layer_norm_backward) or its pieces (sub, exp),
    # and the partitioner may move its parts that need no gradient into the forward: the forward op of the same
    # sequence number names the op whose backward it is
    ops = {o for o in ops if not o.endswith(("_backward", "_backward_data"))} or ops
    ops = ops - _MOVES or ops  # and so may the views of saved operands it reads (a transpose for bmm's backward)
    op = ops.pop() if len(ops) == 1 else None
    exponent = _exponent(forward) if op == "pow" else None
    # a value recomputed from a saved one carries the saved value's error through a function the walk
    # accepted, not a rounding of its own: its readers are judged as readers of an input
    role = "result" if not derived and seq == through_aliases(value).meta.get("seq_nr") else "input"
    return Reader(op, role, exponent)


def _exponent(nodes: list[torch.fx.Node]) -> Any:
    """The exponent of a ``pow`` among ``nodes`` (2 where inductor decomposed it into ``x * x``), else None."""
    pows = [n for n in nodes if op_name(n.target) == "pow"]
    if pows:
        return pows[0].args[1] if len(pows[0].args) > 1 else None
    if nodes and all(op_name(n.target) == "mul" for n in nodes if _op_of(n) == "pow"):
        return 2
    return None


# the attention operands in the positions every fused attention backward takes them: (grad_out, query, key, value)
_ATTENTION_OPERANDS = {1: "query", 2: "key", 3: "value"}


def _tolerated(reader: Reader, extra: Iterable[str], centred: bool = False) -> bool:
    if _BY_OP.get(reader.op or "") is _ATTENTION and reader.op not in extra:
        return reader.operand == "value"  # the value alone is a product's factor; an operand not told: kept
    if reader.op == "pow" and "pow" not in extra:
        return isinstance(reader.exponent, (int, float)) and reader.exponent >= 1
    return tolerates(reader.op, reader.role, extra, centred)


def _error(reader: Reader, extra: Iterable[str], centred: bool) -> str | None:
    """The error ``reader`` tolerates (``"block"`` or ``"relative"``), or None."""
    if not _tolerated(reader, extra, centred):
        return None
    family = _BY_OP.get(reader.op or "")
    return "block" if family is not None and family.error == "block" and family.role != "centred" else "relative"


def verdict(readers: Iterable[Reader] | None, extra: Iterable[str] = (), centred: bool = False) -> str | None:
    """The error every reader tolerates: ``"block"``, ``"relative"``, or None (a reader tolerates neither).

    Args:
        readers: the value's backward readers, or None when they cannot be told.
        extra: op names the user allowed besides :data:`FAMILIES` (they get ``"relative"``).
        centred: the codec packs the value's deviation from its mean.

    Returns:
        None when ``readers`` is None or empty or one is not tolerant;
        ``"block"`` when each tolerates an error relative to its block's
        largest (:attr:`Family.error`); else ``"relative"``.
    """
    if readers is None:
        return None
    errors = [_error(r, extra, centred) for r in readers]
    if not errors or None in errors:
        return None
    return "block" if all(e == "block" for e in errors) else "relative"


def compiled_readers(
    name: str, fw_node: torch.fx.Node, bw_graph: torch.fx.Graph, fw_graph: torch.fx.Graph, limit: int = 64
) -> list[Reader] | None:
    """The forward ops whose backward (or recomputation in the backward) reads a saved value.

    Args:
        name: the saved value's name (a placeholder of ``bw_graph``).
        fw_node: its node in the forward graph.
        bw_graph: the backward graph being compiled.
        fw_graph: the forward graph.
        limit: how many recomputed nodes to follow before giving up.

    Returns:
        The readers (a recomputed forward op that passes values on unchanged,
        a view or a cast, is followed to its own readers instead), or None when
        some reader cannot be told: a node without ``seq_nr``, or more than
        ``limit`` recomputed nodes.
    """
    by_seq = _forward_ops(fw_graph)
    readers: list[Reader] = []
    # (backward node, the forward value it reads, the backward node that holds that value)
    todo = [(user, fw_node, read) for user, read in backward_uses(name, bw_graph)]
    seen: set[torch.fx.Node] = set()
    while todo:
        user, value, read = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "output":
            return None  # returned as it is: a gradient made of the value
        reader = _reader(user, value, by_seq, derived=value is not fw_node)
        if reader is None:
            return None
        if user.meta.get("partitioner_tag") == "is_forward":
            # recomputed: its output carries the error on; a value-moving op is not a reader itself
            if len(seen) > limit:
                return None
            if reader.op not in _MOVES:
                readers.append(reader)
            todo.extend((u, user, user) for u in user.users)
        else:
            readers.append(_with_operand(reader, user, read))
    return readers


def _with_operand(reader: Reader, user: torch.fx.Node, read: torch.fx.Node) -> Reader:
    """``reader`` with the attention operand the value is, where ``user`` is a fused attention's backward."""
    if _BY_OP.get(reader.op or "") is not _ATTENTION:
        return reader
    held = through_aliases(read)
    positions = [i for i, a in enumerate(user.args) if isinstance(a, torch.fx.Node) and through_aliases(a) is held]
    names = {_ATTENTION_OPERANDS.get(i, "output") for i in positions}
    operand = "query" if "query" in names else "key" if "key" in names else names.pop() if names else ""
    return dataclasses.replace(reader, operand=operand)


def compiled_tolerates(ctx: Any, extra: Iterable[str] = (), centred: bool = False) -> bool:
    """Whether every backward reader of the value being packed under compile tolerates a lossy codec.

    Args:
        ctx: the :class:`~savedhooks.hooks.HookContext` of the value.
        extra: op names the user allowed besides :data:`FAMILIES`.
        centred: the codec packs the value's deviation from its mean.

    Returns:
        True when the readers are known, there is at least one, and each is tolerant.
    """
    return compiled_error(ctx, extra, centred) is not None


def compiled_error(ctx: Any, extra: Iterable[str] = (), centred: bool = False) -> str | None:
    """The error every backward reader of the value being packed under compile tolerates (:func:`verdict`).

    Args:
        ctx: the :class:`~savedhooks.hooks.HookContext` of the value.
        extra: op names the user allowed besides :data:`FAMILIES`.
        centred: the codec packs the value's deviation from its mean.

    Returns:
        ``"block"``, ``"relative"`` or None.
    """
    return verdict(compiled_readers(ctx.node.name, ctx.node, ctx.bw_graph, ctx.fw_graph), extra, centred)


# --- in eager mode ---------------------------------------------------------------------

_NODE_NAME = re.compile(r"^(?P<op>[A-Za-z0-9]+)Backward\d+$")


def eager_reader(node: Any) -> Reader | None:
    """The forward op of a built-in autograd node, and what it saved, as a :class:`Reader`.

    Args:
        node: an autograd node (``x.grad_fn`` and the like) that saved the value.

    Returns:
        The reader (``MmBackward0`` is ``mm``, ``ScaledDotProductFlashAttentionForCpuBackward0``
        is ``scaled_dot_product_flash_attention_for_cpu``), or None for a custom
        ``autograd.Function`` and any node whose name is not ``<Op>Backward<n>``.
    """
    if is_custom_function_node(node):
        return None
    match = _NODE_NAME.match(type(node).__name__)
    if match is None:
        return None
    op = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", match["op"]).lower()
    return Reader(op, "input", saved_exponent(node) if op == "pow" else None)


def eager_tolerates(
    x: torch.Tensor,
    savers: Iterable[Any] | None,
    extra: Iterable[str] = (),
    centred: bool = False,
    saved_as: Iterable[tuple[Any, str]] | None = None,
) -> bool:
    """Whether every autograd node that saved ``x`` tolerates a lossy codec (eager mode).

    Args:
        x: the saved tensor.
        savers: the nodes that saved it (every one), or None when they are not all known.
        extra: op names the user allowed besides :data:`FAMILIES`.
        centred: the codec packs the value's deviation from its mean.
        saved_as: ``(node, saved variable name)`` of each saver
            (:func:`savedhooks.hooks.eager_saved_as`): which operand of fused
            attention the tensor is (its value alone is tolerated).

    Returns:
        True when the savers are known, there is at least one, and each is tolerant
        (a node that saved ``x`` as its own output reads it in the role ``"result"``).
    """
    return eager_error(x, savers, extra, centred, saved_as) is not None


def eager_readers_of(
    x: torch.Tensor, savers: Iterable[Any] | None, saved_as: Iterable[tuple[Any, str]] | None = None
) -> list[Reader] | None:
    """The readers of ``x`` in eager mode: one per autograd node that saved it; None where one cannot be told.

    Args:
        x: the saved tensor.
        savers: the nodes that saved it (every one), or None when they are not all known.
        saved_as: ``(node, saved variable name)`` of each saver: which operand of fused attention it is.

    Returns:
        The readers (a node that saved ``x`` as its own output reads it in the
        role ``"result"``), or None.
    """
    if savers is None:
        return None
    readers = []
    for node in savers:
        reader = eager_reader(node)
        if reader is None:
            return None
        if node is x.grad_fn:
            reader = dataclasses.replace(reader, role="result")
        if _BY_OP.get(reader.op or "") is _ATTENTION:
            names = {name for saver, name in saved_as or () if saver is node}
            reader = dataclasses.replace(reader, operand="query" if "query" in names else "key" if "key" in names
                                         else "value" if "value" in names else "output")  # fmt: skip
        readers.append(reader)
    return readers


def eager_error(
    x: torch.Tensor,
    savers: Iterable[Any] | None,
    extra: Iterable[str] = (),
    centred: bool = False,
    saved_as: Iterable[tuple[Any, str]] | None = None,
) -> str | None:
    """The error every autograd node that saved ``x`` tolerates (:func:`verdict` of :func:`eager_readers_of`).

    Args:
        x: the saved tensor.
        savers: the nodes that saved it (every one), or None when they are not all known.
        extra: op names the user allowed besides :data:`FAMILIES`.
        centred: the codec packs the value's deviation from its mean.
        saved_as: ``(node, saved variable name)`` of each saver.

    Returns:
        ``"block"``, ``"relative"`` or None.
    """
    return verdict(eager_readers_of(x, savers, saved_as), extra, centred)
