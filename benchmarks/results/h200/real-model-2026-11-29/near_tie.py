"""Top-3 logits of the first three greedy tokens of a question, through mlx-lm's cache and each KV route (on CUDA).

    KVACTORS_MODEL=tiny MLX_ENABLE_TF32=0 python near_tie.py   (the default model, SmolLM2-135M-Instruct, is loaded by name)
"""
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from runtime import attention
from runtime.model import load_model, default_model_file
from runtime.q4cache import make_batch_cache
attention.install()
model, tok, spec = load_model(default_model_file())
print("dtype", model.model.embed_tokens.weight.dtype if hasattr(model.model.embed_tokens, "weight") else "?", spec.kv_scheme)
prompt = tok.apply_chat_template([{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                                  {"role": "user", "content": "Who wrote Romeo and Juliet?"}], add_generation_prompt=True)
def steps(cache, n=3):
    out = []
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    for i in range(n):
        l = logits[0].astype(mx.float32)
        top = mx.argsort(-l)[:3].tolist()
        out.append([(t, round(l[t].item(), 4)) for t in top])
        logits = model(mx.array([[top[0]]]), cache=cache)[:, -1]
    return out
print("reference", steps(make_prompt_cache(model)))
print("batch    ", steps(make_batch_cache(spec, 1)))
for route in ("dequant", "dequant_once", "quantized"):
    try:
        print(route, steps(make_batch_cache(spec, 1, route=route)))
    except Exception as e:
        print(route, "failed", type(e).__name__, e)
