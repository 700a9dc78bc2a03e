#!/usr/bin/env python3
"""Oracle-fixture generator for plow (Kimi Linear).
(Over 500 lines: one self-contained script that must run unchanged on a machine without the repo's other code.)

Writes small, seeded, fully randomized ``KimiLinearForCausalLM`` checkpoints with
HF transformers' own ``save_pretrained`` and, for each, an ``oracle.json`` manifest
plus float32 ``.npy`` logits computed by HF transformers from the checkpoint as
RELOADED from disk (so the oracle matches the files exactly).

    python tests/oracle/make_fixtures.py --out tests/data [--only NAME]

Everything runs on the CPU, offline, with HF's pure-PyTorch KDA path (chunked
prefill, recurrent single-token decode): the optional fast packages (fla,
causal_conv1d, kernels) are made unimportable before transformers is imported,
and hub access is disabled, so nothing is fetched. See tests/oracle/README.md.
"""

from __future__ import annotations

import os
import sys

# ---- offline / pure-PyTorch / CPU only: must happen before torch & transformers import ----
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["USE_HUB_KERNELS"] = "NO"  # never look up hub kernels
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # oracle is computed on the CPU, also on a GPU machine
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
for _blocked in ("fla", "causal_conv1d", "kernels"):
    # `None` in sys.modules: find_spec() says "not installed" and import raises ImportError, so
    # transformers' use_kernel_func_from_hub_with_fallback falls back to its torch reference code.
    sys.modules[_blocked] = None  # type: ignore[assignment]

import argparse  # noqa: E402
import warnings  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import zlib  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import GenerationConfig, KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

transformers.utils.logging.set_verbosity_error()
warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values / rope_scaling deprecations
try:
    transformers.utils.logging.disable_progress_bar()
except Exception:  # pragma: no cover
    pass

ATTN_IMPL = "sdpa"  # MLA attention backend used by the oracle (HF default)
EXPERTS_IMPL = "eager"  # HF reference loop over experts (per-expert index_add), not grouped_mm
PROMPT_LENGTHS = (1, 5, 80)  # 80 = two KDA chunks of 64 (64 + 16)
MAX_NEW_TOKENS = 10
MIN_MARGIN = {"float32": 2e-3, "bfloat16": 0.06}
MIN_ROUTER_MARGIN_FP32 = 1e-3  # expert-selection gap (k-th vs (k+1)-th s+bias; and group gap) in fp32 runs
MAX_ATTEMPTS = 400
VOCAB_LO = 3  # 0, 1, 2 = bos / eos / pad are never used in prompts

# --------------------------------------------------------------------------------------------
# Configs (Moonshot field names, MODEL.md §8). KimiLinearConfig accepts these directly.
# --------------------------------------------------------------------------------------------
TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": None,
    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "mla_use_nope": True, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4]},
}


def _cfg(**over):
    c = copy.deepcopy(TINY)
    c.update(over)
    return c


