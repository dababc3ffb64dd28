"""For a throwaway CUDA machine with torch 2.11: give it the three torch 2.13 pieces that the offload path reads.

Where only torch 2.11 (CUDA) can be installed and the pinned torch 2.13 cannot,
this script edits that installed torch so that the offload path runs there. Run
it only on an installation that is thrown away afterwards, never on a torch you
keep. ``python -m benchmarks.torch211_shim --modify-installed-torch``:

1. ``torch/_functorch/_activation_offloading/offload_ops.py``: torch 2.13's file
   (``ao::offload``, ``ao::reload``, ``ao::wait_tensor``), from ``--offload-ops``,
   a copy of the file from a torch 2.13 installation.
2. ``torch._functorch.config.activation_offload_cpu_gpu_bw = 50.0``: torch 2.13's
   entry and default (GB/s).
3. ``torch._inductor.fx_passes.overlap_scheduling.estimate_roofline_runtime_ms``:
   torch 2.13's name, made of torch 2.11's own estimates (the larger of its
   analytical matmul time and its memory-bound time, each read at the size hints
   where sizes are symbolic, as torch 2.13 does). So placement on torch 2.11
   times nodes other than matmuls by bytes alone.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

_CONFIG_ENTRY = "activation_offload_cpu_gpu_bw: float = 50.0  # benchmarks.torch211_shim (torch 2.13's entry)\n\n"
_ROOFLINE = (
    "\n\ndef estimate_roofline_runtime_ms(node: fx.Node) -> float:  # benchmarks.torch211_shim\n"
    "    def hinted(ms):  # symbolic sizes at their hints, as torch 2.13's estimate reads them: no guard\n"
    "        if isinstance(ms, (torch.SymInt, torch.SymFloat)):\n"
    "            return float(ms.node.hint) if ms.node.has_hint() else 0.0\n"
    "        return float(ms)\n"
    "\n"
    "    return max(hinted(estimate_runtime_analytical(node)), hinted(estimate_mem_bound_runtime_ms(node)))\n"
)


def main(argv: list[str] | None = None) -> int:
    """Patch the installed torch 2.11 in place (each piece only where it is missing).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        0.

    Raises:
        SystemExit: without ``--modify-installed-torch``, on a torch other than
            2.11, or without the torch 2.13 ``offload_ops.py`` it needs.
    """
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch211_shim", description=__doc__.splitlines()[0])
    parser.add_argument("--modify-installed-torch", action="store_true", required=True,
                        help="confirm: this edits the torch installation it runs with")  # fmt: skip
    parser.add_argument("--offload-ops", type=pathlib.Path, required=True,
                        help="torch 2.13's torch/_functorch/_activation_offloading/offload_ops.py")  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    if not torch.__version__.startswith("2.11."):
        parser.error(f"for torch 2.11 only, this is torch {torch.__version__}")
    root = pathlib.Path(torch.__file__).parent
    ops = root / "_functorch/_activation_offloading/offload_ops.py"
    if not ops.exists():
        if not args.offload_ops.is_file():
            parser.error(f"--offload-ops: no file {args.offload_ops}")
        shutil.copy(args.offload_ops, ops)
        print(f"copied {args.offload_ops} to {ops}")
    config = root / "_functorch/config.py"
    text = config.read_text()
    if "activation_offload_cpu_gpu_bw" not in text:
        at = text.rindex("if TYPE_CHECKING:")
        config.write_text(text[:at] + _CONFIG_ENTRY + text[at:])
        print(f"added activation_offload_cpu_gpu_bw to {config}")
    overlap = root / "_inductor/fx_passes/overlap_scheduling.py"
    if "def estimate_roofline_runtime_ms" not in overlap.read_text():
        with overlap.open("a") as f:
            f.write(_ROOFLINE)
        print(f"added estimate_roofline_runtime_ms to {overlap}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
