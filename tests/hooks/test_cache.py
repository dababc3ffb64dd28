"""AOTAutograd's on-disk cache across processes: same hook code hits, changed code misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    import savedhooks as sh
    from torch._dynamo.utils import counters

    @sh.hook
    def cast(x):
        return x.to(torch.DTYPE) if x.is_floating_point() else x

    @cast.unpack
    def cast(packed):
        return packed.float() if packed.dtype == torch.DTYPE else packed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with sh.saved_tensors_hooks(cast):
        loss = torch.compile(model, backend="inductor")(torch.randn(4, 8)).square().sum()
    loss.backward()
    print(json.dumps({k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}))
    """
)


def _run(tmp_path, dtype: str) -> dict[str, int]:
    script = tmp_path / f"hook_{dtype}.py"
    script.write_text(SCRIPT.replace("DTYPE", dtype))
    env = dict(
        os.environ,
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor_cache"),
        TORCHINDUCTOR_FX_GRAPH_CACHE="1",
        TORCHINDUCTOR_AUTOGRAD_CACHE="1",
    )
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_same_hook_code_hits_and_changed_code_misses(tmp_path):
    first = _run(tmp_path, "bfloat16")
    assert first.get("autograd_cache_miss") == 1 and first.get("autograd_cache_saved") == 1, first
    again = _run(tmp_path, "bfloat16")  # a fresh process, same hook code
    assert again.get("autograd_cache_hit") == 1 and not again.get("autograd_cache_miss"), again
    changed = _run(tmp_path, "float16")  # the hook body changed
    assert changed.get("autograd_cache_miss") == 1 and not changed.get("autograd_cache_hit"), changed
    assert not any(r.get("autograd_cache_bypass") for r in (first, again, changed))
