"""How the reorder pass reaches the compilers: inductor's post-grad slot, ``sh.backend``, the hooks' context.

* :class:`ReorderPass`: :mod:`savedhooks.compiler.passes` as inductor's
  ``post_grad_custom_post_pass`` (a CustomGraphPass, keyed in the FX graph
  cache by a digest of its sources and options). In hooked forward graphs it
  also keeps saved inputs in their own layout (:mod:`savedhooks.compiler.input_layout`).
* :func:`inductor_placement`: what entering :class:`savedhooks.saved_tensors_hooks`
  sets, so that plain ``torch.compile`` gets the pass.
* :func:`backend`: ``sh.backend("aot_eager")`` / ``sh.backend("inductor")``,
  placement without touching configs.
* :func:`placed_compile`: marks a compile whose compilers will place the unpacks
  (``sh.backend("aot_eager")``, the planner's recording): the codecs read it
  (:func:`savedhooks.codecs.placement.unpacks_placed`) while the hooks are traced,
  before any compiler runs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Iterator

import torch
import torch.fx

import savedhooks.kernels.offload  # noqa: F401  (registers savedhooks::offload, which the pass looks for)
from savedhooks._torch import aot, fixes, inductor
from savedhooks._torch.dynamo import aot_eager, boxed_nop, checkpoint_side_effects_once
from savedhooks.compiler.input_layout import keep_input_layout, recorded_weights, restore_input_layout
from savedhooks.compiler.overlap import overlap_transfers
from savedhooks.compiler.passes import has_hook_chains, is_backward_graph, place_hooks, reorder_for_memory
from savedhooks.compiler.unfuse import join_adjacent, split_late_addmm
from savedhooks.hooks import HookPair, applied, check_hook_pair
from savedhooks.hooks.contract import placed_compile, placing_requested
from savedhooks.hooks.identity import source_digest
from savedhooks.memory.timing import makes_cuda_tensor

__all__ = [
    "ReorderPass",
    "backend",
    "inductor_placement",
    "placed_aot_eager",
    "placed_compile",
    "placing_requested",
    "post_grad_passes",
    "reorder_pass",
    "saved_tensors_hooks",
]


class ReorderPass(inductor.CustomGraphPass):
    """The reorder pass as inductor's ``post_grad_custom_post_pass`` (a CustomGraphPass).

    By default it reorders backward graphs only: there inductor leaves the
    unpacks at the start, and moving each to its first user lowers the
    backward's peak. In forward graphs inductor's fusion decides more than the
    order does, and an FX-level order can lose (``python -m
    benchmarks.reorder_inductor`` measures both):

    * with inductor's ``reorder_for_peak_memory`` on, its fused kernels write
      outputs in place into dying inputs, which depends on what each kernel
      fuses, so an FX-level order can peak above inductor's own;
    * with it off, inductor can fuse the placed pack kernels with one another
      into one kernel at the end of the graph, so the full-size activations
      live to the end again, whatever the modelled order predicts.

    With ``hooked_only`` it leaves graphs without inlined hooks untouched (the
    pass that entering :func:`savedhooks.saved_tensors_hooks` installs).

    In a forward graph with inlined hooks it has inductor return the saved
    inputs themselves, not channels_last copies of them that no hook would see
    (convolution weights only where inductor optimizes the layout), and in its
    backward copies those weights to channels_last right before their
    convolution backward (:mod:`savedhooks.compiler.input_layout`).

    A forward graph that it does not reorder gets its hooks placed
    (:func:`place_hooks`, judged with inductor's fusion modelled, kept unless
    that models higher) when it offloads or computes on CUDA: torch
    inlines every pack at the end of the forward, and inductor runs every
    copy to the host, and on CUDA every pack kernel that it fuses with
    nothing, where the graph has it: without placement, the float32
    activations stay alive to the end of the forward. On the CPU inductor
    fuses most packs into their producers, and its own forward order is as low
    as the placed one or lower (``tests/compile/test_passes.py``'s 4-layer MLP
    with the decomposed codec), so CPU graphs keep it.

    In every graph it runs, copies between an accelerator and the host made by
    ``sh.offload`` become torch's asynchronous copy ops, placed to overlap
    compute (:func:`savedhooks.compiler.overlap.overlap_transfers`).

    ``uuid()`` digests savedhooks' sources (every file of the package and its
    kernels: :func:`savedhooks.hooks.identity.source_digest`), the pass's options, and in a backward the weights its forward kept
    (:func:`savedhooks.compiler.input_layout.recorded_weights`), so inductor's FX graph
    cache misses when the pass would change a graph differently and hits when
    it would not.
    """

    def __init__(self, forward: bool = False, hooked_only: bool = False) -> None:
        self.forward = forward
        self.hooked_only = hooked_only

    def __call__(self, graph: torch.fx.Graph) -> None:
        is_backward = is_backward_graph(graph)
        hooked = has_hook_chains(graph)
        if self.hooked_only and not hooked:
            return
        if hooked and is_backward:  # the weights kept in the forward, back to channels_last
            restore_input_layout(graph)
        self._order(graph, is_backward, hooked)
        if hooked and not is_backward:  # saved inputs returned as themselves; last, on the final graph
            keep_input_layout(graph)

    def _order(self, graph: torch.fx.Graph, is_backward: bool, hooked: bool) -> None:
        reorder = is_backward or self.forward
        offloads = any(n.target is torch.ops.savedhooks.offload.default for n in graph.nodes)
        placed = offloads or (hooked and any(makes_cuda_tensor(n) for n in graph.nodes if n.op == "call_function"))
        if not (reorder or placed):
            return
        gm = graph.owning_module
        if gm is None:  # inductor hands over the graph of a GraphModule; keep it that way
            gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        if reorder:
            split = split_late_addmm(gm.graph)
            reorder_for_memory(gm, is_backward, fused=True)
            if join_adjacent(gm.graph, split):
                gm.recompile()
        else:  # a forward that offloads or runs on CUDA: inductor runs copies and unfused packs where they are
            place_hooks(gm, is_backward, fused=True)
        overlap_transfers(gm, is_backward)  # offload copies (accelerator <-> host) only

    def uuid(self) -> str:
        """This pass's key in inductor's FX graph cache: a digest of what changes its output (see the class notes)."""
        bandwidth = aot.offload_bandwidth_gbps()  # times the overlap of offload copies
        # a backward's copies of the weights its forward kept (input_layout) depend on that forward's compile
        weights = ",".join(sorted(recorded_weights()))
        options = f"forward={self.forward}:hooked_only={self.hooked_only}:copy_gbps={bandwidth}:weights={weights}"
        return hashlib.sha256(f"{source_digest()}:{options}".encode()).hexdigest()

    def __repr__(self) -> str:
        return f"ReorderPass(forward={self.forward}, hooked_only={self.hooked_only})"


def reorder_pass(forward: bool = False) -> ReorderPass:
    """The pass to give inductor: ``torch.compile(model, options={"post_grad_custom_post_pass": sh.compiler.reorder_pass()})``.

    Args:
        forward: reorder forward graphs too (default: backward graphs only, where
            inductor leaves the unpacks at the start; see :class:`ReorderPass`).

    Returns:
        A :class:`ReorderPass` (one shared instance per option: equal passes, equal cache keys).
    """
    fixes.install()
    return _REORDER_PASSES[bool(forward), False]


def post_grad_passes(slot) -> tuple:
    """The passes of inductor's ``post_grad_custom_post_pass`` setting, in the order torch runs them.

    Args:
        slot: the setting: None, one pass, or a list or tuple of passes.

    Returns:
        A tuple of passes (empty for None).
    """
    return tuple(slot) if isinstance(slot, (list, tuple)) else (() if slot is None else (slot,))


def _with_pass(slot, ours: ReorderPass):
    """``slot`` (inductor's post-grad pass setting: None, a pass, or a list/tuple) with ``ours`` run last."""
    passes = post_grad_passes(slot)
    if any(isinstance(p, ReorderPass) for p in passes):  # already placed (sh.compiler.reorder_pass(), a nested block)
        return slot
    return ours if not passes else (*passes, ours)


def placed_buffers() -> contextlib.AbstractContextManager[None]:
    """Inductor's buffer settings under :func:`inductor_placement`: its buffer-reuse pool off.

    For a caller that places hooks itself (the planner's check records a step
    as the plan's own step runs it). The reason is in :func:`inductor_placement`.

    Returns:
        A context manager that restores the setting on exit.
    """
    return inductor.config.patch(allow_buffer_reuse=False)


@contextlib.contextmanager
def inductor_placement(enabled: bool = True) -> Iterator[None]:
    """Make inductor place inlined hooks in the graphs compiled inside the block.

    Adds the reorder pass (hooked graphs only; it also returns their saved
    inputs as themselves, :mod:`savedhooks.compiler.input_layout`) to inductor's
    ``post_grad_custom_post_pass``, after any pass already set there (torch runs
    a tuple of passes in order and keys its FX graph cache on all their uuids),
    and has AOTAutograd compile the backward graph together with the forward
    (``force_non_lazy_backward_lowering``): torch otherwise compiles it at the
    first ``backward()``, after the block has exited. It also turns off
    inductor's buffer-reuse pool (``allow_buffer_reuse``): that pool keeps a freed
    buffer allocated until a later buffer of the same size takes it over, so a
    dequantized activation, freed right after its matmul, would stay allocated
    through the next layer's backward (across a ViT's attention backward, for
    one). Freeing at the last use
    never holds more bytes; in-place reuse (``inplace_buffers``) is kept. Entered
    by :class:`savedhooks.saved_tensors_hooks`; all settings are restored on exit.

    Args:
        enabled: False leaves inductor's settings as they are (the opt-out).

    Returns:
        A context manager (yielding nothing).
    """
    if not enabled:
        yield
        return
    slot = _with_pass(inductor.config.post_grad_custom_post_pass, _REORDER_PASSES[False, True])
    with inductor.config.patch(post_grad_custom_post_pass=slot), placed_buffers(), \
            aot.config.patch(force_non_lazy_backward_lowering=True):  # fmt: skip
        yield


def backend(base: str = "aot_eager"):
    """A ``torch.compile`` backend that applies hook placement without touching configs.

    Args:
        base: ``"aot_eager"`` (graphs run by aten, no inductor) or ``"inductor"``.

    Returns:
        A callable to pass as ``torch.compile(model, backend=...)``.

    Raises:
        ValueError: ``base`` is neither.
    """
    fixes.install()
    if base == "aot_eager":
        return _AOT_EAGER_BACKEND
    if base == "inductor":
        return _inductor_backend
    raise ValueError(f"savedhooks.backend: base must be 'aot_eager' or 'inductor', got {base!r}")


def placed_aot_eager(gm: torch.fx.GraphModule, example_inputs, **keywords):
    """torch's ``aot_eager`` run inside :func:`placed_compile`: for graph compilers that place the unpacks.

    Args:
        gm: the graph dynamo captured.
        example_inputs: its example inputs.
        **keywords: passed on to ``aot_eager`` (``fw_compiler``, ``bw_compiler``).

    Returns:
        What ``aot_eager`` returns.

    Raises:
        Whatever ``aot_eager`` raises.
    """
    with placed_compile():
        return aot_eager(gm, example_inputs, **keywords)


def _placing(is_backward: bool):
    def compiler(gm: torch.fx.GraphModule, example_inputs):
        reorder_for_memory(gm, is_backward)
        overlap_transfers(gm, is_backward)
        # run as aot_eager does: an Interpreter that drops inputs and values after their last use
        return boxed_nop(gm, example_inputs)

    return compiler


def _inductor_backend(gm: torch.fx.GraphModule, example_inputs):
    slot = {"post_grad_custom_post_pass": _REORDER_PASSES[False, False]}
    return inductor.compile_fx(gm, example_inputs, config_patches=slot)


# One shared instance per option: equal passes, equal cache keys.
_REORDER_PASSES = {(f, h): ReorderPass(forward=f, hooked_only=h) for f in (False, True) for h in (False, True)}
# torch's own aot_eager (its min-cut partitioner, its input-mutation handling) with
# placement added: the same graphs as "aot_eager", only reordered.
_AOT_EAGER_BACKEND = functools.partial(placed_aot_eager, fw_compiler=_placing(False), bw_compiler=_placing(True))


class saved_tensors_hooks(contextlib.ContextDecorator):  # noqa: N801 - mirrors torch's name
    """Apply a :class:`HookPair` to tensors saved for backward inside the block.

    Works around eager code and around ``torch.compile``d models (the hooks are
    then inlined into the compiled graphs). Nested blocks behave like torch's:
    the innermost pair wins. Usable as a decorator; re-entrant.

    Placement: inside the block, a model compiled with plain ``torch.compile``
    (inductor) gets savedhooks' reorder pass, so each unpack runs right before
    its first use in the backward graph (:func:`savedhooks.compiler.api.inductor_placement`).
    It is added after any ``post_grad_custom_post_pass`` already set in inductor's
    config, touches only graphs with inlined hooks, and compiles the backward
    graph together with the forward (torch would otherwise compile it lazily at
    the first ``backward()``, outside the block). A pass given to
    ``torch.compile(options=...)`` replaces the slot for that compile, as torch's
    config patches do: list ``savedhooks.compiler.api.reorder_pass()`` there too. Graphs
    compiled before entering (no hooks) are not recompiled for it; the hook
    guard recompiles them when the hooks change.

    Checkpointed regions compiled inside the block (a plan's recomputed
    blocks, transformers' gradient checkpointing) are traced into the graph
    even when their forward mutates Python state, such as the kernel registry
    transformers' attention layers set and reset: the mutation runs in the
    forward only, not again in the recompute
    (:func:`savedhooks._torch.dynamo.checkpoint_side_effects_once`).

    Args:
        hooks: a HookPair, e.g. from :func:`hook` or a codec such as ``savedhooks.fp8()``.
        reorder: False leaves inductor's configuration alone (no placement, lazy
            backward compile as torch does it, saved inputs returned in the
            layout inductor chooses: :mod:`savedhooks.compiler.input_layout`).

    Raises:
        HookTypeError: ``hooks`` is a :class:`PackHook` without an unpack function.
        TypeError: ``hooks`` is anything else that is not a HookPair, or
            ``reorder`` is not a bool.
    """

    def __init__(self, hooks: HookPair, reorder: bool = True) -> None:
        self.hooks = check_hook_pair(hooks)
        if not isinstance(reorder, bool):
            raise TypeError(f"savedhooks.saved_tensors_hooks: reorder must be a bool, got {reorder!r}")
        self.reorder = reorder
        self._entered: list[contextlib.ExitStack] = []

    def __enter__(self) -> HookPair:
        fixes.install()
        with contextlib.ExitStack() as stack:
            stack.enter_context(inductor_placement(self.reorder))
            stack.enter_context(aot.every_saved_value_hooked())
            stack.enter_context(checkpoint_side_effects_once())
            stack.enter_context(applied(self.hooks))
            self._entered.append(stack.pop_all())
        return self.hooks

    def __exit__(self, *exc_info: object) -> None:
        self._entered.pop().__exit__(*exc_info)