FIXTURES = {
    # MODEL.md §8 tiny-kimi-linear exactly. config.json rewritten to the published Moonshot form.
    "tiny-kimi-linear": dict(
        seed=1001, config=_cfg(), dtype="float32", max_shard_size=None, config_form="moonshot",
        covers="§8 tiny config: KDA+dense (layer 0), KDA+MoE (1,2,4), MLA+MoE (3); Moonshot config.json "
               "(1-based linear_attn_config, no layer_types); dense layer 0 stored under the Moonshot name "
               "model.layers.0.mlp.* (as in the published checkpoint)"),
    # Same architecture, bf16 weights, >= 3 safetensors shards + index.
    "tiny-kimi-linear-bf16-sharded": dict(
        seed=2002, config=_cfg(), dtype="bfloat16", max_shard_size="200KB", config_form="save_pretrained",
        covers="bf16 weights (A_log/dt_bias fp32 on disk as in the real checkpoint; router weight and "
               "e_score_correction_bias kept fp32 by HF), sharded safetensors with "
               "model.safetensors.index.json; float32 (upcast) and native bfloat16 oracle runs"),
    # tie_word_embeddings + q-LoRA MLA.
    "tiny-kimi-linear-tied-qlora": dict(
        seed=3003, config=_cfg(tie_word_embeddings=True, q_lora_rank=32), dtype="float32",
        max_shard_size=None, config_form="save_pretrained",
        covers="tie_word_embeddings=true (no lm_head.weight on disk: logits use embed_tokens), "
               "q_lora_rank=32 (q_a_proj -> q_a_layernorm(eps 1e-6) -> q_b_proj)"),
    # Grouped top-k, no renormalization, 2 shared experts, 6 layers with two MLA layers, last is MLA,
    # two leading dense layers (layer 1 = MLA + dense FFN).
    "tiny-kimi-linear-grouped": dict(
        seed=4004,
        config=_cfg(num_hidden_layers=6, num_experts=8, num_expert_group=4, topk_group=2,
                    num_experts_per_token=3, moe_renormalize=False, num_shared_experts=2,
                    routed_scaling_factor=1.7, first_k_dense_replace=2,
                    linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                                        "kda_layers": [1, 3, 4, 5], "full_attn_layers": [2, 6]}),
        dtype="float32", max_shard_size=None, config_form="save_pretrained",
        covers="grouped top-k (8 experts, 4 groups, topk_group 2, top-3), moe_renormalize=false, "
               "routed_scaling_factor 1.7, 2 shared experts (width 64), first_k_dense_replace=2 "
               "(layer 1 = MLA + dense FFN), MLA at 0-based layers 1 and 5 (last layer MLA)"),
}

# --------------------------------------------------------------------------------------------
# Weight randomization, by ON-DISK tensor name (so weights do not depend on HF's in-memory layout).
#
# Scale choice: the MODEL.md default N(0, 0.02^2) makes every sublayer of a hidden-64 model nearly
# invisible (outputs ~1e-2 of the residual) and logit margins tiny. We use unit-gain "LeCun" init
# instead: every linear layer W[out, in] (and every stacked expert [E, out, in]) ~ N(0, 1/in), so a
# unit-RMS input gives a unit-RMS output and each sublayer changes the residual stream by O(1)
# (the script prints rms(sublayer out) / rms(residual in) per fixture). Exceptions:
#   * embed_tokens ~ N(0, 1); lm_head ~ N(0, 1/H) -> logits of std ~1 (max |logit| ~ 4-5, so the
#     bf16 logit ulp is <= 1/32 and the 0.06 bf16 margin is >= 2 ulps). Tied fixture: the shared
#     matrix uses the lm_head scale 1/sqrt(H) for both roles.
#   * kv_a_proj_with_mqa: the kv_lora_rank latent rows (fed to kv_a_layernorm) and q_a_proj (fed to
#     q_a_layernorm) use gain 0.1, so the latent has RMS ~0.1 and the norm's eps = 1e-6 vs
#     rms_norm_eps = 1e-5 trap (MODEL.md §9.4) changes the output by ~5e-4 relative (visible in fp32);
#     the shared rope-key rows (k_r) keep gain 1.
#   * norms 1+N(0,0.1^2) (incl. KDA o_norm, kv_a_layernorm, q_a_layernorm); router N(0,0.5^2);
#     e_score_correction_bias N(0,0.1^2); A_log = ln U(1,16); dt_bias N(0,0.5^2);
#     depthwise conv [C,1,4] ~ N(0, 1/4) (same unit-gain rule, fan_in = kernel size).
# --------------------------------------------------------------------------------------------


