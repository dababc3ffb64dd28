"""python -m benchmarks.gpu: its modes' commands, its results file, and what it does without a GPU."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest
import torch

from benchmarks import gpu


@pytest.mark.parametrize("mode", gpu.MODES)
def test_every_step_of_a_mode_is_a_command_of_this_repository_that_accepts_its_arguments(mode, capsys):
    """Each benchmark module parses the step's arguments and only then refuses for want of a GPU."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the steps would run")
    for step in gpu.steps(mode):
        assert step.argv[0] == sys.executable and step.argv[1] == "-m"
        module, args = step.argv[2], [a.replace("{tmp}", "unused") for a in step.argv[3:]]
        if module == "pip":
            continue
        if module == "pytest":
            assert "gpu" in args and "tests" in args
            continue
        main = importlib.import_module(module).main
        try:
            code = main(args)
        except SystemExit as exit_info:
            code = exit_info.code
        err = capsys.readouterr().err
        assert code == 2 and "CUDA" in err and "invalid choice" not in err and "unrecognized" not in err, (module, err)


def test_check_installs_the_test_requirements_the_machine_lacks_from_the_wheels_it_brings():
    assert gpu.steps("check", missing=())[0].name == "gpu tests"
    first = gpu.steps("check", missing=("expecttest", "hypothesis"))[0]
    assert first.name == "test requirements" and first.argv[-2:] == ("expecttest", "hypothesis")
    assert "--no-index" in first.argv and first.argv[first.argv.index("--find-links") + 1] == str(gpu.WHEELS)
    wheels = {w.name.split("-")[0].lower() for w in gpu.WHEELS.glob("*.whl")}
    assert set(gpu.TEST_REQUIREMENTS) <= wheels and {"pluggy", "iniconfig", "packaging", "pygments",
                                                     "sortedcontainers"} <= wheels  # fmt: skip
    assert gpu.missing_test_requirements() == ()  # this environment has them all


def test_frontier_plans_at_the_fractions_it_is_given_and_offload_compares_ours_with_torchs():
    (frontier,) = gpu.steps("frontier", size=4, fractions=(0.9, 0.5))
    argv = list(frontier.argv)
    assert argv[argv.index("--fractions") + 1: argv.index("--fractions") + 3] == ["0.9", "0.5"]
    assert argv[argv.index("--size") + 1] == "4" and argv[argv.index("--device") + 1] == "cuda"
    offload = gpu.steps("offload")[0].argv
    assert {"bf16 offload", "bf16 sh offload", "torch offload"} <= set(offload)


def test_bad_modes_sizes_and_fractions_are_refused():
    with pytest.raises(ValueError, match="unknown mode"):
        gpu.steps("everything")
    with pytest.raises(ValueError, match="size must be positive"):
        gpu.steps("frontier", size=0)
    with pytest.raises(ValueError, match="fractions in"):
        gpu.steps("frontier", fractions=(1.5,))
    with pytest.raises(SystemExit):
        gpu.main(["frontier", "--fractions", "0", "--dry-run"])


def test_the_results_file_is_named_after_the_device_and_the_torch_release(tmp_path):
    path = gpu.results_path(tmp_path, "NVIDIA H200", "2.11.0+cu128")
    assert path == tmp_path / "gpu-nvidia-h200-torch2.11.0-cu128.md"


def test_a_mode_s_section_replaces_its_own_and_keeps_the_others_in_mode_order():
    step = gpu.Step("kernel bandwidth", ("python", "-m", "benchmarks.kernels"))
    check = gpu.section("check", "python -m benchmarks.gpu check", "torch 2.11.0, H200", [(step, 0, 12.0, "| a |\n")])
    assert check.startswith("## check\n") and "`python -m benchmarks.kernels`: exit code 0, 12 s" in check
    assert "```text\n| a |\n```" in check
    offload = check.replace("## check", "## offload").replace("| a |", "| b |")
    text = gpu.merge("", "offload", offload, "savedhooks on torch 2.11.0, H200")
    text = gpu.merge(text, "check", check, "unused")
    assert text.startswith("# savedhooks on torch 2.11.0, H200\n") and text.index("## check") < text.index("## offload")
    again = gpu.merge(text, "check", check.replace("| a |", "| c |"), "unused")
    assert "| c |" in again and "| a |" not in again and "| b |" in again and again.count("## check") == 1


def test_without_a_gpu_it_refuses_unless_asked_for_the_commands(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["check", "--out-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
    assert gpu.main(["offload", "--dry-run", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step time: ") and "benchmarks.host_copies" in out
    assert list(pathlib.Path(tmp_path).iterdir()) == []
