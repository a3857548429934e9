"""The runtime: the layer program (program), the step runner (runner), the activation arena, the
per-sequence state pools (state), the expert slot pool (slots), routing policy and alignment (routing),
rope tables, host memory and routing hooks. Builds on the model and the backends."""