def _rng(seed: int, key: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def random_tensor(key: str, shape, cfg: dict, seed: int) -> torch.Tensor:
    rng = _rng(seed, key)
    H = cfg["hidden_size"]
    n = int(np.prod(shape)) if len(shape) else 1

    def normal(std, mean=0.0):
        return mean + std * rng.standard_normal(n)

    if key.endswith("A_log"):
        v = np.log(rng.uniform(1.0, 16.0, n))
    elif key.endswith("dt_bias"):
        v = normal(0.5)
    elif key.endswith("e_score_correction_bias"):
        v = normal(0.1)
    elif len(shape) == 1 and "norm" in key:
        v = normal(0.1, 1.0)
    elif re.search(r"\.(block_sparse_moe|mlp)\.gate\.weight$", key):
        v = normal(0.5)
    elif key.endswith("embed_tokens.weight"):
        v = normal(1.0 / math.sqrt(H) if cfg.get("tie_word_embeddings") else 1.0)
    elif key.endswith("lm_head.weight"):
        v = normal(1.0 / math.sqrt(H))
    elif key.endswith("kv_a_proj_with_mqa.weight"):
        r = cfg["kv_lora_rank"]
        v = normal(1.0 / math.sqrt(shape[-1])).reshape(shape)
        v[:r] *= 0.1
    elif key.endswith("q_a_proj.weight"):
        v = normal(0.1 / math.sqrt(shape[-1]))
    elif len(shape) >= 2:  # linear layers, stacked experts, depthwise conv [C,1,K]
        v = normal(1.0 / math.sqrt(shape[-1]))
    else:
        raise ValueError(f"no randomization rule for {key} {shape}")
    return torch.from_numpy(np.asarray(v, dtype=np.float64).reshape(shape)).to(torch.float32)


# --------------------------------------------------------------------------------------------
# safetensors helpers
# --------------------------------------------------------------------------------------------


def read_dir_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def read_dir_shapes(d: Path) -> dict[str, tuple]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = tuple(h.get_slice(k).get_shape())
    return out


def rewrite_single_file(path: Path, fn) -> None:
    """Apply fn(dict) -> dict to a single-file checkpoint, keeping the format metadata."""
    with safe_open(str(path), framework="pt") as h:
        meta = h.metadata() or {}
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    tensors = fn(tensors)
    meta.setdefault("format", "pt")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


def moonshot_config(cfg: dict, torch_dtype: str) -> dict:
    """config.json in the field names of moonshotai/Kimi-Linear-48B-A3B-Instruct's published config."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    lac = cfg["linear_attn_config"]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
        "first_k_dense_replace": cfg["first_k_dense_replace"],
        "head_dim": H // nh,  # legacy field, unused (published: 72 = 2304/32)
        "hidden_act": cfg["hidden_act"], "hidden_size": H,
        "initializer_range": 0.02,
        "intermediate_size": cfg["intermediate_size"],
        "kv_lora_rank": cfg["kv_lora_rank"],
        "linear_attn_config": {
            "full_attn_layers": list(lac["full_attn_layers"]), "head_dim": lac["head_dim"],
            "kda_layers": list(lac["kda_layers"]), "num_heads": lac["num_heads"],
            "short_conv_kernel_size": lac["short_conv_kernel_size"],
        },
        "mla_use_nope": cfg["mla_use_nope"],
        "model_max_length": 1048576,
        "moe_intermediate_size": cfg["moe_intermediate_size"],
        "moe_layer_freq": cfg["moe_layer_freq"],
        "moe_renormalize": cfg["moe_renormalize"],
        "moe_router_activation_func": cfg["moe_router_activation_func"],
        "num_attention_heads": nh,
        "num_expert_group": cfg["num_expert_group"],
        "num_experts": cfg["num_experts"],
        "num_experts_per_token": cfg["num_experts_per_token"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "num_nextn_predict_layers": 0,
        "num_shared_experts": cfg["num_shared_experts"],
        "q_lora_rank": cfg["q_lora_rank"],
        "qk_nope_head_dim": cfg["qk_nope_head_dim"],
        "qk_rope_head_dim": cfg["qk_rope_head_dim"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "routed_scaling_factor": cfg["routed_scaling_factor"],
        "tie_word_embeddings": cfg["tie_word_embeddings"],
        "topk_group": cfg["topk_group"],
        "torch_dtype": torch_dtype,
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "use_grouped_topk": cfg["use_grouped_topk"],
        "v_head_dim": cfg["v_head_dim"],
        "vocab_size": cfg["vocab_size"],
    }


# --------------------------------------------------------------------------------------------
# Model loading / running
# --------------------------------------------------------------------------------------------


def load_model(d: Path, dtype: torch.dtype, tied: bool) -> KimiLinearForCausalLM:
    model, info = KimiLinearForCausalLM.from_pretrained(
        str(d), dtype=dtype, attn_implementation=ATTN_IMPL, experts_implementation=EXPERTS_IMPL,
        output_loading_info=True)
    missing = set(info.get("missing_keys", []))
    if tied:
        # transformers' KimiLinearForCausalLM declares no tied-weight keys, so it does not honour
        # tie_word_embeddings: tie explicitly (the checkpoint has no lm_head.weight).
        missing -= {"lm_head.weight"}
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            model.lm_head.weight = model.model.embed_tokens.weight
    bad = {k: v for k, v in info.items() if k != "missing_keys" and v}
    assert not missing and not bad, f"loading {d}: missing={missing} other={bad}"
    model.eval()
    model.generation_config.eos_token_id = None  # never stop early
    return model


def check_model_matches_files(model, d: Path, tmp: Path, tied: bool) -> None:
    """Round-trip the in-memory (reloaded) model through save_pretrained and compare to the files."""
    files = read_dir_tensors(d)
    rt_dir = tmp / "roundtrip"
    if rt_dir.exists():
        shutil.rmtree(rt_dir)
    if tied:  # save_pretrained refuses undeclared shared tensors: save an untied copy of the same values
        shared = model.lm_head.weight
        model.lm_head.weight = torch.nn.Parameter(shared.detach().clone(), requires_grad=False)
        try:
            model.save_pretrained(str(rt_dir))
        finally:
            model.lm_head.weight = model.model.embed_tokens.weight
    else:
        model.save_pretrained(str(rt_dir))
    rt = read_dir_tensors(rt_dir)
    # the Moonshot-form fixture stores dense layer FFNs as `mlp.` (HF writes `block_sparse_moe.`)
    rt = {k.replace(".block_sparse_moe.", ".mlp.") if k.replace(".block_sparse_moe.", ".mlp.") in files
          else k: v for k, v in rt.items()}
    for k, v in files.items():
        assert k in rt, f"{k} on disk but not in the reloaded model"
        assert torch.equal(rt[k].to(torch.float32), v.to(torch.float32)), f"reloaded {k} != file"
    if tied:
        assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@torch.no_grad()
def stepwise_diff(model, full: torch.Tensor, tf: torch.Tensor) -> float:
    """Feed the sequence one token at a time through the cache (1st token: chunked prefill, every later
    token: recurrent KDA decode) and return max |logits - teacher-forced (chunked) logits|."""
    out = model(input_ids=full[:, :1], use_cache=True)
    cache, rows = _cache_of(out), [out.logits[0, -1].float()]
    for t in range(1, full.shape[1]):
        out = model(input_ids=full[:, t:t + 1], past_key_values=cache, use_cache=True)
        cache = _cache_of(out)
        rows.append(out.logits[0, -1].float())
    return float((torch.stack(rows) - tf).abs().max())


def _cache_of(out):
    for name in ("past_key_values", "cache"):
        c = getattr(out, name, None)
        if c is not None:
            return c
    raise RuntimeError("model output carries no cache")


@torch.no_grad()
def run_case(model, prompt: list[int], n_new: int, cfg: dict) -> dict:
    ids = torch.tensor([prompt], dtype=torch.long)
    P = len(prompt)
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=n_new,
                          eos_token_id=None, pad_token_id=2, bos_token_id=0, use_cache=True,
                          return_dict_in_generate=True, output_logits=True)
    gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gc)
    seq = gen.sequences[0].tolist()
    assert len(seq) == P + n_new and seq[:P] == prompt, "generate returned an unexpected sequence"
    greedy = seq[P:]
    gen_logits = torch.stack([x[0] for x in gen.logits]).float()  # [N, V], cached path

    full = torch.tensor([prompt + greedy[:-1]], dtype=torch.long)
    probe = Probe(model, cfg)
    try:
        tf = model(input_ids=full, use_cache=False).logits[0].float()  # [P+N-1, V], one forward
    finally:
        probe.close()
    gen_rows = tf[P - 1:]
    argmax_ok = gen_rows.argmax(-1).tolist() == greedy
    top2 = gen_rows.topk(2, dim=-1).values
    min_margin = float((top2[:, 0] - top2[:, 1]).min())
    decode_diff = float((gen_logits - gen_rows).abs().max())

    return dict(greedy=greedy, logits=tf, argmax_ok=argmax_ok, min_margin=min_margin, probe=probe,
                decode_diff=decode_diff, max_abs_logit=float(tf.abs().max()))


class Probe:
    """Forward hooks: per-sublayer rms(out)/rms(residual in), and the router's selection margin."""

    def __init__(self, model, cfg):
        self.cfg, self.handles, self.ratios, self.router_margin = cfg, [], [], math.inf
        for i, layer in enumerate(model.model.layers):
            for sub in ("self_attn", "mlp", "block_sparse_moe"):
                m = getattr(layer, sub, None)
                if m is not None:
                    self.handles.append(m.register_forward_hook(self._ratio_hook(f"{i}.{sub}")))
            self.handles.append(layer.register_forward_pre_hook(self._res_hook, with_kwargs=True))
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                self.handles.append(m.register_forward_hook(self._router_hook))

    def _res_hook(self, mod, args, kwargs):
        self._h = (args[0] if args else kwargs["hidden_states"]).float()

    @staticmethod
    def _rms(t):
        return float(t.pow(2).mean().sqrt())

    def _ratio_hook(self, name):
        def f(mod, args, out):
            o = (out[0] if isinstance(out, tuple) else out).float()
            self.ratios.append((name, self._rms(o) / self._rms(self._h)))
            self._h = self._h + o  # residual seen by the next sublayer
        return f

    def _router_hook(self, mod, args, out):
        c = self.cfg
        x = args[0].reshape(-1, c["hidden_size"]).float()
        s = torch.sigmoid(x @ mod.weight.float().t())
        sel = s + mod.e_score_correction_bias.float()
        E, G, TG, K = c["num_experts"], c["num_expert_group"], c["topk_group"], c["num_experts_per_token"]
        margin = math.inf
        if G > 1:
            gs = sel.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1).sort(-1, descending=True).values
            margin = min(margin, float((gs[:, TG - 1] - gs[:, TG]).min()))
            keep = torch.zeros_like(gs, dtype=torch.bool)
            keep.scatter_(1, sel.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1).topk(TG, -1).indices, True)
            sel = sel.masked_fill(~keep.repeat_interleave(E // G, dim=1), -math.inf)
        v = sel.sort(-1, descending=True).values
        gap = v[:, K - 1] - v[:, K]
        gap = gap[torch.isfinite(gap)]
        if gap.numel():
            margin = min(margin, float(gap.min()))
        self.router_margin = min(self.router_margin, margin)

    def close(self):
        for h in self.handles:
            h.remove()


# --------------------------------------------------------------------------------------------
# Fixture construction
# --------------------------------------------------------------------------------------------


def build_checkpoint(name: str, spec: dict, out_dir: Path, tmp: Path) -> tuple[list[str], dict]:
    cfg, seed, dtype = spec["config"], spec["seed"], spec["dtype"]
    tied = bool(cfg.get("tie_word_embeddings"))
    config = KimiLinearConfig(**copy.deepcopy(cfg))

    # 1. which tensors does transformers write for this config? (names and shapes)
    torch.manual_seed(0)
    proto_dir = tmp / "proto"
    KimiLinearForCausalLM(config).save_pretrained(str(proto_dir))
    shapes = read_dir_shapes(proto_dir)

    # 2. seeded random values by on-disk name
    gen = {k: random_tensor(k, s, cfg, seed) for k, s in sorted(shapes.items())}
    if tied and "lm_head.weight" in gen:
        gen["lm_head.weight"] = gen["model.embed_tokens.weight"].clone()
    if dtype == "bfloat16":  # make every value bf16-representable: fp32 tensors on disk hold bf16 values
        gen = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in gen.items()}

    # 3. load them into HF and let save_pretrained write the real checkpoint
    src = tmp / "src"
    src.mkdir(parents=True, exist_ok=True)
    shutil.copy(proto_dir / "config.json", src / "config.json")
    save_file({k: v.contiguous() for k, v in gen.items()}, str(src / "model.safetensors"), metadata={"format": "pt"})
    tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model, info = KimiLinearForCausalLM.from_pretrained(str(src), dtype=tdtype, output_loading_info=True)
    assert not any(info.values()), f"{name}: loading the randomized weights: {info}"
    if dtype == "bfloat16":
        for pname, p in model.named_parameters():
            if pname.endswith("A_log"):  # real Kimi checkpoints store A_log in fp32
                p.data = p.data.to(torch.float32)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    kw = {"max_shard_size": spec["max_shard_size"]} if spec["max_shard_size"] else {}
    model.save_pretrained(str(out_dir), **kw)
    del model

    # 4. post-save edits (documented in the manifest)
    edits = []
    single = out_dir / "model.safetensors"
    if tied:
        def drop_lm_head(t):
            t.pop("lm_head.weight", None)
            return t
        rewrite_single_file(single, drop_lm_head)
        gen.pop("lm_head.weight", None)
        edits.append("removed lm_head.weight (transformers writes it because KimiLinearForCausalLM "
                     "declares no tied keys); logits use model.embed_tokens.weight")
    if spec["config_form"] == "moonshot":
        json.dump(moonshot_config(cfg, dtype), open(out_dir / "config.json", "w"), indent=2)
        (out_dir / "config.json").open("a").write("\n")
        edits.append("config.json rewritten to the published Moonshot field names")
        n_dense = cfg["first_k_dense_replace"]
        pat = re.compile(r"^(model\.layers\.(\d+)\.)block_sparse_moe\.((gate|up|down)_proj\.weight)$")

        def rename_dense(t):
            out = {}
            for k, v in t.items():
                m = pat.match(k)
                out[f"{m.group(1)}mlp.{m.group(3)}" if m and int(m.group(2)) < n_dense else k] = v
            return out
        rewrite_single_file(single, rename_dense)
        gen = rename_dense(gen)
        edits.append("dense-FFN layers renamed model.layers.{i}.block_sparse_moe.{gate,up,down}_proj -> "
                     "model.layers.{i}.mlp.{gate,up,down}_proj (the published Moonshot name)")

    # 5. the files must hold exactly the randomized values
    files = read_dir_tensors(out_dir)
    assert set(files) == set(gen), f"{name}: key mismatch {set(files) ^ set(gen)}"
    for k, v in files.items():
        assert torch.equal(v.to(torch.float32), gen[k]), f"{name}: {k} on disk differs from the randomized value"
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in files.values()})
    return edits, {"tensor_dtypes": dtypes, "num_tensors": len(files),
                   "files": sorted(p.name for p in out_dir.iterdir())}


