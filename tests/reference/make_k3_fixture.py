#!/usr/bin/env python3
"""Write the tiny-k3 oracle fixture (MODEL.md §8) from the PyTorch reference k3_reference.py.

    python tests/reference/make_k3_fixture.py --out tests/data      # -> tests/data/tiny-k3/

Output (laid out like the real moonshotai/Kimi-K3 checkpoint):
  config.json        root {model_type: kimi_k3, architectures, text_config{kimi_linear fields}, quantization_config}
  model.safetensors  text tensors prefixed ``language_model.``; fp32 except the routed experts, which are
                     compressed-tensors MXFP4 (``weight_packed`` uint8 [out,in/2] + ``weight_scale`` uint8
                     [out,in/32]); plus two small vision/projector tensors a text engine must ignore.
  oracle.json        cases len1 / len5 / len80, greedy ids from the cached decode path, logits .npy from one
                     teacher-forced full forward over prompt ++ greedy_ids[:-1].
  len{P}.float32.npy float32 little-endian [P+N-1, vocab].

The oracle is computed from the checkpoint as RELOADED from disk (load_checkpoint), so it matches the files.
Runs on CPU, offline, torch + safetensors + numpy only.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from k3_reference import (  # noqa: E402
    K3Config, K3Reference, load_checkpoint, mxfp4_pack, mxfp4_decode, MX_BLOCK,
)

NAME = "tiny-k3"
SEED = 7007
PROMPT_LENGTHS = (1, 5, 80)   # 80 = KDA chunks 64 + 16
MAX_NEW_TOKENS = 12
MIN_MARGIN = 2e-3             # top1 - top2 logit gap at every generated position (float32)
MAX_FP32_DIFF = 1e-4         # float32 reference vs float64 oracle, max abs logit diff (conditioning filter)
MIN_ROUTER_MARGIN = 1e-3      # k-th vs (k+1)-th selection score (s + bias), every MoE layer and token
MAX_ATTEMPTS = 400
VOCAB_LO = 3                  # 0/1/2 = bos/eos/pad never appear in prompts
SPECIAL_IDS = (0, 1, 2)       # draws whose greedy ids contain bos/eos/pad are rejected (engines may stop)
MX_SCALE_RANGE = (118, 126)   # E8M0 exponent bytes of the random expert scales (inclusive)
MX_ROW_SPREAD = 2             # scale bytes of one expert matrix span at most base..base+2
AR_PROJ_STD = 0.15            # AttnRes pseudo-queries (MODEL.md §8 says 0.5: see WEIGHT_INIT / README)
LIN_GAIN = 0.5                # "other" linear layers W[out,in] ~ N(0, (LIN_GAIN/sqrt(in))^2)

# MODEL.md §8 tiny-k3 (Moonshot/K3 field names), the text part of config.json.
TEXT_CONFIG = {
    "model_type": "kimi_linear",
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 32,
    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
    "mla_use_output_gate": True,
    "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
    "attn_res_block_size": 3, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "torch_dtype": "float32",
    "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                           "use_full_rank_gate": True, "kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6, 7]},
}
QUANT_CONFIG = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32}}}}
ROOT_CONFIG = {
    "model_type": "kimi_k3",
    "architectures": ["KimiK3ForConditionalGeneration"],
    "text_config": TEXT_CONFIG,
    "quantization_config": QUANT_CONFIG,
}

WEIGHT_INIT = (
    "numpy default_rng([seed, crc32(tensor name without language_model.)]) per tensor, float64 -> float32. "
    "Linear W[out,in] ~ N(0, 1/in) (unit gain) except: embed_tokens N(0,1); lm_head N(0,1/H); "
    "q_a_proj N(0, 0.1^2/H) and the first kv_lora_rank rows of kv_a_proj_with_mqa N(0, 0.1^2/H) "
    "(latents of RMS ~0.1 so the eps=1e-6 of q_a/kv_a_layernorm matters), the k_r rows of kv_a_proj_with_mqa N(0,1/H); "
    "AttnRes *_res_proj / output_attn_res_proj N(0,0.5^2); router gate.weight N(0,0.5^2); "
    "e_score_correction_bias N(0,0.1^2); every norm weight 1+N(0,0.1^2); A_log = ln U(1,16) [1,1,n_k,1]; "
    "dt_bias N(0,0.5^2) [P]; conv [P,1,4] N(0,1/4); routed experts MXFP4 with uniform random codes 0..15 "
    "and uniform random E8M0 scale bytes 118..126 (one per 32 inputs)."
)


def _rng(seed: int, key: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.float64)).to(torch.float32)


def tensor_value(key: str, shape, t: dict, seed: int) -> torch.Tensor:
    """Seeded value of a float tensor, by name (no language_model. prefix)."""
    rng = _rng(seed, key)
    H = t["hidden_size"]
    n = int(np.prod(shape))

    def normal(std, mean=0.0):
        return (mean + std * rng.standard_normal(n)).reshape(shape)

    if key.endswith("A_log"):
        v = np.log(rng.uniform(1.0, 16.0, n)).reshape(shape)
    elif key.endswith("dt_bias"):
        v = normal(0.5)
    elif key.endswith("e_score_correction_bias"):
        v = normal(0.1)
    elif len(shape) == 1 and "norm" in key:
        v = normal(0.1, 1.0)
    elif key.endswith("_res_proj.weight"):
        v = normal(AR_PROJ_STD)
    elif key.endswith("block_sparse_moe.gate.weight"):
        v = normal(0.5)
    elif key.endswith("embed_tokens.weight"):
        v = normal(1.0)
    elif key.endswith("lm_head.weight"):
        v = normal(1.0 / math.sqrt(H))
    elif key.endswith("q_a_proj.weight"):
        v = normal(0.1 / math.sqrt(shape[-1]))
    elif key.endswith("kv_a_proj_with_mqa.weight"):
        v = normal(1.0 / math.sqrt(shape[-1]))
        v[: t["kv_lora_rank"]] *= 0.1
    elif key.endswith("conv1d.weight"):
        v = normal(1.0 / math.sqrt(shape[-1]))
    elif len(shape) == 2:
        v = normal(LIN_GAIN / math.sqrt(shape[-1]))
    else:
        raise ValueError(f"no init rule for {key} {shape}")
    return _t(v)


def kda_shapes(t: dict) -> dict:
    H = t["hidden_size"]
    la = t["linear_attn_config"]
    n, d, K = la["num_heads"], la["head_dim"], la["short_conv_kernel_size"]
    P = n * d
    s = {f"{x}_proj.weight": (P, H) for x in "qkv"}
    s.update({f"{x}_conv1d.weight": (P, 1, K) for x in "qkv"})
    s.update({"A_log": (1, 1, n, 1), "dt_bias": (P,), "f_a_proj.weight": (d, H), "f_b_proj.weight": (P, d),
              "b_proj.weight": (n, H), "o_norm.weight": (d,), "o_proj.weight": (H, P)})
    if la.get("use_full_rank_gate"):
        s["g_proj.weight"] = (P, H)
    else:
        s.update({"g_a_proj.weight": (d, H), "g_b_proj.weight": (P, d)})
    return s


def mla_shapes(t: dict) -> dict:
    H, nh = t["hidden_size"], t["num_attention_heads"]
    dn, dr, dv, r = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"], t["kv_lora_rank"]
    s = {}
    if t.get("q_lora_rank"):
        s.update({"q_a_proj.weight": (t["q_lora_rank"], H), "q_a_layernorm.weight": (t["q_lora_rank"],),
                  "q_b_proj.weight": (nh * (dn + dr), t["q_lora_rank"])})
    else:
        s["q_proj.weight"] = (nh * (dn + dr), H)
    s.update({"kv_a_proj_with_mqa.weight": (r + dr, H), "kv_a_layernorm.weight": (r,),
              "kv_b_proj.weight": (nh * (dn + dv), r), "o_proj.weight": (H, nh * dv)})
    if t.get("mla_use_output_gate"):
        s["g_proj.weight"] = (nh * dv, H)
    return s


def mixer_tensors(t: dict, i: int, kind: str, seed: int) -> dict:
    shapes = kda_shapes(t) if kind == "kda" else mla_shapes(t)
    return {f"model.layers.{i}.self_attn.{k}": tensor_value(f"model.layers.{i}.self_attn.{k}", s, t, seed)
            for k, s in shapes.items()}


def make_expert(key: str, out: int, inp: int, seed: int):
    """Random MXFP4 weight: (packed uint8 [out,in/2], scale uint8 [out,in/32]).
    Codes uniform in 0..15. Scale bytes: a per-matrix base b uniform in [lo, hi-MX_ROW_SPREAD], plus a
    per-(row, block) offset uniform in [0, MX_ROW_SPREAD]; all bytes lie in MX_SCALE_RANGE = [lo, hi].
    (Rows within one matrix differ by up to 2^MX_ROW_SPREAD, so scale-indexing bugs show, but not by
    2^8, which would make the expert Jacobians so anisotropic that float32 noise is amplified to >1e-4.)"""
    rng = _rng(seed, key)
    lo, hi = MX_SCALE_RANGE
    codes = torch.from_numpy(rng.integers(0, 16, size=(out, inp)).astype(np.uint8))
    base = int(rng.integers(lo, hi - MX_ROW_SPREAD + 1))
    scales = base + rng.integers(0, MX_ROW_SPREAD + 1, size=(out, inp // MX_BLOCK))
    assert scales.min() >= lo and scales.max() <= hi
    return mxfp4_pack(codes), torch.from_numpy(scales.astype(np.uint8))


def make_tensors(t: dict = TEXT_CONFIG, seed: int = SEED) -> dict[str, torch.Tensor]:
    """All text tensors, names WITHOUT the language_model. prefix. Experts as weight_packed/weight_scale."""
    cfg = K3Config.from_dict(t)
    H, V = t["hidden_size"], t["vocab_size"]
    out: dict[str, torch.Tensor] = {}

    def put(key, shape):
        out[key] = tensor_value(key, shape, t, seed)

    put("model.embed_tokens.weight", (V, H))
    put("lm_head.weight", (V, H))
    put("model.norm.weight", (H,))
    put("model.output_attn_res_norm.weight", (H,))
    put("model.output_attn_res_proj.weight", (1, H))
    I, Lat, E = t["moe_intermediate_size"], t["routed_expert_hidden_size"], t["num_experts"]
    Is = t["num_shared_experts"] * I
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for nm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            put(p + nm + ".weight", (H,))
        put(p + "self_attention_res_proj.weight", (1, H))
        put(p + "mlp_res_proj.weight", (1, H))
        out.update(mixer_tensors(t, i, "mla" if cfg.is_mla(i) else "kda", seed))
        if cfg.is_moe(i):
            q = p + "block_sparse_moe."
            put(q + "gate.weight", (E, H))
            put(q + "gate.e_score_correction_bias", (E,))
            put(q + "routed_expert_down_proj.weight", (Lat, H))
            put(q + "routed_expert_norm.weight", (Lat,))
            put(q + "routed_expert_up_proj.weight", (H, Lat))
            for e in range(E):
                for w, (o, n_in) in (("w1", (I, Lat)), ("w3", (I, Lat)), ("w2", (Lat, I))):
                    key = q + f"experts.{e}.{w}"
                    out[key + ".weight_packed"], out[key + ".weight_scale"] = make_expert(key, o, n_in, seed)
            put(q + "shared_experts.gate_proj.weight", (Is, H))
            put(q + "shared_experts.up_proj.weight", (Is, H))
            put(q + "shared_experts.down_proj.weight", (H, Is))
        else:
            put(p + "mlp.gate_proj.weight", (t["intermediate_size"], H))
            put(p + "mlp.up_proj.weight", (t["intermediate_size"], H))
            put(p + "mlp.down_proj.weight", (H, t["intermediate_size"]))
    return out


def dequantized(tensors: dict) -> dict:
    """tensors (as written) -> reference weights (MXFP4 pairs dequantized to X.weight)."""
    w = {}
    for k, v in tensors.items():
        if k.endswith(".weight_scale"):
            continue
        if k.endswith(".weight_packed"):
            base = k[: -len("_packed")]
            w[base] = mxfp4_decode(v, tensors[base + "_scale"], torch.float64)
        else:
            w[k] = v
    return w


def write_checkpoint(out_dir: Path, tensors: dict) -> None:
    files = {"language_model." + k: v.contiguous() for k, v in tensors.items()}
    rng = _rng(SEED, "non-text")
    files["vision_tower.patch_embed.weight"] = _t(rng.standard_normal((4, 4)))
    files["multi_modal_projector.linear_1.weight"] = _t(rng.standard_normal((4, 4)))
    save_file(files, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)
    with open(out_dir / "config.json", "w") as f:
        json.dump(ROOT_CONFIG, f, indent=2)
        f.write("\n")


def router_margin(model: K3Reference) -> float:
    k = model.cfg.num_experts_per_token
    m = math.inf
    for _, vals in model.last_router:
        gap = vals[:, k - 1] - vals[:, k]
        m = min(m, float(gap.min()))
    return m


def run_case(m64: K3Reference, m32: K3Reference, prompt: list, n_new: int) -> dict:
    """The oracle is the float64 reference (exact math up to fp64 rounding); the float32 reference must
    reproduce its greedy ids and stay within MAX_FP32_DIFF of its logits (conditioning filter)."""
    P = len(prompt)
    greedy, cached64 = m64.generate_greedy(prompt, n_new)
    full = prompt + greedy[:-1]
    m64.last_router, m64.record_router = [], True
    tf = m64.forward(full)                                     # ONE teacher-forced forward, no cache
    m64.record_router = False
    gen_rows = tf[P - 1:]
    top2 = gen_rows.topk(2, dim=-1).values
    greedy32, cached32 = m32.generate_greedy(prompt, n_new)
    tf32 = m32.forward(full)
    res = dict(
        greedy=greedy, logits=tf, argmax_ok=gen_rows.argmax(-1).tolist() == greedy,
        min_margin=float((top2[:, 0] - top2[:, 1]).min()), router_margin=router_margin(m64),
        decode_diff64=float((cached64 - gen_rows).abs().max()),
        decode_diff32=float((cached32.double() - tf32[P - 1:].double()).abs().max()),
        fp32_same_greedy=greedy32 == greedy,
        fp32_diff=float((tf32.double() - tf).abs().max()),
        max_abs_logit=float(tf.abs().max()),
    )
    # split prefill with cache continuation (33 + rest), as the C++ oracle test also runs it
    if len(full) > 33:
        for tag, m, ref in (("64", m64, tf), ("32", m32, tf32)):
            cache = m.new_cache()
            a = m.forward(full[:33], cache)
            b = m.forward(full[33:], cache)
            res["split_diff" + tag] = float((torch.cat([a, b]).double() - ref.double()).abs().max())
    return res


def make_fixture(out_root: Path) -> None:
    out_dir = out_root / NAME
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    tensors = make_tensors()
    write_checkpoint(out_dir, tensors)

    cfg, weights = load_checkpoint(out_dir)
    mem = dequantized(tensors)
    assert set(weights) == set(mem), set(weights) ^ set(mem)
    for k in weights:
        assert torch.equal(weights[k].double(), mem[k].double()), f"{k}: reloaded != written"
    m64 = K3Reference(cfg, weights, torch.float64)
    m32 = K3Reference(cfg, weights, torch.float32)

    cases, lines = [], []
    for ci, P in enumerate(PROMPT_LENGTHS):
        rejected = {}
        for attempt in range(MAX_ATTEMPTS):
            rng = np.random.default_rng([SEED, 7, ci, attempt])
            prompt = rng.integers(VOCAB_LO, cfg.vocab_size, size=P).tolist()
            r = run_case(m64, m32, prompt, MAX_NEW_TOKENS)
            why = None
            if not r["argmax_ok"]:
                why = "cached greedy != teacher-forced argmax"
            elif r["min_margin"] < MIN_MARGIN:
                why = "logit margin"
            elif r["router_margin"] < MIN_ROUTER_MARGIN:
                why = "router selection margin"
            elif any(x in SPECIAL_IDS for x in r["greedy"]):
                why = "greedy ids contain bos/eos/pad"
            elif not r["fp32_same_greedy"] or r["fp32_diff"] > MAX_FP32_DIFF:
                why = "float32 reference too far from float64"
            if why is None:
                break
            rejected[why] = rejected.get(why, 0) + 1
        else:
            raise RuntimeError(f"no prompt of length {P} met the margins after {MAX_ATTEMPTS} draws")
        assert r["decode_diff64"] < 1e-9 and r.get("split_diff64", 0.0) < 1e-9, r
        assert r["decode_diff32"] < 1e-4 and r.get("split_diff32", 0.0) < 1e-4, r
        fn = f"len{P}.float32.npy"
        arr = np.ascontiguousarray(r["logits"].numpy().astype("<f4"))
        assert arr.shape == (P + MAX_NEW_TOKENS - 1, cfg.vocab_size)
        np.save(out_dir / fn, arr)
        run = {"greedy_ids": r["greedy"], "logits": fn, "min_margin": r["min_margin"],
               "max_abs_logit": r["max_abs_logit"], "min_router_selection_margin": r["router_margin"],
               "float32_reference_vs_oracle_max_abs_diff": r["fp32_diff"],
               "cached_decode_vs_teacher_forced_max_abs_diff": {"float64": r["decode_diff64"],
                                                                "float32": r["decode_diff32"]}}
        if "split_diff64" in r:
            run["split_prefill_33_vs_teacher_forced_max_abs_diff"] = {"float64": r["split_diff64"],
                                                                      "float32": r["split_diff32"]}
        cases.append({"name": f"len{P}", "prompt_ids": prompt, "prompt_attempt": attempt,
                      "rejected_draws": rejected, "runs": {"float32": run}})
        lines.append(f"len{P:<3d} attempt={attempt} rejected={rejected} greedy={r['greedy']}\n"
                     f"         min_margin={r['min_margin']:.4f} router_margin={r['router_margin']:.4f} "
                     f"max|logit|={r['max_abs_logit']:.3f} fp32-vs-fp64={r['fp32_diff']:.2e} "
                     f"cached-vs-TF fp64={r['decode_diff64']:.1e} fp32={r['decode_diff32']:.1e} "
                     f"split33-vs-TF fp64={r.get('split_diff64', float('nan')):.1e} "
                     f"fp32={r.get('split_diff32', float('nan')):.1e}")

    manifest = {
        "fixture": NAME,
        "weights_dtype": "float32",
        "reference": "tests/reference/k3_reference.py",
        "torch": torch.__version__,
        "cases": cases,
        "seed": SEED,
        "covers": ("MODEL.md §8 tiny-k3: K3 layout (kimi_k3 root + text_config, language_model. prefix, non-text "
                   "tensors to ignore), Block AttnRes S=3 over 7 layers (block starts 0,3,6; final partial of 1 "
                   "layer; output AttnRes), gated NoPE MLA with q-LoRA at 0-based layers 2,5,6 (adjacent tail MLA), "
                   "KDA with lower-bounded forget gate (lb -5) and full-rank output gate at 0,1,3,4, SiTU dense "
                   "layer 0, LatentMoE (latent 32, latent RMSNorm, 2 shared experts) at 1..6, MXFP4 routed experts"),
        "weight_init": WEIGHT_INIT,
        "oracle": {
            "device": "cpu",
            "compute_dtype": "float64 everywhere (weights upcast exactly, MXFP4 dequantized exactly); logits "
                             "stored as float32. The float32 reference must give the same greedy ids and stay "
                             f"within {MAX_FP32_DIFF} of these logits (else the prompt is redrawn)",
            "kda_path": "chunked (chunk 64, MODEL.md §6) for every multi-token forward; recurrent (K6) for "
                        "1-token decode steps with a cache",
            "max_new_tokens": MAX_NEW_TOKENS, "eos_ignored": True,
            "greedy_ids": "cached path: prefill the prompt, then 1-token decode steps",
            "logits_rows": "row i = logits after consuming token i of prompt ++ greedy_ids[:-1] "
                           "(one teacher-forced forward, no cache)",
            "min_margin_required": MIN_MARGIN, "min_router_selection_margin_required": MIN_ROUTER_MARGIN,
            "draws_rejected_if_greedy_contains": list(SPECIAL_IDS),
        },
    }
    with open(out_dir / "oracle.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(f"== {NAME} -> {out_dir}  (torch {torch.__version__})")
    for ln in lines:
        print("   " + ln)
    total = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    print(f"   total size {total / 2**20:.3f} MiB ({total} bytes)")
    assert total < 2 * 10**6, "fixture must stay under 2 MB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/data", help="output root (default tests/data)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    make_fixture(Path(args.out))


if __name__ == "__main__":
    main()
