"""Built-in models and the model protocol."""

from specjax.models.config import ModelConfig, RopeScaling, gemma_style
from specjax.models.transformer import ForwardOutput, Model, forward, init_params

__all__ = ["ForwardOutput", "Model", "ModelConfig", "RopeScaling", "forward", "gemma_style",
           "init_params"]
