"""keep_input_layout / restore_input_layout: saved inputs as themselves under inductor (README "Under inductor")."""

import types

import torch
import torch.fx

from savedhooks.input_layout import keep_input_layout, restore_input_layout

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


def _context(inputs: int, static: list[int]) -> torch._guards.TracingContext:
    context = torch._guards.TracingContext(None)
    context.fw_metadata = types.SimpleNamespace(input_info=[None] * inputs, static_input_indices=static)
    return context


def _keep(graph: torch.fx.Graph, context: torch._guards.TracingContext) -> list[str]:
    with torch._guards.tracing(context):
        return keep_input_layout(graph)


def test_saved_inputs_are_marked_and_the_convolution_weight_recorded():
    graph, context = _forward_graph(), _context(inputs=2, static=[0])
    with torch._inductor.config.patch(layout_optimization=True):
        assert _keep(graph, context) == ["primals_1", "primals_2"]
        assert graph.output_node().meta["user_visible_output_idxs"] == [0, 1, 2]
        assert _keep(graph, context) == []  # already marked
    assert context.savedhooks_channels_last_inputs == {"primals_1"}  # the parameter; not the data input


def test_without_layout_optimization_only_data_inputs_are_marked():
    graph, context = _forward_graph(), _context(inputs=2, static=[0])
    with torch._inductor.config.patch(layout_optimization=False):
        assert _keep(graph, context) == ["primals_2"]
    assert not getattr(context, "savedhooks_channels_last_inputs", set())


def test_nothing_is_marked_without_the_compile_context_or_with_unmatched_inputs():
    graph = _forward_graph()
    assert keep_input_layout(graph) == []  # no TracingContext: not inside inductor's compile
    assert _keep(graph, _context(inputs=3, static=[0])) == []  # placeholders not matched to AOTAutograd's inputs
    assert graph.output_node().meta["user_visible_output_idxs"] == [0]
    del graph.output_node().meta["user_visible_output_idxs"]  # a graph inductor did not annotate
    assert _keep(graph, _context(inputs=2, static=[0])) == []


def test_a_recorded_weight_is_copied_to_channels_last_before_its_convolution_backward():
    graph = torch.fx.Graph()
    grad, weight, image = (graph.placeholder(n) for n in ("tangents_1", "primals_1", "primals_2"))
    grad.meta["val"], weight.meta["val"], image.meta["val"] = (
        torch.empty(2, 4, 6, 6), torch.empty(4, 3, 3, 3), torch.empty(2, 3, 8, 8))
    backward = graph.call_function(torch.ops.aten.convolution_backward.default,
                                   (grad, image, weight, [0], *_CONV_ARGS, [False, True, False]))
    graph.output((backward,))
    context = _context(inputs=2, static=[0])
    context.savedhooks_channels_last_inputs = {"primals_1"}
    assert restore_input_layout(graph) == []  # outside the compile's context: untouched
    with torch._guards.tracing(context):
        assert restore_input_layout(graph) == ["primals_1"]
    copy = backward.args[2]
    assert copy.target is torch.ops.aten.clone.default and copy.args == (weight,)
    assert copy.meta["val"].is_contiguous(memory_format=torch.channels_last)
    assert backward.args[1] is image  # the data input is left as it is
    assert list(graph.nodes).index(copy) < list(graph.nodes).index(backward)
