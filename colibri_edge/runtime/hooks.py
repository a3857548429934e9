"""The routing hook: how traces, observers and the prefetch policy see a step's routing."""
from __future__ import annotations


class RoutingHook:
    """Sees every MoE layer's routing, on the host. A step with a hook never runs as a graph replay.
    on_route gets backend buffers valid during the call (backend.download them to keep them)."""
    wants_prediction = False   # True: also get layer L+1's router applied to layer L's input

    def begin_step(self, entries, positions):
        """entries: the step's (SeqState, token ids); positions: host int32 [T] of its tokens."""

    def on_route(self, layer: int, ids, weights, next_layer: int, predicted):
        """ids [T,k] int32, weights [T,k]; predicted: host int32 [T,k] for next_layer, or None."""

    def on_prediction(self, next_layer: int, ids, weights):
        """Optional (default: nothing). Called before on_route when a prediction was made: host
        ids [T,k] int32 and their routing weights [T,k] float32 for next_layer."""

    def end_step(self):
        """The step's forward has run."""
