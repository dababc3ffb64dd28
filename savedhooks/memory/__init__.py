"""Memory of FX graphs: the buffer model, predicted and measured peaks, arena plans."""

from savedhooks.memory.arena import (
    ARENA_STRATEGIES,
    CUDA_ALIGNMENT,
    ArenaPlan,
    Lifetime,
    buffer_lifetimes,
    liveness_peak,
    plan_arena,
    plan_lifetimes,
    validate_arena,
)
from savedhooks.memory.estimate import (
    PeakEstimate,
    StepPrediction,
    estimate_peak,
    freed_inputs,
    lower_bound,
    predict_step,
    saved_activations,
    simulate,
    simulate_order,
)
from savedhooks.memory.fusion import inlined_nodes
from savedhooks.memory.graph import Buffer, GraphMemory, build_graph_memory
from savedhooks.memory.measure import cpu_memory_trace, measure_peak, measure_peaks, profile_graph
from savedhooks.memory.report import graph_to_json, plot_timeline
from savedhooks.memory.scratch import op_scratch_bytes

__all__ = [
    # predict
    "estimate_peak",
    "PeakEstimate",
    "predict_step",
    "StepPrediction",
    "saved_activations",
    "freed_inputs",
    "lower_bound",
    "simulate",
    "simulate_order",
    # place
    "plan_arena",
    "ArenaPlan",
    "validate_arena",
    "plan_lifetimes",
    "buffer_lifetimes",
    "liveness_peak",
    "Lifetime",
    "ARENA_STRATEGIES",
    "CUDA_ALIGNMENT",
    # the model
    "build_graph_memory",
    "GraphMemory",
    "Buffer",
    "op_scratch_bytes",
    "inlined_nodes",
    # measure
    "measure_peak",
    "measure_peaks",
    "profile_graph",
    "cpu_memory_trace",
    # look
    "graph_to_json",
    "plot_timeline",
]
