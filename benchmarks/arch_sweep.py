"""Every text architecture of mlx-lm through the Runtime: refused at load with ModelLoadError, or served right.

For each module of `mlx_lm.models` that defines a text LM (multimodal wrappers and modules that cannot be
imported are skipped, and said so), build a tiny random-weight model folder (`runtime.tiny.make_model_folder`:
the tiny tokenizer, config fields from a table of small defaults by name plus per-arch values) and, in a
child process, open a Runtime on it. The arch is either refused with ModelLoadError, or served: two agents
take two turns each in one batch (greedy, 6 tokens), their first turns token-identical to each served alone,
their hot second turns token-identical to the same turns served cold (a fresh Runtime, cache files deleted).
A head dim that the default KV scheme refuses (KVSchemeError, documented) is retried under k6v4-g64; a model
the Runtime serves on "dequant_once" by itself (`ModelCacheSpec.dense_kv`) says so in its row.
Anything else (a crash, a hang, other tokens) is a defect. CPU: about 2 s an arch.

The token checks are exact on CPU. On CUDA the tiny models' float32 products run on MLX's matmuls, whose
rounding depends on the batch's rows and on a prefill chunk's shape (a cold turn prefills its history in one
chunk, a hot one in a 64-row chunk), so there a near-tied logit may flip a late token: a WRONG on CUDA is a lead
to check, not a verdict (results/h200/arch-sweep-2026-11-28/README.md).

    python -m benchmarks.arch_sweep                  # every arch; a markdown table on stdout
    python -m benchmarks.arch_sweep phi3small gpt2   # some
    KVACTORS_Q4_ROUTE=dequant_once python -m benchmarks.arch_sweep   # the route CUDA's prefill takes
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULTS = {
    "hidden_size": 128, "d_model": 128, "n_embd": 128, "model_dim": 128, "hidden_dim": 128,
    "intermediate_size": 256, "ffn_hidden_size": 256, "n_inner": 256, "ff_intermediate_size": 256,
    "intermediate_size_mlp": 256, "moe_intermediate_size": 64, "expert_ffn_hidden_size": 64,
    "shared_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2, "num_layers": 2, "n_layers": 2, "n_layer": 2, "num_transformer_layers": 2,
    "num_attention_heads": 2, "n_head": 2, "n_heads": 2, "num_heads": 2,
    "num_key_value_heads": 1, "n_kv_heads": 1, "num_kv_heads": 1,
    "head_dim": 64, "vocab_size": 2048,
    "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "norm_eps": 1e-5,
    "layernorm_epsilon": 1e-5,
    "rope_theta": 10000.0, "rotary_emb_base": 10000.0,
    "max_position_embeddings": 4096, "n_positions": 4096, "n_ctx": 4096, "block_size": 4096,
    "model_max_length": 4096,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "n_shared_experts": 1, "num_shared_experts": 1,
    "num_shared_expert": 1,
    "attention_bias": False, "mlp_bias": False, "use_bias": False, "use_qkv_bias": False,
    "tie_word_embeddings": True, "partial_rotary_factor": 1.0, "rotary_pct": 1.0,
    "first_k_dense_replace": 1, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "sliding_window": 64,
    "rope_scaling": None, "qk_norm": False, "post_norm": False, "use_qk_norm": False,
}

# per-arch overrides (beyond the name defaults)
SW = ["sliding_attention", "full_attention"]
OVERRIDES = {
    "phi3small": {"dense_attention_every_n_layers": 2, "gegelu_limit": 20.0, "vocab_size": 100352,
                  "blocksparse_num_local_blocks": 2, "blocksparse_vert_stride": 2},
    "afm7": {"num_layers": 3, "num_kv_reuse_layers": 1},
    "afmoe": {"layer_types": SW, "num_dense_layers": 1},
    "apertus": {"hidden_act": "xielu"},
    "baichuan_m1": {"sliding_window_layers": [0], "conv_window": 2},
    "bailing_hybrid": {"layer_group_size": 2, "group_norm_size": 1, "kv_lora_rank": 64, "qk_rope_head_dim": 32,
                       "qk_nope_head_dim": 32, "v_head_dim": 64},
    "bailing_moe_linear": {"layer_group_size": 2, "group_norm_size": 1},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 1, "clip_qkv": 8.0, "rope_theta": 10000.0}},
    "deepseek_v2": {"rope_scaling": {"factor": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "type": "yarn"}},
    "exaone4": {"sliding_window_pattern": "LG"},
    "exaone_moe": {"layer_types": SW, "is_moe_layer": [False, True]},
    "gear": {"layer_types": SW},
    "cohere2": {"num_hidden_layers": 4, "sliding_window_pattern": 2},
    "gemma3_text": {"num_hidden_layers": 4, "sliding_window_pattern": 2, "query_pre_attn_scalar": 64},
    "gemma2": {"query_pre_attn_scalar": 64},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "mellum": {"layer_types": SW, "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
                                                       "full_attention": {"rope_theta": 10000.0, "rope_type": "default"}}},
    "mimo_v2_flash": {"hybrid_layer_pattern": [1, 0], "moe_layer_freq": [0, 1], "swa_num_attention_heads": 2,
                      "swa_num_key_value_heads": 1, "swa_head_dim": 64, "swa_v_head_dim": 64, "v_head_dim": 64,
                      "add_swa_attention_sink_bias": False, "add_full_attention_sink_bias": False,
                      "sliding_window_size": 64, "swa_rope_theta": 10000.0, "topk_method": "noaux_tc",
                      "scoring_func": "sigmoid"},
    "llama4_text": {"no_rope_layers": [1, 0]},
    "openelm": {"num_query_heads": [2, 2], "num_kv_heads": [1, 1], "ffn_multipliers": [2.0, 2.0],
                "ffn_divisor": 64, "ffn_dim_divisor": 64},
    "spark2_5": {"rope_parameters": {"sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
                                     "full_attention": {"rope_theta": 10000.0, "rope_type": "default"}}},
    "glm_moe_dsa": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    "mistral4": {"kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
                 "v_head_dim": 64},
}
MLA = {"kv_lora_rank": 64, "q_lora_rank": 64, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 64}
YARN = {"factor": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
        "mscale_all_dim": 1.0, "type": "yarn", "rope_type": "yarn"}
GRANITE = {"logits_scaling": 1.0, "attention_multiplier": 0.125, "embedding_multiplier": 1.0, "residual_multiplier": 1.0}
OVERRIDES.update({
    "glm_moe_dsa": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "index_head_dim": 64,
                    "index_n_heads": 2, "index_topk": 8, **MLA, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "moe_layer_freq": 1},
    "granitemoe": GRANITE,
    "granitemoehybrid": {**GRANITE, "layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 64,
                         "mamba_n_groups": 1, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2},
    "granite": GRANITE,
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}, "use_mixed_mlp_moe": False,
                "use_cla": False, "cla_share_factor": 1},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2,
              "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2},
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2, "head_dim": 64,
                                           "short_conv_kernel_size": 4}, "kv_lora_rank": 64},
    "lfm2_moe": {"use_expert_bias": False, "num_dense_layers": 1, "conv_bias": False, "conv_L_cache": 3,
                 "full_attn_idxs": [1]},
    "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity", "zero_expert_num": 1, **MLA,
                      "mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {"zero_expert_num": 1, **MLA, "mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "mamba": {"state_size": 16, "conv_kernel": 4, "use_conv_bias": True, "time_step_rank": 8},
    "mamba2": {"state_size": 16, "conv_kernel": 4, "use_conv_bias": True, "time_step_rank": 8, "n_groups": 1,
               "time_step_limit": [0.0, 1e9], "num_heads": 4},
    "minicpm": {"dim_model_base": 128, "scale_depth": 1.0, "scale_emb": 1.0},
    "minicpm3": {"dim_model_base": 128, "scale_depth": 1.0, "scale_emb": 1.0, **MLA},
    "minimax": {"rotary_dim": 64},
    "ministral3": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.0,
                                       "original_max_position_embeddings": 4096}},
    "mistral4": {**MLA, "rope_scaling": YARN},
    "deepseek_v2": {"rope_scaling": YARN},
    "nemotron": {"hidden_act": "relu2"},
    "nemotron_h": {"mamba_num_heads": 4, "mamba_head_dim": 32, "mamba_proj_bias": False, "ssm_state_size": 16,
                   "conv_kernel": 4, "n_groups": 1, "use_conv_bias": True, "hybrid_override_pattern": ["M", "*"]},
    "olmo3": {"layer_types": SW},
    "olmo_hybrid": {"linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 64,
                    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "linear_allow_neg_eigval": False},
    "plamo": {"num_key_value_heads": 1},
    "qwen": {"kv_channels": 64, "intermediate_size": 512},
    "qwen3_next": {"linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
                   "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "full_attention_interval": 2},
    "recurrent_gemma": {"conv1d_width": 4, "logits_soft_cap": 30.0, "attention_window_size": 64,
                        "block_types": ["recurrent", "attention"], "lru_width": 128},
    "rwkv7": {"a_low_rank_dim": 16, "v_low_rank_dim": 16, "gate_low_rank_dim": 16, "decay_low_rank_dim": 16},
    "step3p5": {"num_attention_groups": 1},
    "exaone4": {"sliding_window_pattern": "LG"},
})
SKIP = {  # multimodal wrappers (text_config around a vision tower) and the like: their text models are swept
    "gemma3", "gemma3n", "gemma4", "kimi_k25", "kimi_k3", "kimi_vl", "lfm2-vl", "llama4", "minimax_m3_vl",
    "mistral3", "muse_spark", "pixtral", "prism_hadamard_qwen35", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe",
}


NOT_MODELS = {"activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline", "rope_utils",
              "ssm", "switch_layers"}
MAX_PARAMS = 40_000_000
SYSTEM = "You are Alice, a careful planner."
TEXTS = ["Plan a bake sale for the team.", "Go on with the schedule."]
NEW = 6


def config_for(arch: str) -> dict:
    """The tiny config of `arch`: runtime.tiny's where it has one, else small defaults by field name + OVERRIDES."""
    from runtime import tiny

    if arch in tiny.ARCHS:
        return tiny.make_config(arch)
    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    cfg = {"model_type": arch}
    for f in dataclasses.fields(mod.ModelArgs):
        if f.name in DEFAULTS and f.name != "model_type":
            cfg[f.name] = DEFAULTS[f.name]
    cfg.update(OVERRIDES.get(arch, {}))
    return cfg


