"""Fingerprints: equal code and configuration agree, any change disagrees."""

from __future__ import annotations

import dataclasses
import functools
import textwrap

import pytest
import torch

from savedhooks import UnfingerprintableError, fingerprint


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
