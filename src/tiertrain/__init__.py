"""tiertrain: train Transformer models whose training state does not fit in accelerator memory."""

from tiertrain.errors import CheckpointError, ConfigError, DataError, OutputError, UserError

__version__ = "0.1.0"
__all__ = ["CheckpointError", "ConfigError", "DataError", "OutputError", "UserError", "__version__"]
