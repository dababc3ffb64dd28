"""The benchmark configurations: ways to run one training step of a :class:`~benchmarks.models.Workload`.

Every configuration is a function with the same signature,
``build(workload, backend) -> Step``, registered in :data:`CONFIGS`. ``backend``
is ``"eager"`` for the eager configurations and ``"inductor"`` or
``"aot_eager"`` for the compiled ones. A :class:`Step` runs the forward (hooks
and config patches entered inside it) and returns the loss; the driver
(``benchmarks/run.py``) calls ``backward`` and measures.

The codec is ``sh.fp8()``: float8 e4m3 with one float32 scale per block of 128
elements along the innermost dim (:data:`CODEC`, its configuration
:data:`FLOAT8`), in the ``sh*`` configurations. torch's own path
(``torch hooks``) builds the codec from plain aten ops traced with ``make_fx``,
as a user does today; a traced graph cannot branch on dtype, rank or shape (a
``(-1, 128)`` block view bakes in a length the innermost dim may not divide), so
it keeps row scales (``amax`` over ``dim=-1``, :data:`TORCH_PATH_FLOAT8`), the
finest grouping it can express for every saved tensor, and casts whatever it is
given. ``sh policy``, ``sh + checkpoint`` and ``bf16 sh policy`` run
``sh.policy()`` (:data:`POLICY`), the library's recommended codec: the same fp8
codec for floating tensors, bitmasks for bool ones, and what its rules keep
(normalization statistics, a narrow loss head, small tensors) as it is. The
``bf16*`` configurations run under bf16 autocast and are compared with the
``bf16`` row; they and ``sh policy uncentered`` (the policy with
``centered=None``, which differs from ``sh policy`` only under inductor, on
batch norm inputs: name ``--backends inductor`` too) run only when named with
``--configs``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.debugging import aot_eager, boxed_nop

import savedhooks as sh
from benchmarks.models import Workload
from benchmarks.torch_options import TORCH_FP8, TORCH_FP8_DEFAULTS, torch_fp8_pass, torch_offload_pass
from savedhooks.compiler.api import placed_aot_eager

__all__ = ["CODEC", "CONFIGS", "DEFAULT_CONFIGS", "FIDELITY_STEP", "FLOAT8", "POLICY", "POLICY_UNCENTERED", "TORCH_PATH_FLOAT8", "Config", "GraphLog", "Step", "lowest_budget", "plan_at", "plan_or_lowest", "planner_for", "torch_fp8", "torch_fp8_hooks"]

FLOAT8 = sh.codecs.Float8()  # the codec's configuration: the library default, e4m3 with block scales (128)
CODEC = FLOAT8.hooks()  # its HookPair, as sh.fp8() returns it
POLICY = sh.policy()  # the library's default policy (fp8 as above, bitmasks, statistics kept)
POLICY_UNCENTERED = sh.policy(centered=None)  # the same, batch norm inputs not centered under inductor
TORCH_PATH_FLOAT8 = sh.codecs.Float8(granularity="row")  # what torch's own path (make_fx'd hooks) computes
FIDELITY_STEP = 0.02  # plan_or_lowest raises a budget no plan meets min_sqnr_db within by this share per try
MEMORY_BUDGET = 0.5  # torch._functorch.config.activation_memory_budget for the "memory budget" configuration


class GraphLog:
    """The forward and backward graphs an aot_eager compile ran, as they ran (after any placement)."""

    def __init__(self) -> None:
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []

    def wrap(self, backend: Any) -> Any:
        """Record the graphs of an aot_eager-style backend (``functools.partial(aot_eager, ...)``) or of "aot_eager".

        Args:
            backend: ``"aot_eager"``, or a partial of torch's aot_eager with
                ``fw_compiler`` / ``bw_compiler`` (what ``sh.backend("aot_eager")`` is).

        Returns:
            A backend that compiles as ``backend`` does and keeps the graphs, or
            ``None`` when ``backend`` has another form (then nothing is recorded).
        """
        if backend == "aot_eager":
            func, compilers = aot_eager, {"fw_compiler": boxed_nop, "bw_compiler": boxed_nop}
        elif isinstance(backend, functools.partial) and backend.func in (aot_eager, placed_aot_eager):
            func = backend.func  # placed_aot_eager: sh.backend("aot_eager"), whose codecs know the unpacks move
            compilers = {k: backend.keywords.get(k, boxed_nop) for k in ("fw_compiler", "bw_compiler")}
        else:
            return None
        keywords = dict(backend.keywords) if isinstance(backend, functools.partial) else {}
        keywords["fw_compiler"] = self._keep(compilers["fw_compiler"], self.forward)
        keywords["bw_compiler"] = self._keep(compilers["bw_compiler"], self.backward)
        return functools.partial(func, **keywords)

    @staticmethod
    def _keep(compiler: Callable, graphs: list[torch.fx.GraphModule]) -> Callable:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            compiled = compiler(gm, example_inputs)  # placement passes change gm in place
            graphs.append(gm)
            return compiled

        return compile_graph


@dataclasses.dataclass
class Step:
    """A built configuration.

    Attributes:
        forward: runs the forward under the configuration's hooks and patches and
            returns the loss (the driver calls ``backward`` on it).
        graphs: the recorded aot_eager graphs, for the memory model's prediction
            (``None`` where the configuration runs no aot_eager graphs).
        close: undoes what building changed on the model (checkpointing).
        predicted_bytes: the configuration's own prediction of the activation
            peak (a plan's), shown instead of the recorded graphs' one.
    """

    forward: Callable[[], torch.Tensor]
    graphs: GraphLog | None = None
    close: Callable[[], None] = lambda: None
    predicted_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Config:
    """A registered configuration.

    Every ``build`` has the same signature: ``build(workload, backend) -> Step``,
    with ``backend`` ``"eager"`` for the eager configurations and ``"inductor"``
    or ``"aot_eager"`` for the compiled ones; it raises whatever building the
    configuration raises (running it happens later, in the driver).

    Attributes:
        name: short name (table, CSV, ``--configs``).
        build: ``build(workload, backend) -> Step``.
        compiled: runs under ``torch.compile`` (once per backend), else eagerly.
        cuda_only: only measured with ``--device cuda``.
        description: one line saying what the configuration runs (printed with the results).
        baseline: the configuration whose row (same model and backend) the
            ratio columns compare with; None: "compiled" (eager rows: "no hooks").
        in_default: run when ``--configs`` is not given (the bf16 rows are asked for).
    """

    name: str
    build: Callable[[Workload, str], Step]
    compiled: bool
    cuda_only: bool
    description: str
    baseline: str | None = None
    in_default: bool = True

    @property
    def step_baseline(self) -> str:
        """The configuration whose step time this one's is divided by: :attr:`baseline`, else "compiled"."""
        return self.baseline or "compiled"


def _compile(workload: Workload, backend: str, placed: bool = False) -> tuple[Callable[[], torch.Tensor], GraphLog | None]:
    """``torch.compile`` the workload's model (with its loss where ``compiled_loss``); aot_eager keeps its graphs.

    Returns ``(loss, log)``: ``loss()`` runs the compiled step's forward to the loss.
    """
    chosen = sh.backend(backend) if placed else backend
    log = GraphLog()
    recording = log.wrap(chosen) if backend == "aot_eager" else None
    loss = workload.compiled_step(functools.partial(torch.compile, backend=recording or chosen))
    return loss, (log if recording else None)


def _step(loss: Callable[[], torch.Tensor], *contexts: Callable[[], Any]) -> Callable[[], torch.Tensor]:
    def forward() -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context())
            return loss()

    return forward


