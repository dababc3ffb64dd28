"""torch's partitioner offload (``benchmarks.torch_options.torch_offload_pass``), checked by graph on fake CUDA.

The joint forward-backward graph of a small MLP is traced on the CPU (autograd
cannot trace fake CUDA tensors on a CPU-only build); its values' metadata is then
moved to fake CUDA tensors of the same shapes, strides and dtypes, and torch's
min-cut partitioner splits it under the benchmark's patch, as it does inside
``torch.compile`` on a GPU. The offload ops it inserts are checked where they
must be; running them needs a GPU (the benchmark's ``torch offload`` row).
The prefetch step times the backward's ops on the device to decide how early a
reload must start; here every op is given no time, so each reload goes to the
start of the backward.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch._functorch.config
from functorch.compile import aot_function, default_decompositions, min_cut_rematerialization_partition
from torch._functorch._activation_offloading import activation_offloading
from torch.utils import _pytree as pytree

from benchmarks.configs import CONFIGS
from benchmarks.run import jobs
from benchmarks.torch_options import OFFLOAD_MIN_BYTES, mark_for_offload, torch_offload_pass
from savedhooks._torch.offload import HAS_AO_OPS
from savedhooks._torch.tensors import FakeTensorMode

pytestmark = pytest.mark.skipif(not HAS_AO_OPS, reason="torch's ao offload ops: torch 2.12+")

AO = torch.ops.ao


def _mlp(x, w1, w2, w3):
    h = torch.relu(x @ w1)  # 32 x 64 float32: 8 KiB
    g = torch.tanh(h @ w2)
    return (g @ w3).square().sum()  # 32 x 4 float32 (512 bytes) below the threshold


def _joint_on_fake_cuda():
    """The MLP's joint graph and inputs (see the module docstring), with the partitioner's keyword arguments."""
    seen = {}

    def partition(joint, inputs, **kwargs):
        seen.update(joint=joint, inputs=inputs, kwargs=kwargs)
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    args = [torch.randn(32, 16), torch.randn(16, 64), torch.randn(64, 64), torch.randn(64, 4)]
    args = [a.requires_grad_(i > 0) for i, a in enumerate(args)]
    compiled = aot_function(_mlp, fw_compiler=lambda gm, _: gm, partition_fn=partition,
                            decompositions=default_decompositions)
    with torch._functorch.config.patch(enable_activation_offloading=False):
        compiled(*args).backward()
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def on_cuda(value):
        if not isinstance(value, torch.Tensor):
            return value
        with mode:
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="cuda")

    for node in seen["joint"].graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = pytree.tree_map(on_cuda, node.meta["val"])
    return seen["joint"], [on_cuda(i) for i in seen["inputs"]], seen["kwargs"], mode


@pytest.fixture(autouse=True)
def _no_device_timing(monkeypatch):
    monkeypatch.setattr(activation_offloading, "benchmark_node", lambda node: 0.0)


def _partitioned(**patch):
    joint, inputs, kwargs, mode = _joint_on_fake_cuda()
    with torch_offload_pass(**patch), mode:
        joint = torch._functorch.config.joint_custom_pass(joint, inputs)
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]


def _saved(fw):
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    return list(outputs[1:])  # the loss, then what the backward reads


def test_torch_offload_moves_each_saved_activation_above_the_threshold_through_torchs_ao_ops():
    fw, bw = _partitioned()
    saved = _saved(fw)
    offloaded = {n.args[0].args[0].name for n in saved if n.target == AO.wait_tensor.default}
    expected = {
        n.name for n in fw.graph.nodes
        if n.op == "call_function" and n.target not in (AO.offload.default, AO.wait_tensor.default)
        and n in {a for s in saved for a in ([s.args[1]] if s.target == AO.wait_tensor.default else [s])}
        and n.meta["val"].numel() * n.meta["val"].element_size() >= OFFLOAD_MIN_BYTES
        and n.meta["val"].is_contiguous() and n.target is not operator.getitem
        and not torch._functorch.partitioners.get_default_op_list().is_view(n)
    }  # fmt: skip
    assert offloaded, "nothing was offloaded"
    assert offloaded == expected
    for name in offloaded:  # each copy reads the activation on its CUDA device, once
        (offload,) = [n for n in _calls(fw, AO.offload.default) if n.args[0].name == name]
        assert offload.args[0].meta["val"].device.type == "cuda"
    # the backward reloads each of them to the device, and reads the reload, never the host copy
    reloads = _calls(bw, AO.reload.default)
    assert sorted(r.args[0].name for r in reloads) == sorted(f"cpu_offload_{name}" for name in offloaded)
    assert all(r.args[1] == torch.device("cuda", 0) for r in reloads)
    for host in bw.graph.find_nodes(op="placeholder"):
        if host.name.startswith("cpu_offload_"):
            assert {u.target for u in host.users} <= {AO.reload.default, AO.wait_tensor.default}


def test_torch_offload_sinks_the_forward_waits_and_prefetches_the_backward_reloads():
    fw, bw = _partitioned()
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    waits = _calls(fw, AO.wait_tensor.default)
    computed = [n for n in fw.graph.nodes if n.op == "call_function" and n.target not in (AO.wait_tensor.default,)]
    assert waits and min(order[w] for w in waits) > max(order[n] for n in computed)  # sunk: after every op
    border = {n: i for i, n in enumerate(bw.graph.nodes)}
    first_compute = min(border[n] for n in bw.graph.nodes if n.op == "call_function"
                        and n.target not in (AO.reload.default, AO.wait_tensor.default))  # fmt: skip
    assert all(border[r] < first_compute for r in _calls(bw, AO.reload.default))  # prefetched: issued up front


def test_torch_offload_leaves_values_under_its_threshold_on_the_device():
    fw, bw = _partitioned(min_bytes=1 << 20)
    assert not _calls(fw, AO.offload.default) and not _calls(bw, AO.reload.default)


def test_mark_for_offload_refuses_a_negative_threshold():
    with pytest.raises(ValueError, match="min_bytes"):
        torch_offload_pass(min_bytes=-1)
    with pytest.raises(ValueError, match="min_bytes"):
        mark_for_offload(torch.fx.symbolic_trace(torch.nn.ReLU()), min_bytes=-1)


def test_torch_offload_is_a_cuda_only_configuration_left_out_on_cpu():
    assert CONFIGS["torch offload"].cuda_only
    assert "torch offload" not in {c.name for c, _ in jobs(["compiled", "torch offload"], ["inductor"], "cpu")}
    assert "torch offload" in {c.name for c, _ in jobs(["compiled", "torch offload"], ["inductor"], "cuda")}
