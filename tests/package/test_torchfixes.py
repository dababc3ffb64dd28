"""savedhooks._torch.fixes: the dtype-propagation set-up that torch re-runs on every construction (through 2.14)."""

import functools
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._inductor.lowering  # fills inductor's op rules, as any compile does first
from torch._inductor import dtype_propagation
from torch._inductor import utils as inductor_utils

from savedhooks._torch.fixes import install, set_up_dtype_propagation_once
from savedhooks._torch.version import has_bug

Handler = dtype_propagation.DtypePropagationOpsHandler
pytestmark = pytest.mark.skipif(not has_bug("dtype_propagation_setup"), reason="this torch sets the handler up once")


@pytest.fixture(autouse=True, scope="module")
def _installed():
    install()


@pytest.mark.slow
def test_import_leaves_torch_unpatched_and_entering_hooks_installs_the_fix():
    script = textwrap.dedent(
        """
        import torch
        from torch._inductor import dtype_propagation
        handler = dtype_propagation.DtypePropagationOpsHandler
        torchs_own = handler.__init__
        import savedhooks as sh
        print(handler.__init__ is torchs_own)
        with sh.saved_tensors_hooks(sh.fp8()):
            pass
        print(handler.__init__ is torchs_own, getattr(handler.__init__, "_savedhooks_once", False))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split() == ["True", "False", "True"], out.stdout + out.stderr


def _rules_of(handler: object) -> dict[str, tuple]:
    """What a set-up installed: each op's partial as (function, keywords)."""
    return {
        name: (value.func, value.keywords)
        for name, value in vars(handler).items()
        if isinstance(value, functools.partial)
    }


def test_the_handler_is_set_up_as_torchs_own_init_sets_it_up():
    handler = Handler()
    fresh = object.__new__(Handler)
    Handler.__init__.__wrapped__(fresh)  # torch's own set-up, on an instance of its own
    assert _rules_of(handler) == _rules_of(fresh)
    assert len(_rules_of(handler)) > 100
    assert set_up_dtype_propagation_once() is True  # idempotent: the wrapper is not wrapped again
    assert not hasattr(Handler.__init__.__wrapped__, "_savedhooks_once")


def test_the_set_up_runs_again_only_when_inductors_op_rules_change():
    handler = Handler()
    original = handler.add
    handler.add = "not set up again"
    try:
        assert Handler() is handler and handler.add == "not set up again"  # same rules: skipped
        inductor_utils.register_op_dtype_propagation_rules(
            "savedhooks_test_op", torch._prims_common.ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT, None
        )
        Handler()  # a new rule (as a lowering registered later): the set-up runs again
        assert isinstance(handler.add, functools.partial)
        assert isinstance(handler.savedhooks_test_op, functools.partial)
    finally:
        inductor_utils.op_dtype_propagation_rules.pop("savedhooks_test_op", None)
        vars(handler).pop("savedhooks_test_op", None)
        handler.add = original
        Handler()  # set up again for the rules as they were
    assert not hasattr(handler, "savedhooks_test_op")
