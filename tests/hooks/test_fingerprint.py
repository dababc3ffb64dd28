"""Fingerprints: equal code and configuration agree, any change disagrees."""

from __future__ import annotations

import dataclasses
import functools
import textwrap

import pytest
import torch

from savedhooks import UnfingerprintableError
from savedhooks.hooks.identity import fingerprint


def _compile_fn(src: str, name: str = "f", leading_lines: int = 0, **globals_):
    namespace = dict(globals_, torch=torch)
    exec(compile("\n" * leading_lines + textwrap.dedent(src), "<hook>", "exec"), namespace)
    return namespace[name]


SRC = """
def f(x):
    return x.to(torch.bfloat16) * SCALE
"""


def test_same_source_same_fingerprint_even_when_moved():
    a = _compile_fn(SRC, SCALE=2)
    b = _compile_fn(SRC, SCALE=2, leading_lines=40)  # other line numbers
    assert a is not b and fingerprint(a) == fingerprint(b)


def test_code_change_changes_fingerprint():
    a = _compile_fn(SRC, SCALE=2)
    b = _compile_fn(SRC.replace("bfloat16", "float16"), SCALE=2)
    assert fingerprint(a) != fingerprint(b)


def test_global_constant_change_changes_fingerprint():
    assert fingerprint(_compile_fn(SRC, SCALE=2)) != fingerprint(_compile_fn(SRC, SCALE=3))


def _closure(dtype, block=128):
    def f(x):
        return x.to(dtype).reshape(-1, block)

    return f


def test_closure_values_are_part_of_the_fingerprint():
    assert fingerprint(_closure(torch.bfloat16)) == fingerprint(_closure(torch.bfloat16))
    assert fingerprint(_closure(torch.bfloat16)) != fingerprint(_closure(torch.float16))
    assert fingerprint(_closure(torch.bfloat16, 64)) != fingerprint(_closure(torch.bfloat16, 128))


def test_helper_functions_are_followed():
    helper_a = _compile_fn("def helper(x):\n    return x * 2\n", name="helper")
    helper_b = _compile_fn("def helper(x):\n    return x * 3\n", name="helper")
    caller = "def f(x):\n    return helper(x)\n"
    assert fingerprint(_compile_fn(caller, helper=helper_a)) != fingerprint(_compile_fn(caller, helper=helper_b))


def test_recursive_functions_terminate():
    f = _compile_fn("def f(n):\n    return 1 if n == 0 else f(n - 1)\n")
    assert len(fingerprint(f)) == 64


@dataclasses.dataclass(frozen=True)
class Config:
    block: int
    dtype: torch.dtype


def test_partials_and_dataclasses():
    def g(x, config):
        return x

    p1 = functools.partial(g, config=Config(128, torch.float8_e4m3fn))
    p2 = functools.partial(g, config=Config(128, torch.float8_e4m3fn))
    p3 = functools.partial(g, config=Config(64, torch.float8_e4m3fn))
    assert fingerprint(p1) == fingerprint(p2) != fingerprint(p3)


def test_torch_functions_are_named_not_walked():
    assert fingerprint(torch.nn.functional.relu) == fingerprint(torch.nn.functional.relu)
    assert fingerprint(torch.nn.functional.relu) != fingerprint(torch.nn.functional.gelu)


@pytest.mark.parametrize("captured", [torch.ones(1), torch.nn.Linear(1, 1), object()])
def test_values_without_a_stable_digest_are_refused(captured):
    def f(x):
        return x * captured

    with pytest.raises(UnfingerprintableError, match="<closure captured>"):
        fingerprint(f)


# --- what a hook depends on beyond its own body ---------------------------------------------

CLASS_SRC = """
class Cast:
    def apply(self, x):
        return x.to(torch.DTYPE)

def f(x):
    return Cast().apply(x)
"""


def test_class_method_bodies_are_part_of_the_fingerprint():
    a = _compile_fn(CLASS_SRC.replace("DTYPE", "bfloat16"))
    b = _compile_fn(CLASS_SRC.replace("DTYPE", "float16"))
    assert fingerprint(a) != fingerprint(b)


def test_module_attributes_the_code_reads_are_part_of_the_fingerprint():
    import types

    def with_cfg(dtype):
        cfg = types.ModuleType("cfg")
        cfg.DTYPE = dtype
        return _compile_fn("def f(x):\n    return x.to(cfg.DTYPE)\n", cfg=cfg)

    assert fingerprint(with_cfg(torch.bfloat16)) == fingerprint(with_cfg(torch.bfloat16))
    assert fingerprint(with_cfg(torch.bfloat16)) != fingerprint(with_cfg(torch.float16))


def test_globals_defined_later_are_reported():
    from savedhooks.hooks.identity import fingerprint_details

    f = _compile_fn("def f(x):\n    return x.to(LOW)\n")
    early = fingerprint_details(f)
    assert early.late_globals == ("LOW",)
    f.__globals__["LOW"] = torch.float16
    late = fingerprint_details(f)
    assert late.late_globals == () and late.digest != early.digest


def test_bound_builtins_include_their_object():
    assert fingerprint(frozenset({1, 2}).__contains__) != fingerprint(frozenset({1, 3}).__contains__)
    with pytest.raises(UnfingerprintableError, match="mutable dict"):  # its contents can change later
        fingerprint({torch.float32: torch.bfloat16}.get)


def test_mutable_containers_are_refused():
    log: list[int] = []

    def f(x):
        log.append(1)
        return x

    with pytest.raises(UnfingerprintableError, match="<closure log> is a mutable list"):
        fingerprint(f)


def test_attribute_names_are_not_mistaken_for_globals():
    # The global named like the attribute (.bfloat16) has no stable value; it is not read.
    f = _compile_fn("def f(x):\n    return x.bfloat16()\n", bfloat16=object())
    assert len(fingerprint(f)) == 64


def test_decorated_helpers_are_followed_through_wrapped():
    def with_helper(body):
        helper = functools.lru_cache(_compile_fn(f"def helper(n):\n    return {body}\n", name="helper"))
        return _compile_fn("def f(x):\n    return x * helper(2)\n", helper=helper)

    assert fingerprint(with_helper("n * 2")) != fingerprint(with_helper("n * 3"))
    no_grad_helper = torch.no_grad()(_compile_fn("def helper(x):\n    return x * 2\n", name="helper"))
    assert len(fingerprint(_compile_fn("def f(x):\n    return helper(x)\n", helper=no_grad_helper))) == 64


@pytest.mark.slow
def test_set_constants_are_stable_across_hash_seeds(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "digest.py"
    script.write_text(
        "from savedhooks.hooks.identity import fingerprint\n"
        "def f(x):\n    return x.device.type in {'cpu', 'cuda', 'xpu', 'mps'}\n"
        "print(fingerprint(f))\n"
    )
    digests = {
        subprocess.run(
            [sys.executable, str(script)], env={**__import__("os").environ, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True,
        ).stdout.strip()
        for seed in ("1", "2", "3", "4")
    }  # fmt: skip
    assert len(digests) == 1