def make_fixture(name: str, spec: dict, out_root: Path) -> None:
    cfg = spec["config"]
    tied = bool(cfg.get("tie_word_embeddings"))
    out_dir = out_root / name
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        edits, disk = build_checkpoint(name, spec, out_dir, tmp)

        run_dtypes = ["float32"] + (["bfloat16"] if spec["dtype"] == "bfloat16" else [])
        models = {}
        for rd in run_dtypes:
            m = load_model(out_dir, getattr(torch, rd), tied)
            check_model_matches_files(m, out_dir, tmp, tied)
            models[rd] = m
        # float64 copy (HF still runs the KDA core in fp32): measures the fp32 oracle's own rounding noise
        m64 = load_model(out_dir, torch.float64, tied)

    cases, sanity = [], []
    for ci, P in enumerate(PROMPT_LENGTHS):
        rejected = {}
        for attempt in range(MAX_ATTEMPTS):
            rng = np.random.default_rng([spec["seed"], 7, ci, attempt])
            prompt = rng.integers(VOCAB_LO, cfg["vocab_size"], size=P).tolist()
            res, why = {}, None
            for rd, m in models.items():
                r = res[rd] = run_case(m, prompt, MAX_NEW_TOKENS, cfg)
                if not r["argmax_ok"]:
                    why = f"{rd}: generate != teacher-forced argmax"
                elif r["min_margin"] < MIN_MARGIN[rd]:
                    why = f"{rd}: logit margin"
                elif rd == "float32" and r["probe"].router_margin < MIN_ROUTER_MARGIN_FP32:
                    why = f"{rd}: router margin"
                elif rd == "bfloat16" and r["greedy"] != res["float32"]["greedy"]:
                    why = "bfloat16 greedy ids != float32 greedy ids"
                if why:
                    break
            if why is None:
                break
            rejected[why] = rejected.get(why, 0) + 1
        else:
            raise RuntimeError(f"{name}: no prompt of length {P} met the margins after {MAX_ATTEMPTS} draws")
        runs = {}
        for rd, r in res.items():
            fn = f"len{P}.{rd}.npy"
            arr = np.ascontiguousarray(r["logits"].numpy().astype("<f4"))
            assert arr.shape == (P + MAX_NEW_TOKENS - 1, cfg["vocab_size"])
            np.save(out_dir / fn, arr)
            with torch.no_grad():
                tf64 = m64(input_ids=torch.tensor([prompt + r["greedy"][:-1]]), use_cache=False).logits[0]
            r["step_diff"] = stepwise_diff(models[rd], torch.tensor([prompt + r["greedy"][:-1]]), r["logits"])
            r["fp64_diff"] = float((r["logits"].double() - tf64.double()).abs().max())
            runs[rd] = {"greedy_ids": r["greedy"], "logits": fn, "min_margin": r["min_margin"],
                        "max_abs_logit": r["max_abs_logit"],
                        "min_router_selection_margin": r["probe"].router_margin,
                        "generate_vs_teacher_forced_max_abs_diff": r["decode_diff"],
                        "stepwise_recurrent_vs_teacher_forced_max_abs_diff": r["step_diff"],
                        "vs_float64_model_max_abs_diff": r["fp64_diff"]}
            sanity.append((P, rd, r, r["probe"]))
        cases.append({"name": f"len{P}", "prompt_ids": prompt, "prompt_attempt": attempt,
                      "rejected_draws": rejected, "runs": runs})

    manifest = {
        "fixture": name,
        "weights_dtype": spec["dtype"],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "config_form": spec["config_form"],
        "covers": spec["covers"],
        "seed": spec["seed"],
        "disk_edits_after_save_pretrained": edits,
        "disk": disk,
        "oracle": {
            "device": "cpu", "attn_implementation": ATTN_IMPL,
            "kda_path": "HF pure-PyTorch: chunked (chunk 64) for every prefill / teacher-forced forward, "
                        "recurrent for single-token decode with a cache",
            "max_new_tokens": MAX_NEW_TOKENS, "eos_ignored": True,
            "logits_rows": "row i = logits after consuming token i of prompt ++ greedy_ids[:-1] "
                           "(one teacher-forced forward, no cache)",
            "min_margin_required": MIN_MARGIN,
            "min_router_selection_margin_required_float32": MIN_ROUTER_MARGIN_FP32,
            "bfloat16_runs_require_same_greedy_ids_as_float32": True,
        },
        "cases": cases,
    }
    with open(out_dir / "oracle.json", "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")

    print(f"== {name}  ({spec['dtype']}, config_form={spec['config_form']}, files={disk['files']})")
    for P, rd, r, probe in sanity:
        worst = min(probe.ratios, key=lambda x: x[1])
        print(f"   len{P:<3d} {rd:8s} max|logit|={r['max_abs_logit']:.3f} min_margin={r['min_margin']:.4f} "
              f"generate-vs-TF={r['decode_diff']:.2e} stepwise(recurrent)-vs-TF(chunked)={r['step_diff']:.2e} "
              f"vs-fp64={r['fp64_diff']:.1e} router_margin={probe.router_margin:.3g} min sublayer/residual rms={worst[1]:.2f} ({worst[0]})")
        tol = 5e-4 if rd == "float32" else 0.25
        assert r["decode_diff"] < tol and r["step_diff"] < tol, f"{name}: chunked vs recurrent disagree"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/data", help="output root (default tests/data)")
    ap.add_argument("--only", choices=sorted(FIXTURES), help="build only this fixture")
    ap.add_argument("--threads", type=int, default=4, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}")
    for name, spec in FIXTURES.items():
        if args.only and name != args.only:
            continue
        make_fixture(name, spec, out_root)
    total = sum(p.stat().st_size for p in out_root.rglob("*") if p.is_file())
    print(f"total size of {out_root}: {total / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
