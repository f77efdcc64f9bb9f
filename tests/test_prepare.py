"""Model preparation: flattened quantized linears compute exactly what the model did."""

import mlx.core as mx
import mlx.nn as nn
import mlx_lm

from runtime import qgemv
from runtime.prepare import FlatQuantizedLinear, prepare_model


def test_flattened_linears_give_the_same_logits(tiny_model_path):
    model, _ = mlx_lm.load(str(tiny_model_path("llama")))  # its own copy: it gets changed
    nn.quantize(model, group_size=32, bits=4)
    tokens = mx.array([[5, 9, 13], [7, 2, 11]])
    before = model(tokens)
    if not qgemv.available():
        assert prepare_model(model) == 0  # off CUDA nothing changes unless forced
    changed = prepare_model(model, force=True, gemv=False)
    assert changed > 0 and isinstance(model.layers[0].self_attn.q_proj, FlatQuantizedLinear)
    assert prepare_model(model, force=True, gemv=False) == changed  # idempotent
    assert mx.array_equal(model(tokens), before).item()
    assert mx.array_equal(model(tokens[:, :1]), before[:, :1]).item()
    assert "_kvactors_gemv" not in dict(model.layers[0].self_attn.q_proj)  # not a parameter
