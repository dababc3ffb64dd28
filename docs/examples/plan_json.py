"""Plan a memory budget once, keep the plan as JSON, and train from the file.

A Llama built from its config (random init, byte vocabulary; nothing
downloaded) is planned for a budget of 0.6 of the modelled activation peak
without hooks on one batch: ``sh.planner.Planner`` surveys the compiled step
once and reads that peak (``Planner.plan`` is what ``sh.plan(model, batch,
budget_bytes=...)`` calls, for a budget known in bytes). The plan is written with
``Plan.to_json``, read back with ``sh.Plan.from_json``, applied (the blocks it
recomputes) and trained a few steps under ``sh.saved_tensors_hooks(plan.hooks)``.
``python docs/examples/plan_json.py --steps 20`` (``--backend inductor``: plan
and train for plain ``torch.compile``; the default, ``aot_eager``, compiles faster).
"""

import argparse
import os
import tempfile

import torch
from quickstart import batches
from trainer_policy import tiny_llama

import savedhooks as sh


def model_loss(out) -> torch.Tensor:
    """The loss the step trains: the model's own, from ``labels``."""
    return out.loss


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--fraction", type=float, default=0.6, help="budget over the modelled peak without hooks")
    parser.add_argument("--backend", choices=["aot_eager", "inductor"], default="aot_eager")
    parser.add_argument("--out", help="where to write the plan (default: a temporary file)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = tiny_llama().to(device)
    model.config.use_cache = False  # a plan trains without a KV cache (Plan.apply would turn it off, warning)
    data = [{k: v.to(device) for k, v in b.items()} for b in batches(args.steps, batch=4, seq=128)]

    planner = sh.planner.Planner(model, data[0], loss_fn=model_loss, backend=args.backend)
    budget = int(args.fraction * planner.baseline_bytes)
    plan = planner.plan(budget)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.out or os.path.join(tmp, "plan.json")
        with open(path, "w") as f:
            f.write(plan.to_json())
        with open(path) as f:
            loaded = sh.Plan.from_json(f.read())
    assert loaded == plan, "the plan read back differs from the one written"

    loaded.apply(model)  # checkpoints the blocks the plan recomputes, before compiling
    backend = "inductor" if args.backend == "inductor" else sh.backend("aot_eager")
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in data:
        with sh.saved_tensors_hooks(loaded.hooks):
            loss = model_loss(compiled(**batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    mib = 2**20
    choices = sorted({t.choice for t in loaded.tensors})
    print(f"plan read back from JSON: predicted peak {loaded.predicted_peak_bytes / mib:.2f} MiB, budget "
          f"{loaded.budget_bytes / mib:.2f} MiB, no hooks {loaded.baseline_peak_bytes / mib:.2f} MiB; "
          f"recompute {list(loaded.recompute)}, choices {choices}")  # fmt: skip
    print(f"trained {args.steps} steps with the plan: last loss {loss.item():.4f}")
    return loss.item()


if __name__ == "__main__":
    main()
