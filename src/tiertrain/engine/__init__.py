"""The engine: ``tiertrain.setup`` and the training loop around it, checkpoints, metrics, and
measuring the machine and the model (``engine.measure``). It applies plans through the runtime
and chooses them through the planner."""
