"""A hook of one's own with ``@sh.hook``: int8 with one scale per row, written by hand, eager and compiled.

Pack stores a floating saved tensor as int8 with one float32 scale per row
(its last dim), unpack multiplies back; other saved tensors (integer indices,
masks) pass as they are. The same hook runs a small MLP eagerly and under
``torch.compile`` (where its ops are inlined into the compiled graphs), and the
script prints the worst parameter-gradient SQNR (``sh.fidelity.worst_sqnr``) of each
against the step without hooks.
``python docs/examples/custom_hook.py --steps 3``.
"""

import argparse

import torch

import savedhooks as sh


@sh.hook
def int8_rows(x):
    if not x.is_floating_point() or x.dim() == 0:
        return x
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 127
    return x.dtype, torch.round(x / scale).to(torch.int8), scale


@int8_rows.unpack
def int8_rows(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    dtype, q, scale = packed
    return (q.float() * scale).to(dtype)


def grads(model: torch.nn.Module, x: torch.Tensor, hooks: sh.HookPair | None = None, run=None) -> dict[str, torch.Tensor]:
    """The parameter gradients of one step of ``mean(run(x)^2)`` by name, under ``hooks`` (None: no hooks).

    ``run`` is the model or its compiled wrapper (default: the model).
    """
    run = model if run is None else run
    model.zero_grad(set_to_none=True)
    if hooks is None:
        loss = run(x).square().mean()
    else:
        with sh.saved_tensors_hooks(hooks):
            loss = run(x).square().mean()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="training steps, compiled, under the hook")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)
    )
    x = torch.randn(256, 64)
    compiled = torch.compile(model, backend=args.backend)

    reference = grads(model, x)
    eager, _ = sh.fidelity.worst_sqnr(reference, grads(model, x, int8_rows))  # the lowest over the parameters
    compiled_db, _ = sh.fidelity.worst_sqnr(reference, grads(model, x, int8_rows, run=compiled))

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = x[:, :1].sin()  # something to fit
    for _ in range(args.steps):
        with sh.saved_tensors_hooks(int8_rows):
            loss = (compiled(x) - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"worst gradient SQNR against no hooks: eager {eager:.1f} dB, compiled {compiled_db:.1f} dB; "
          f"trained {args.steps} steps with int8_rows: last loss {loss.item():.4f}")  # fmt: skip
    return loss.item()


if __name__ == "__main__":
    main()
