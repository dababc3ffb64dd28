"""keep_input_layout: a forward graph's saved data inputs marked user-visible for inductor (README "Under inductor")."""

import types

import torch
import torch.fx

from savedhooks.input_layout import keep_input_layout


def _forward_graph() -> torch.fx.Graph:
    """A forward graph as AOTAutograd hands it to inductor: weight, image; returns (out, weight, image, None)."""
    graph = torch.fx.Graph()
    weight, image = graph.placeholder("primals_1"), graph.placeholder("primals_2")
    out = graph.call_function(torch.ops.aten.convolution.default, (image, weight, None, [1, 1], [0, 0], [1, 1],
                                                                    False, [0, 0], 1))
    output = graph.output((out, weight, image, None))
    output.meta["user_visible_output_idxs"] = [0]
    output.meta["original_output_strides"] = [(16, 4, 2, 1), (27, 9, 3, 1), (48, 16, 4, 1), None]
    return graph


def _keep(graph: torch.fx.Graph, inputs: int, static: list[int]) -> list[str]:
    context = torch._guards.TracingContext(None)
    context.fw_metadata = types.SimpleNamespace(input_info=[None] * inputs, static_input_indices=static)
    with torch._guards.tracing(context):
        return keep_input_layout(graph)


def test_only_the_data_input_is_marked():
    graph = _forward_graph()
    assert _keep(graph, inputs=2, static=[0]) == ["primals_2"]  # the weight (a parameter) keeps inductor's layout
    assert graph.output_node().meta["user_visible_output_idxs"] == [0, 2]
    assert _keep(graph, inputs=2, static=[0]) == []  # already marked


def test_nothing_is_marked_without_the_compile_context_or_with_unmatched_inputs():
    graph = _forward_graph()
    assert keep_input_layout(graph) == []  # no TracingContext: not inside inductor's compile
    assert _keep(graph, inputs=3, static=[0]) == []  # placeholders not matched to AOTAutograd's inputs
    assert _keep(graph, inputs=2, static=[0, 1]) == []  # both inputs are parameters
    assert graph.output_node().meta["user_visible_output_idxs"] == [0]
    del graph.output_node().meta["user_visible_output_idxs"]  # a graph inductor did not annotate
    assert _keep(graph, inputs=2, static=[0]) == []
