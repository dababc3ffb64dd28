"""sh.plan's codec costs: measured once, kept for the process and on disk (the calibration)."""

import json

import pytest
import torch

from savedhooks.planner import costs
from savedhooks.planner.result import CODECS


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("SAVEDHOOKS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(costs, "_CACHE", {})
    return tmp_path / "costs.json"


def _refuse_to_measure(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("measured although the cost was kept")

    monkeypatch.setattr(torch, "compile", refuse)


def test_a_cost_is_measured_once_and_read_back_in_a_new_process(fresh, monkeypatch):
    bf16 = CODECS["bf16"]
    first = costs.seconds_per_byte(bf16, torch.float32, torch.device("cpu"), "aot_eager")
    assert first > 0 and costs.cache_file() == fresh
    kept = json.loads(fresh.read_text())
    assert list(kept.values()) == [first] and f"{bf16!r}|torch.float32|aot_eager" in next(iter(kept))
    monkeypatch.setattr(costs, "_CACHE", {})  # as a new process starts
    _refuse_to_measure(monkeypatch)
    assert costs.seconds_per_byte(bf16, torch.float32, "cpu", "aot_eager") == first
    with pytest.raises(AssertionError, match="measured"):  # another dtype is not in the file
        costs.seconds_per_byte(bf16, torch.float64, "cpu", "aot_eager")


def test_an_unreadable_file_is_measured_over_and_an_empty_variable_keeps_no_file(fresh, monkeypatch):
    fresh.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        value = costs.seconds_per_byte(CODECS["fp8"], torch.float32, "cpu", "aot_eager")
    assert list(json.loads(fresh.read_text()).values()) == [value]
    monkeypatch.setenv("SAVEDHOOKS_CACHE_DIR", "")
    monkeypatch.setattr(costs, "_CACHE", {})
    assert costs.cache_file() is None
    costs.seconds_per_byte(CODECS["bf16"], torch.float32, "cpu", "aot_eager")
    assert len(json.loads(fresh.read_text())) == 1
    with pytest.raises(ValueError, match="repeats"):
        costs.seconds_per_byte(CODECS["bf16"], torch.float32, "cpu", "aot_eager", repeats=0)


@pytest.mark.slow
def test_each_codec_and_dtype_is_compiled_past_dynamos_recompile_limit(fresh):
    # the round trip is one lambda (one code object) for every codec, dtype and backend
    compiled = []

    def counting(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    added = []
    with torch._dynamo.config.patch(recompile_limit=1):  # (monkeypatch.setattr would delete the option on undo)
        for codec, dtype in ((CODECS["bf16"], torch.float32), (CODECS["fp8"], torch.float32),
                             (CODECS["fp8"], torch.float16)):
            before = len(compiled)
            costs.seconds_per_byte(codec, dtype, "cpu", counting)
            added.append(len(compiled) - before)
    assert all(added), added  # each one compiled, none ran eagerly


def _two_blocks(width=16):
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 8))
                                 for _ in range(2)))


def test_a_blocks_recompute_time_is_measured_once_per_model_inputs_blocks_and_mode(fresh, monkeypatch):
    measured = []

    def noisy(model, inputs, paths, mode):  # a clock that never reads the same twice
        measured.append(mode)
        return tuple(float(len(measured) + i) for i, _ in enumerate(paths))

    monkeypatch.setattr(costs, "block_seconds", noisy)
    model, x = _two_blocks(), torch.randn(4, 8)
    first = costs.recompute_seconds(model, (x,), ["0", "1"], "full")
    assert first == (1.0, 2.0) and list(json.loads(fresh.read_text()).values()) == [[1.0, 2.0]]
    monkeypatch.setattr(costs, "_CACHE", {})  # as a new process starts
    assert costs.recompute_seconds(_two_blocks(), (torch.randn(4, 8),), ["0", "1"], "full") == first
    assert measured == ["full"]
    # each of these is another calibration: the mode, the blocks, the input shape, the model's shapes
    others = [((x,), ["0", "1"], "selective"), ((x,), ["0"], "full"), ((x[:2],), ["0", "1"], "full")]
    for inputs, paths, mode in others:
        assert costs.recompute_seconds(model, inputs, paths, mode) != first
    assert costs.recompute_seconds(_two_blocks(width=32), (x,), ["0", "1"], "full") != first
    assert len(measured) == 5 and len(json.loads(fresh.read_text())) == 5
    with pytest.raises(ValueError, match="mode"):
        costs.recompute_seconds(model, (x,), ["0"], "sometimes")


def test_the_file_s_other_entries_survive_a_bad_one_and_the_process_keeps_what_it_measured(fresh, monkeypatch):
    bf16 = CODECS["bf16"]
    first = costs.seconds_per_byte(bf16, torch.float32, "cpu", "aot_eager")
    kept = json.loads(fresh.read_text())
    (key,) = kept
    # another writer's entries: one this version cannot read, and another figure for the key this process holds
    fresh.write_text(json.dumps({key: first * 2, "other|kind": "fast", "other|seconds": 1.5}))
    model, x = _two_blocks(), torch.randn(4, 8)
    monkeypatch.setattr(costs, "block_seconds", lambda model, inputs, paths, mode: (0.25,) * len(paths))
    costs.recompute_seconds(model, (x,), ["0"], "full")  # reads the file: a key this process lacks
    assert costs._CACHE["other|seconds"] == 1.5 and "other|kind" not in costs._CACHE
    assert costs.seconds_per_byte(bf16, torch.float32, "cpu", "aot_eager") == first  # the process's own figure
    assert json.loads(fresh.read_text())["other|kind"] == "fast"  # writing keeps what it cannot read
    # a kept figure of the wrong kind for its key (a number where a block list belongs) is measured over
    recompute_key = next(k for k in json.loads(fresh.read_text()) if "|recompute|" in k)
    fresh.write_text(json.dumps({recompute_key: 3.0}))
    monkeypatch.setattr(costs, "_CACHE", {})
    assert costs.recompute_seconds(model, (x,), ["0"], "full") == (0.25,)
