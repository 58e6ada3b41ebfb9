"""Built-in models and the model protocol: `Model` (params and a `ModelConfig`), `init_params`,
and quantized weights (`quantize`, `dequantize_model`, `QuantizedWeight`)."""

from specjax.models.config import ModelConfig, RopeScaling, gemma_style
from specjax.models.quant import QuantizedWeight, dequantize_model, quantize
from specjax.models.transformer import ForwardOutput, Model, forward, init_params

__all__ = ["ForwardOutput", "Model", "ModelConfig", "QuantizedWeight", "RopeScaling",
           "dequantize_model", "forward", "gemma_style", "init_params", "quantize"]
