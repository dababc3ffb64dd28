"""The only code in savedhooks that reaches into torch's private modules and attributes, or patches torch.

torch keeps much of what a saved-tensor hook library needs under ``_``-prefixed
names: a tensor's version counter and view base, the fake and functional tensor
types AOTAutograd traces with, pytree, dynamo's and inductor's configs and
compile entry points, AOTAutograd's hook-inlining context, the activation
offloading ops. Each module here wraps one torch subsystem, so a torch release
that moves one of them is met in one place:

* :mod:`~savedhooks._torch.version`: checks of the torch release.
* :mod:`~savedhooks._torch.tensors`: version counters, views, storages, fake and
  functional tensor types, layout helpers.
* :mod:`~savedhooks._torch.pytree`: torch's pytree functions.
* :mod:`~savedhooks._torch.ops`: operator overloads, their schemas, dispatch modes.
* :mod:`~savedhooks._torch.fx`: FX internals (symbolic tracing, side-effectful ops, shape config).
* :mod:`~savedhooks._torch.nn`: ``torch.nn.Module`` internals.
* :mod:`~savedhooks._torch.autograd`: what an autograd node saved, read without unpacking it.
* :mod:`~savedhooks._torch.profiler`: whether the autograd profiler runs.
* :mod:`~savedhooks._torch.dynamo`: dynamo's config, backends and tracing context.
* :mod:`~savedhooks._torch.aot`: functorch / AOTAutograd: its config, hook context, rng prims.
* :mod:`~savedhooks._torch.inductor`: inductor's config, graph pass type, virtualized graph, compile entry.
* :mod:`~savedhooks._torch.offload`: AOTAutograd's activation-offloading ops.
* :mod:`~savedhooks._torch.fixes`: work-arounds for torch bugs on savedhooks' paths.

Nothing here imports from the rest of savedhooks. Importing a module of this
package patches nothing; :func:`savedhooks._torch.fixes.install` does.
"""