def build(arch: str, out: Path) -> Path:
    """The tiny model folder of `arch` at `out`; raises Skipped for archs the sweep leaves out."""
    from mlx.utils import tree_flatten

    from runtime.tiny import make_model_folder

    if arch in SKIP:
        raise Skipped("a multimodal wrapper (text_config around a vision tower); its text model is swept")
    try:
        mod = importlib.import_module(f"mlx_lm.models.{arch}")
    except BaseException as e:  # olmo exits when ai2-olmo is missing
        raise Skipped(f"cannot be imported ({type(e).__name__}: {e})") from e
    cfg = config_for(arch)
    n = sum(v.size for _, v in tree_flatten(mod.Model(mod.ModelArgs.from_dict(cfg)).parameters()))
    if n > MAX_PARAMS:
        raise Skipped(f"{n:,} parameters at the smallest config tried")
    return make_model_folder(out, cfg)


class Skipped(Exception):
    """The sweep leaves this arch out."""


def serve(model: Path, work: Path, scheme: str | None = None) -> dict:
    """Run `model` through the Runtime as the module docstring says; the outcome as a dict."""
    from runtime import Runtime
    from runtime.kvscheme import KVSchemeError
    from runtime.model import ModelLoadError

    agents = (("a", SYSTEM, ""), ("b", SYSTEM + " B", " Now."))
    try:
        rt = Runtime(model=str(model), cache_dir=work / "batch", warmup=False, kv_scheme=scheme)
    except ModelLoadError as e:
        return {"outcome": "refused", "why": str(e).removeprefix(f"{model}: ")}
    except KVSchemeError as e:
        if scheme:
            raise
        out = serve(model, work, "k6v4-g64")
        out["scheme"] = f"k6v4-g64 (the default: {e})"
        return out
    batched = {}
    route = "dequant_once, the default for it: its code reads the cache as arrays" if rt.spec.dense_kv else None
    with rt:
        refs = {name: rt.spawn(name, system=system) for name, system, _ in agents}
        for text in TEXTS:
            futures = {name: refs[name].send(text + tail, max_tokens=NEW, timeout=120) for name, _, tail in agents}
            for name, f in futures.items():
                r = f.get(timeout=120)
                batched.setdefault(name, []).append((r.tokens, r.cache))
    solo = {}
    with Runtime(model=str(model), cache_dir=work / "solo", warmup=False, kv_scheme=scheme) as rt:
        for name, system, tail in agents:
            solo[name] = [rt.spawn(name, system=system).ask(TEXTS[0] + tail, max_tokens=NEW, timeout=120)]
    for f in (work / "solo").glob("*/*/cache*.safetensors"):
        f.unlink()  # the journals keep the histories: the next turns are cold
    with Runtime(model=str(model), cache_dir=work / "solo", warmup=False, kv_scheme=scheme) as rt:
        for name, system, tail in agents:
            solo[name].append(rt.spawn(name, system=system).ask(TEXTS[1] + tail, max_tokens=NEW, timeout=120))
    problems = []
    for name, _, _ in agents:
        (t1, c1), (t2, c2) = batched[name]
        if (c1, c2, solo[name][1].cache) != ("cold", "hot", "cold"):
            problems.append(f"{name}: caches {c1}, {c2}, cold run {solo[name][1].cache}")
        if t1 != solo[name][0].tokens:
            problems.append(f"{name}: batched {t1} != alone {solo[name][0].tokens}")
        if t2 != solo[name][1].tokens:
            problems.append(f"{name}: hot {t2} != cold {solo[name][1].tokens}")
    return {"outcome": "WRONG" if problems else "served", "why": "; ".join(problems), **({"route": route} if route else {})}


