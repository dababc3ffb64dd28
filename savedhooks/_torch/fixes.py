"""Work-arounds for torch bugs met on savedhooks' own code paths (the only code that patches torch).

Each runs only on the releases that have its bug (:data:`savedhooks._torch.version.BUGS`).

Design notes
------------
* **Checkpointed random ops.** When a checkpointed region holds an op that
  draws random numbers (SDPA on CPU, dropout), the partitioner's
  ``functionalize_rng_ops`` saves the generator state for the recompute: the
  forward outputs ``getitem(run_and_save_rng_state(...), 0)`` (an auto-generated
  name such as ``getitem_4``) and the backward reads it as a new placeholder
  named ``rng_state_output_<k>``. AOTAutograd's inlining of saved-tensor hooks
  then matches forward outputs to backward inputs *by name* and fails with
  ``AssertionError: could not find saved tensor getitem_4 in bw_g_inputs`` (for
  torch's own GraphModule hooks as well). Both graphs list the states in the
  same order (the partitioner appends them to the forward's outputs and inserts
  the placeholders before the tangents, one per random op), so the k-th forward
  state is renamed after the k-th backward placeholder before the hook is
  inlined. Names carry no meaning at run time (outputs and inputs are matched by
  position), so the rename changes nothing but the assertion.
* **Inductor's dtype-propagation handler sets itself up on every construction.**
  ``torch._inductor.dtype_propagation.DtypePropagationOpsHandler`` is a singleton
  (``__new__`` returns the one instance), but Python still runs its ``__init__``
  each time, and that ``__init__`` installs a ``functools.partial`` per op rule
  (about 200 ``setattr`` calls and a ``dir``). Inductor constructs it once per op
  it generates code for: about 20,000 times for a 1-block transformer under
  ``sh.fp8()``, whose decomposed codec adds ops to every kernel it lands in. Fixed
  upstream (pytorch/pytorch#192820); up to torch 2.14 :func:`set_up_dtype_propagation_once`
  runs the set-up again only when torch's table of op rules differs from the one
  it last ran with (a rule registered later, such as a new pointwise lowering).
  Same attributes, same code generated. Installed by :func:`install` when
  savedhooks' hooks or compilers are first used (``import savedhooks`` alone
  leaves torch as it is); from then on every compile in the process gets it.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx

from savedhooks._torch.aot import run_and_save_rng_state
from savedhooks._torch.fx import rename_node
from savedhooks._torch.version import has_bug

__all__ = ["align_rng_state_names", "install", "rng_state_outputs", "set_up_dtype_propagation_once"]

_BACKWARD_STATE_PREFIX = "rng_state_output_"  # torch/_functorch/partitioners.py: functionalize_rng_ops


def rng_state_outputs(fw_graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The generator states a forward graph saves for checkpointed random ops, in output order.

    Args:
        fw_graph: a partitioned forward graph.

    Returns:
        The ``getitem(run_and_save_rng_state(...), 0)`` nodes among its outputs.
    """
    outputs = fw_graph.output_node().args[0]
    return [
        n
        for n in outputs
        if isinstance(n, torch.fx.Node)
        and n.target is operator.getitem
        and n.args[1] == 0
        and isinstance(n.args[0], torch.fx.Node)
        and n.args[0].target is run_and_save_rng_state
    ]


def align_rng_state_names(fw_graph: torch.fx.Graph, bw_graph: torch.fx.Graph) -> None:
    """Give each saved generator state its backward placeholder's name (see the module notes).

    Idempotent; does nothing on a torch without the bug (2.14 and later), when
    the graphs hold no such states, or when their counts disagree (an unknown
    layout: torch's own assertion then speaks).

    Args:
        fw_graph: the forward graph AOTAutograd is inlining hooks into.
        bw_graph: its backward graph.
    """
    if not has_bug("rng_state_names"):
        return
    forward = rng_state_outputs(fw_graph)
    if not forward:
        return
    backward = [n for n in bw_graph.find_nodes(op="placeholder") if n.name.startswith(_BACKWARD_STATE_PREFIX)]
    if len(forward) != len(backward):
        return
    for state, placeholder in zip(forward, backward):
        rename_node(state, placeholder.name)


def set_up_dtype_propagation_once() -> bool:
    """Have inductor's ``DtypePropagationOpsHandler`` run its set-up only when its op rules changed (see notes).

    Idempotent. Only on the releases with the bug (``BUGS["dtype_propagation_setup"]``:
    every supported one; fixed upstream after 2.14); elsewhere nothing is changed.

    Returns:
        True if the handler's ``__init__`` is (now) the once-only one.
    """
    if not has_bug("dtype_propagation_setup"):
        return False
    from torch._inductor import dtype_propagation
    from torch._inductor import utils as inductor_utils

    handler = dtype_propagation.DtypePropagationOpsHandler
    if getattr(handler.__init__, "_savedhooks_once", False):
        return True
    set_up = handler.__init__

    @functools.wraps(set_up)
    def __init__(self) -> None:
        rules = inductor_utils.op_dtype_propagation_rules
        if self.__dict__.get("_savedhooks_rules") == rules:
            return
        set_up(self)
        self._savedhooks_rules = dict(rules)

    __init__._savedhooks_once = True
    handler.__init__ = __init__
    return True


def install() -> None:
    """Install the work-arounds that patch torch (idempotent; each checks the release it is for).

    Called when savedhooks' hooks are entered (:class:`savedhooks.saved_tensors_hooks`)
    and when its compiler pieces are built (``sh.backend``, ``sh.compiler.reorder_pass``).
    The checkpointed-random-ops fix patches nothing: it runs inside the hooks.
    """
    set_up_dtype_propagation_once()
