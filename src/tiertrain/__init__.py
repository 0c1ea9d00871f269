"""tiertrain: train Transformer models whose training state does not fit in accelerator memory."""

from tiertrain.errors import CheckpointError, ConfigError, DataError, OutputError, UserError

__version__ = "0.1.0"
__all__ = ["Budgets", "CheckpointError", "ConfigError", "DataError", "OutputError", "PipelineLayout", "Plan",
           "UserError", "__version__", "load_pipeline", "pipeline", "save_pipeline", "setup", "tensor_parallel",
           "save_tensor_parallel", "load_tensor_parallel"]


def __getattr__(name: str):
    """Lazy imports keep ``import tiertrain`` light for the CLI and the planner."""
    if name == "setup":
        from tiertrain.api.setup import setup

        return setup
    if name == "pipeline":
        from tiertrain.api.pipeline import pipeline

        return pipeline
    if name == "tensor_parallel":
        from tiertrain.api.tensor_parallel import tensor_parallel

        return tensor_parallel
    if name in ("save_tensor_parallel", "load_tensor_parallel"):
        from tiertrain.checkpoint import tensor_parallel

        return getattr(tensor_parallel, name)
    if name in ("save_pipeline", "load_pipeline"):
        from tiertrain.checkpoint import pipelined

        return getattr(pipelined, name)
    if name == "PipelineLayout":
        from tiertrain.plan.pipeline import PipelineLayout

        return PipelineLayout
    if name == "Budgets":
        from tiertrain.plan import Budgets

        return Budgets
    if name == "Plan":
        from tiertrain.plan import Plan

        return Plan
    if name in _SUBPACKAGES:  # ``tiertrain.models.build(...)`` without importing tiertrain.models first
        import importlib

        return importlib.import_module(f"tiertrain.{name}")
    raise AttributeError(name)


_SUBPACKAGES = ("models", "api", "train", "checkpoint", "autoplan", "measure", "memory", "plan", "planner", "runtime", "parallel", "optim", "data")