def _compiled(workload: Workload, backend: str, *contexts: Callable[[], Any], placed: bool = False) -> Step:
    loss, log = _compile(workload, backend, placed)
    return Step(_step(loss, *contexts), log)


def _no_hooks(workload: Workload, backend: str) -> Step:
    """No hooks: the eager reference, or plain ``torch.compile``."""
    if backend == "eager":
        return Step(_step(lambda: workload.loss(workload.model)))
    return _compiled(workload, backend)


def _savedhooks_eager(workload: Workload, backend: str) -> Step:
    """savedhooks' codec on the eager model (its hooks run as Python, packing as the forward goes)."""
    return Step(_step(lambda: workload.loss(workload.model), lambda: sh.saved_tensors_hooks(CODEC)))


def _torch_fp8_pack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # TORCH_PATH_FLOAT8 in plain aten ops: e4m3, one float32 scale per row of the innermost dim
    dtype = TORCH_PATH_FLOAT8.dtype
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.clamp(amax / torch.finfo(dtype).max, min=torch.finfo(torch.float32).tiny)
    return (x.float() / scale).to(dtype), scale


def _torch_fp8_unpack(packed: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    q, scale = packed
    return q.float() * scale


@functools.cache
def torch_fp8_hooks() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """The codec as torch's own path takes it: two ``make_fx``-traced GraphModules (built once: dynamo guards on id).

    Args:
        None.

    Returns:
        ``(pack, unpack)`` for ``torch.autograd.graph.saved_tensors_hooks``.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    example = torch.randn(4, 8)
    return make_fx(_torch_fp8_pack)(example), make_fx(_torch_fp8_unpack)(_torch_fp8_pack(example))


def _torch_hooks(workload: Workload, backend: str) -> Step:
    """torch's own path: fp8 as make_fx'd GraphModules in ``torch.autograd.graph.saved_tensors_hooks``.

    torch inlines them (pack at the end of the forward graph, unpack at the start
    of the backward graph). The codec has row scales (:data:`TORCH_PATH_FLOAT8`),
    not :data:`CODEC`'s blocks of 128: one traced graph serves every saved
    tensor, and a block view would bake in one innermost length."""
    pack, unpack = torch_fp8_hooks()
    return _compiled(workload, backend, lambda: torch.autograd.graph.saved_tensors_hooks(pack, unpack))


def _python_pack(x: torch.Tensor) -> tuple[bool, Any]:
    # what a plain Python hook does: encode what the codec takes, leave parameters alone
    if isinstance(x, torch.nn.Parameter) or not FLOAT8.accepts(x):
        return False, x
    return True, FLOAT8.encode(x)


def _python_unpack(packed: tuple[bool, Any]) -> torch.Tensor:
    encoded, payload = packed
    return FLOAT8.decode(payload) if encoded else payload


def _python_hooks(workload: Workload, backend: str) -> Step:
    """Plain Python hook functions (the codec's encode / decode, parameters left alone) around a compiled model.

    torch does not inline them: they run on the compiled region's saved tensors
    after its forward, and all unpacks at the start of its backward. (Not
    ``CODEC.pack`` itself: savedhooks' eager filter takes tensors made inside a
    compiled region for inputs and stores them as they are.) The recorded graphs
    do not contain these hooks, so no prediction is made."""
    step = _compiled(workload, backend, lambda: torch.autograd.graph.saved_tensors_hooks(_python_pack, _python_unpack))
    step.graphs = None
    return step


def _savedhooks_compiled(workload: Workload, backend: str) -> Step:
    """savedhooks' codec inlined by torch, with torch's backend as it is (no reorder pass).

    Plain ``torch.compile(model)`` (the backend named only where it is not
    inductor) inside ``sh.saved_tensors_hooks(CODEC)``."""
    return _compiled(workload, backend, lambda: sh.saved_tensors_hooks(CODEC))


def _savedhooks_policy(workload: Workload, backend: str) -> Step:
    """``sh.policy()`` (the default policy) inlined by torch, with torch's backend as it is."""
    return _compiled(workload, backend, lambda: sh.saved_tensors_hooks(POLICY))


def _savedhooks_policy_uncentered(workload: Workload, backend: str) -> Step:
    """``sh.policy(centered=None)`` inlined by torch, with torch's backend as it is."""
    return _compiled(workload, backend, lambda: sh.saved_tensors_hooks(POLICY_UNCENTERED))


def _savedhooks_reorder(workload: Workload, backend: str) -> Step:
    """savedhooks' codec inlined, with the reorder pass: ``torch.compile(model, backend=sh.backend(backend))``."""
    return _compiled(workload, backend, lambda: sh.saved_tensors_hooks(CODEC), placed=True)


def _compiled_changed(
    undo: Callable[[], None], workload: Workload, backend: str, *contexts: Callable[[], Any], placed: bool = False
) -> Step:
    """Compile a model that building changed; ``undo`` reverts the change if compiling fails, and when the step closes."""
    try:
        step = _compiled(workload, backend, *contexts, placed=placed)
    except BaseException:
        undo()
        raise
    step.close = undo
    return step


def _checkpointed(workload: Workload, backend: str, *contexts: Callable[[], Any], placed: bool = False) -> Step:
    """The workload compiled with checkpointing per block on (``close`` turns it off again)."""
    workload.set_checkpointing(True)
    return _compiled_changed(lambda: workload.set_checkpointing(False), workload, backend, *contexts, placed=placed)


def _checkpointing(workload: Workload, backend: str) -> Step:
    """Activation checkpointing per block (``torch.utils.checkpoint``, non-reentrant), compiled."""
    return _checkpointed(workload, backend)


def _savedhooks_checkpointing(workload: Workload, backend: str) -> Step:
    """Checkpointing per block, and ``sh.policy()`` on what is still saved (block inputs, head, loss), compiled.

    With the placement that plain ``torch.compile`` gets under inductor: under
    aot_eager through ``sh.backend("aot_eager")`` (as ``sh plan``).
    """
    return _checkpointed(workload, backend, lambda: sh.saved_tensors_hooks(POLICY), placed=backend == "aot_eager")


def _bf16(workload: Workload) -> Callable[[], Any]:
    device = next(workload.model.parameters()).device.type
    return lambda: torch.autocast(device, dtype=torch.bfloat16)


def _bf16_compiled(workload: Workload, backend: str) -> Step:
    """bf16 autocast around the compiled model, no hooks: the baseline of the bf16 rows."""
    return _compiled(workload, backend, _bf16(workload))


def _bf16_policy(workload: Workload, backend: str) -> Step:
    """bf16 autocast, ``sh.policy()`` on what is saved (bf16 activations packed to fp8)."""
    return _compiled(workload, backend, _bf16(workload), lambda: sh.saved_tensors_hooks(POLICY))


def _bf16_checkpointing(workload: Workload, backend: str) -> Step:
    """bf16 autocast, checkpointing per block."""
    return _checkpointed(workload, backend, _bf16(workload))


def memory_budget(fraction: float) -> Config:
    """A configuration: the min-cut partitioner's recompute under ``activation_memory_budget=fraction``.

    Args:
        fraction: torch's budget, in (0, 1].

    Returns:
        A :class:`Config` named ``"budget <fraction>"``.

    Raises:
        ValueError: ``fraction`` is outside (0, 1].
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"memory_budget: fraction must be in (0, 1], got {fraction}")
    patch = functools.partial(torch._functorch.config.patch, activation_memory_budget=fraction)
    return Config(f"budget {fraction:g}", lambda workload, backend: _compiled(workload, backend, patch), True, False,
                  f"partitioner recompute, activation_memory_budget={fraction:g}")


def torch_fp8(name: str, options: dict[str, Any], description: str, in_default: bool = True) -> Config:
    """A configuration: torch's fp8 activation pass with ``options``, compiled, no hooks.

    Args:
        name: the configuration's name.
        options: the pass's options (:func:`torch_fp8_pass`).
        description: the line printed with the results.
        in_default: run when ``--configs`` is not given.

    Returns:
        A compiled :class:`Config` whose forward and compile run under the pass.
    """
    patch = functools.partial(torch_fp8_pass, options)
    return Config(name, lambda workload, backend: _compiled(workload, backend, patch), True, False, description,
                  in_default=in_default)


def _torch_offload(workload: Workload, backend: str) -> Step:
    """torch's partitioner offload of every saved value of 1 KiB or more, with its stream and prefetch. CUDA only."""
    return _compiled(workload, backend, torch_offload_pass)


def planner_for(workload: Workload, backend: str, min_sqnr_db: float | None = None) -> sh.planner.Planner:
    """A planner for the module the workload compiles (its model, or model and loss with ``compiled_loss``).

    Args:
        workload: the workload.
        backend: ``"inductor"`` or ``"aot_eager"``.
        min_sqnr_db: the planner's fidelity limit (see :func:`savedhooks.plan`), or None.

    Returns:
        A :class:`sh.planner.Planner` (nothing surveyed yet).

    Raises:
        ValueError: another backend, or a limit that is not finite.
    """
    if workload.compiled_loss:
        return sh.planner.Planner(workload.with_loss(), workload.inputs, backend=backend, min_sqnr_db=min_sqnr_db)
    model, inputs, loss_fn = workload.model, workload.inputs, workload.loss_of
    return sh.planner.Planner(model, inputs, loss_fn=loss_fn, backend=backend, min_sqnr_db=min_sqnr_db)


def lowest_budget(planner: sh.planner.Planner) -> int:
    """The lowest budget the planner may meet: what its error names for a budget of one byte.

    With the check (a single process), that is the lowest peak of the plans
    with every candidate packed checked on their hooked graphs where it is
    below the modelled floor, else the modelled floor.

    Args:
        planner: the planner.

    Returns:
        Bytes.

    Raises:
        Whatever planning raises but :class:`savedhooks.InfeasibleBudgetError`.
    """
    try:
        return planner.plan(1).predicted_peak_bytes  # a step that fits in one byte: nothing to plan
    except sh.InfeasibleBudgetError as error:
        return error.floor_bytes


def plan_or_lowest(planner: sh.planner.Planner, budget_bytes: int) -> sh.Plan:
    """``planner.plan(budget_bytes)``, or the plan at a budget above it that the planner meets.

    Where every plan checked with its hooks peaks above the budget, the plan
    at the lowest checked peak; where no plan within it is predicted to meet
    the planner's ``min_sqnr_db``, the budget raised by
    :data:`FIDELITY_STEP` (at least a byte) per try until one is, at most to
    the modelled no-hook peak (each try a search, no compile). Each such
    change is said on stderr, out of the tables that go to stdout.

    Args:
        planner: the planner.
        budget_bytes: the budget (at least :func:`lowest_budget`).

    Returns:
        A plan (its ``budget_bytes`` says which budget it met).

    Raises:
        InfeasibleBudgetError: the budget is below the modelled floor.
        InfeasibleFidelityError: no budget up to the no-hook peak meets ``min_sqnr_db``.
    """
    budget, tried = budget_bytes, set()
    while True:
        tried.add(budget)
        try:
            return planner.plan(budget)
        except sh.InfeasibleBudgetError as error:
            if not error.checked or error.floor_bytes in tried:
                raise
            budget = error.floor_bytes
            print(f"{error}: planned at the lowest checked peak instead", file=sys.stderr)
        except sh.InfeasibleFidelityError as error:
            if budget >= planner.baseline_bytes:
                raise
            budget = min(max(int(budget * (1 + FIDELITY_STEP)), budget + 1), planner.baseline_bytes)
            print(f"{error}: planned at {budget / 2**20:.2f} MiB instead", file=sys.stderr)


def plan_at(planner: sh.planner.Planner, label: str) -> sh.Plan:
    """The plan for a budget label: ``floor`` (the lowest peak it reaches) or a fraction of its modelled no-hook peak.

    Args:
        planner: the planner.
        label: ``"floor"`` or a fraction, as text (``"0.6"``).

    Returns:
        :func:`plan_or_lowest` at :func:`lowest_budget` for ``floor``, else
        ``planner.plan`` at that fraction of ``planner.baseline_bytes``.

    Raises:
        ValueError: a label that is neither ``floor`` nor a number.
        InfeasibleBudgetError: a fraction below what the planner can reach.
    """
    if label == "floor":
        return plan_or_lowest(planner, lowest_budget(planner))
    return planner.plan(int(float(label) * planner.baseline_bytes))


def _run_plan(workload: Workload, backend: str, plan: sh.Plan) -> Step:
    """The plan's recompute applied, compiled inside ``sh.saved_tensors_hooks(plan.hooks)``; ``close`` reverts it.

    Under aot_eager the compile takes ``sh.backend("aot_eager")``: the plan's
    prediction assumes the placement that plain ``torch.compile`` gets under inductor.
    """
    module = workload.with_loss() if workload.compiled_loss else workload.model
    plan.apply(module)  # the blocks are shared with workload.model: the compiled module sees them
    hooks = plan.hooks
    return _compiled_changed(
        lambda: plan.revert(module), workload, backend, lambda: sh.saved_tensors_hooks(hooks), placed=backend == "aot_eager"
    )


def _savedhooks_plan(workload: Workload, backend: str) -> Step:
    """``sh.plan`` halfway between its modelled no-hook peak and its floor, compiled (see :func:`_run_plan`)."""
    planner = planner_for(workload, backend)
    with warnings.catch_warnings():  # settings it cannot plan (checkpointed random ops under aot_eager): in plan.log
        warnings.filterwarnings("ignore", message="sh.plan: ", category=UserWarning)
        plan = plan_or_lowest(planner, (planner.baseline_bytes + planner.floor_bytes) // 2)
    step = _run_plan(workload, backend, plan)
    step.predicted_bytes = plan.predicted_peak_bytes
    return step


def planned(label: str, plan: sh.Plan) -> Config:
    """A configuration: the plan's recompute applied, plain ``torch.compile`` inside ``sh.saved_tensors_hooks(plan.hooks)``.

    Args:
        label: what the plan was made for (the name is ``"plan <label>"``).
        plan: an :func:`sh.plan` result for the module the workload compiles
            (:meth:`Workload.with_loss` when its loss is compiled, else its model).

    Returns:
        A :class:`Config` (closing its step reverts the recompute).
    """

    def build(workload: Workload, backend: str) -> Step:
        return _run_plan(workload, backend, plan)

    how = " selectively" if plan.recompute_mode == "selective" else ""
    recompute = f", recompute {len(plan.recompute)} blocks{how}" if plan.recompute else ""
    return Config(f"plan {label}", build, True, False, f"sh.plan at {plan.budget_bytes / (1 << 20):.1f} MiB{recompute}")


def _save_on_cpu(workload: Workload, backend: str) -> Step:
    """torch's ``save_on_cpu(pin_memory=True)`` around the compiled model (Python hooks, not inlined). CUDA only."""
    step = _compiled(workload, backend, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
    step.graphs = None  # its hooks run outside the recorded graphs
    return step


def _savedhooks_offload(workload: Workload, backend: str) -> Step:
    """``sh.offload(CODEC)`` (fp8, then to pinned host memory) inlined, with the reorder pass. CUDA only."""
    offload = sh.offload(CODEC, device="cpu")
    return _compiled(workload, backend, lambda: sh.saved_tensors_hooks(offload), placed=True)


def _bf16_save_on_cpu(workload: Workload, backend: str) -> Step:
    """bf16 autocast, torch's ``save_on_cpu(pin_memory=True)`` (Python hooks, not inlined). CUDA only."""
    step = _compiled(workload, backend, _bf16(workload), lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
    step.graphs = None  # its hooks run outside the recorded graphs
    return step


def _bf16_offload(inner: Any) -> Callable[[Workload, str], Step]:
    """bf16 autocast, ``sh.offload(inner)`` inlined under plain ``torch.compile`` (the default placement). CUDA only."""
    hooks = sh.offload(inner, device="cpu")

    def build(workload: Workload, backend: str) -> Step:
        return _compiled(workload, backend, _bf16(workload), lambda: sh.saved_tensors_hooks(hooks))

    return build


CONFIGS: dict[str, Config] = {
    c.name: c
    for c in (
        Config("no hooks", _no_hooks, False, False, "eager model, no hooks: the reference for gradient SQNR"),
        Config("sh eager", _savedhooks_eager, False, False, "eager model, savedhooks' fp8 codec (Python hooks)"),
        Config("compiled", _no_hooks, True, False, "torch.compile, no hooks: the reference for step time"),
        # the two hook paths without savedhooks: --configs adds them (out of the default run, which must stay short)
        Config("torch hooks", _torch_hooks, True, False, "torch's own path: fp8 (row scales) as make_fx'd graphs",
               in_default=False),
        Config("python hooks", _python_hooks, True, False, "the codec as plain Python hooks (not inlined)",
               in_default=False),
        Config("sh", _savedhooks_compiled, True, False, "savedhooks' codec inlined, torch's backend as it is"),
        Config("sh policy", _savedhooks_policy, True, False, "sh.policy() inlined, torch's backend as it is"),
        Config("sh policy uncentered", _savedhooks_policy_uncentered, True, False,
               "sh.policy(centered=None): batch norm inputs packed as they are under inductor", in_default=False),
        Config("sh + reorder", _savedhooks_reorder, True, False, "savedhooks' codec inlined, sh.backend(...)"),
        Config("sh plan", _savedhooks_plan, True, False,
               "sh.plan halfway between its modelled no-hook peak and its floor (recompute and codecs)"),
        Config("checkpoint", _checkpointing, True, False, "torch.utils.checkpoint per block"),
        Config("sh + checkpoint", _savedhooks_checkpointing, True, False,
               "checkpoint per block, sh.policy() on what is still saved, placed (aot_eager: sh.backend)"),
        memory_budget(MEMORY_BUDGET),
        torch_fp8("torch fp8", TORCH_FP8,
                  "torch's fp8 activation pass: e4m3, row scales, every floating saved value but the inputs"),
        torch_fp8("torch fp8 defaults", TORCH_FP8_DEFAULTS,
                  "torch's fp8 activation pass as it defaults (e5m2; torch 2.13: scaled in the forward, "
                  "never unscaled in the backward, so gradients are wrong)", in_default=False),
        Config("bf16", _bf16_compiled, True, False, "bf16 autocast, compiled, no hooks: the bf16 rows' baseline",
               baseline="bf16", in_default=False),
        Config("bf16 sh policy", _bf16_policy, True, False, "bf16 autocast, sh.policy() inlined",
               baseline="bf16", in_default=False),
        Config("bf16 checkpoint", _bf16_checkpointing, True, False, "bf16 autocast, checkpoint per block",
               baseline="bf16", in_default=False),
        Config("save_on_cpu", _save_on_cpu, True, True, "torch.autograd.graph.save_on_cpu(pin_memory=True)"),
        Config("sh offload", _savedhooks_offload, True, True, "sh.offload(fp8) + reorder pass"),
        Config("torch offload", _torch_offload, True, True,
               "torch's partitioner offload: every saved value >= 1 KiB to host memory, transfer stream, prefetch"),
        Config("bf16 save_on_cpu", _bf16_save_on_cpu, True, True, "bf16 autocast, save_on_cpu(pin_memory=True)",
               baseline="bf16", in_default=False),
        Config("bf16 offload", _bf16_offload(None), True, True, "bf16 autocast, sh.offload() (asynchronous copies)",
               baseline="bf16", in_default=False),
        Config("bf16 sh offload", _bf16_offload(CODEC), True, True, "bf16 autocast, sh.offload(fp8) (asynchronous)",
               baseline="bf16", in_default=False),
    )
}

DEFAULT_CONFIGS: tuple[str, ...] = tuple(name for name, c in CONFIGS.items() if c.in_default)  # without --configs
