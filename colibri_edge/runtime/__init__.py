"""The runtime: the layer program (program), the step runner (runner), the activation arena, the
per-sequence state pools (state), the expert slot pool (slots), rope tables and routing hooks. Builds
on the model and the backends (whose routing.py defines the routing policy every backend runs)."""
