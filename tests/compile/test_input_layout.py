"""keep_input_layout / restore_input_layout: saved inputs as themselves under inductor."""

import types

import pytest
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from savedhooks.compiler.input_layout import keep_input_layout, recorded_weights, restore_input_layout

_CONV_ARGS = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)


def _forward_graph() -> torch.fx.Graph:
    """A forward graph as AOTAutograd hands it to inductor: weight, image; returns (out, weight, image, None)."""
    graph = torch.fx.Graph()
    weight, image = graph.placeholder("primals_1"), graph.placeholder("primals_2")
    weight.meta["val"], image.meta["val"] = torch.empty(4, 3, 3, 3), torch.empty(2, 3, 8, 8)
    out = graph.call_function(torch.ops.aten.convolution.default, (image, weight, None, *_CONV_ARGS))
    output = graph.output((out, weight, image, None))
    output.meta["user_visible_output_idxs"] = [0]
    output.meta["original_output_strides"] = [(144, 36, 6, 1), (27, 9, 3, 1), (192, 64, 8, 1), None]
    return graph


def _context() -> torch._guards.TracingContext:
    context = torch._guards.TracingContext(None)
    context.fw_metadata = types.SimpleNamespace()  # AOTAutograd's ViewAndMutationMeta of the forward
    return context


@pytest.mark.parametrize("layout", [True, False], ids=["layout-optimized", "not-optimized"])
def test_inputs_are_marked_and_weights_only_under_layout_optimization(layout):
    graph, context = _forward_graph(), _context()
    with torch._inductor.config.patch(layout_optimization=layout, force_layout_optimization=layout), \
            torch._guards.tracing(context):  # fmt: skip
        assert keep_input_layout(graph) == (["primals_1", "primals_2"] if layout else ["primals_2"])
        assert recorded_weights() == ({"primals_1"} if layout else set())  # the weight, by its use; not the image
        assert keep_input_layout(graph) == []  # already marked
        context.fw_metadata = types.SimpleNamespace()  # another forward under the same context (DDP's buckets)
        assert recorded_weights() == set()
    assert graph.output_node().meta["user_visible_output_idxs"] == ([0, 1, 2] if layout else [0, 2])


def test_nothing_is_marked_where_inductor_did_not_annotate_the_output():
    graph = _forward_graph()
    del graph.output_node().meta["user_visible_output_idxs"]
    with torch._guards.tracing(_context()):
        assert keep_input_layout(graph) == []
        assert recorded_weights() == set()
    assert recorded_weights() == set()  # outside a compile


def _backward_graph(recompute: bool = False):
    graph = torch.fx.Graph()
    grad, weight, image = (graph.placeholder(n) for n in ("tangents_1", "primals_1", "primals_2"))
    with FakeTensorMode():
        grad.meta["val"], weight.meta["val"], image.meta["val"] = (
            torch.empty(2, 4, 6, 6), torch.empty(4, 3, 3, 3), torch.empty(2, 3, 8, 8))
    if recompute:  # the forward's convolution again, as under checkpointing
        graph.call_function(torch.ops.aten.convolution.default, (image, weight, None, *_CONV_ARGS))
    backward = graph.call_function(torch.ops.aten.convolution_backward.default,
                                   (grad, image, weight, [0], *_CONV_ARGS, [False, True, False]))
    graph.output((backward,))
    return graph, weight, image, backward


def test_a_recorded_weight_is_copied_to_channels_last_before_its_convolution_backward():
    graph, weight, image, backward = _backward_graph()
    forward, context = _forward_graph(), _context()
    assert restore_input_layout(graph) == []  # outside the compile's context: untouched
    with torch._inductor.config.patch(force_layout_optimization=True), torch._guards.tracing(context):
        keep_input_layout(forward)
        assert restore_input_layout(graph) == ["primals_1"]
    copy = backward.args[2]
    assert copy.target is torch.ops.aten.clone.default and copy.args == (weight,)
    assert copy.meta["val"].is_contiguous(memory_format=torch.channels_last)
    assert backward.args[1] is image  # the image is left as it is
    assert list(graph.nodes).index(copy) < list(graph.nodes).index(backward)


def test_a_backward_that_recomputes_a_convolution_is_left_to_inductor():
    graph, weight, _, backward = _backward_graph(recompute=True)
    with torch._inductor.config.patch(force_layout_optimization=True), torch._guards.tracing(_context()):
        keep_input_layout(_forward_graph())
        assert restore_input_layout(graph) == []
    assert backward.args[2] is weight