def child(arch: str, root: Path) -> dict:
    """Build and serve one arch (in its own process: a crash or a hang is the arch's outcome, not the sweep's)."""
    try:
        model = build(arch, root / "models" / arch)
    except Skipped as e:
        return {"outcome": "skipped", "why": str(e)}
    except Exception as e:  # noqa: BLE001 - a config the table gets wrong: the sweep's problem, not the runtime's
        return {"outcome": "not built", "why": f"{type(e).__name__}: {e}"}
    return serve(model, root / "agents" / arch)


def archs() -> list[str]:
    import mlx_lm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__) if m.name not in NOT_MODELS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archs", nargs="*", help="mlx-lm model modules (default: all)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds an arch may take (default: %(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="also write the outcomes here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("OUTCOME " + json.dumps(child(args.child, args.root)), flush=True)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {}
    with tempfile.TemporaryDirectory(prefix="arch-sweep-") as tmp:
        os.environ.setdefault("KVACTORS_HOME", str(Path(tmp) / "home"))
        print("| arch | outcome | why |\n|---|---|---|", flush=True)
        for arch in args.archs or archs():
            try:
                p = subprocess.run([sys.executable, "-m", "benchmarks.arch_sweep", "--child", arch, "--root", tmp],
                                   capture_output=True, text=True, timeout=args.timeout)
                lines = [line for line in p.stdout.splitlines() if line.startswith("OUTCOME ")]
                tail = [line for line in p.stderr.splitlines() if line.strip()][-1:]
                out = json.loads(lines[-1][8:]) if lines else {"outcome": "CRASH", "why": " ".join(tail)}
            except subprocess.TimeoutExpired:
                out = {"outcome": "HANG", "why": f"past {args.timeout:.0f} s"}
            shutil.rmtree(Path(tmp) / "agents" / arch, ignore_errors=True)
            results[arch] = out
            why = " ".join([out["why"]] * bool(out["why"]) + [f"[{out[k]}]" for k in ("scheme", "route") if k in out])
            why = why.replace("|", "/")
            print(f"| {arch} | {out['outcome']} | {why[:300]} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if results and all(r["outcome"] == "not built" for r in results.values()):
        return 1  # nothing was swept (mlx or mlx-lm missing, say): not a pass
    return 1 if any(r["outcome"] in ("CRASH", "HANG", "WRONG") for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
