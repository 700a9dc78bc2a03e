#!/usr/bin/env python3
"""PyTorch reference for the Kimi K3 text model (spec/MODEL.md §4 + §7), fp32 (default) or fp64.
(Over 500 lines: the whole model in one file, so it can be read against spec/MODEL.md top to bottom.)

Self-contained: needs torch (and safetensors to read a checkpoint). transformers is NOT needed; the
KDA core is written here from MODEL.md K6 (recurrent) and §6 (chunked). It is the same math as
transformers' ``recurrent_kimi_delta_attention`` / ``chunk_kimi_delta_attention`` (check_k3_reference.py
compares them when transformers is importable), but those upcast to fp32 internally, so they cannot
serve the float64 mode, and their names have moved between transformers versions.

Every quantity is computed in ONE dtype (float32 or float64): this is the "reference mode" of §1
(weights upcast, no bf16 rounding points). The MXFP4 expert weights are dequantized exactly (§7.7).

Public API
    cfg, weights = load_checkpoint(dir)             # K3 layout: config.json + *.safetensors
    model = K3Reference(cfg, weights, dtype=torch.float32, traps=Traps())
    logits = model.forward(ids)                     # full teacher-forced forward, chunked KDA, [T, V]
    cache = model.new_cache(); model.forward(ids, cache)   # prefill / continue / decode with caches
    ids, step_logits = model.generate_greedy(prompt, n)    # cached path (prefill + 1-token decode steps)
    mxfp4_decode(packed, scales), mxfp4_pack(codes)

Trap flags (``Traps``) are deliberately WRONG variants, used only by check_k3_reference.py to show that
the oracle tolerance catches each of them.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

KDA_CHUNK = 64
TEXT_PREFIX = "language_model."

# ---------------------------------------------------------------------------------------------
# MXFP4 (MODEL.md §7.7)
# ---------------------------------------------------------------------------------------------

# E2M1 code -> value. Codes 0x0-0x7 positive, 0x8-0xF the same magnitudes negated (0x8 = -0.0).
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# E8M0 byte -> 2^(e-127), exact (math.ldexp); 0xFF -> NaN.
E8M0_VALUES = [math.ldexp(1.0, e - 127) for e in range(255)] + [float("nan")]
MX_BLOCK = 32


def mxfp4_decode(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """compressed-tensors mxfp4-pack-quantized -> float.

    packed uint8 [out, in/2]: byte j of a row holds column 2j in its LOW nibble, 2j+1 in its HIGH nibble.
    scales uint8 [out, in/32]: E8M0, scale g covers columns 32g..32g+31; 0xFF makes the block NaN.
    Computed in float64 (exact), then cast once to ``dtype`` (exact unless the value is outside the
    dtype's range, e.g. 6*2^127 -> inf in float32).
    """
    assert packed.dtype == torch.uint8 and scales.dtype == torch.uint8, (packed.dtype, scales.dtype)
    out, half = packed.shape
    n_in = 2 * half
    assert n_in % MX_BLOCK == 0 and tuple(scales.shape) == (out, n_in // MX_BLOCK), (packed.shape, scales.shape)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    slut = torch.tensor(E8M0_VALUES, dtype=torch.float64)
    p = packed.to(torch.int64)
    codes = torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(out, n_in)  # even element = low nibble
    vals = lut[codes].view(out, n_in // MX_BLOCK, MX_BLOCK) * slut[scales.to(torch.int64)].unsqueeze(-1)
    return vals.reshape(out, n_in).to(dtype)


def mxfp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] (values 0..15) -> packed uint8 [out, in/2] (low nibble = even column)."""
    c = codes.to(torch.uint8)
    assert int(c.max()) < 16 and c.shape[-1] % 2 == 0
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


# ---------------------------------------------------------------------------------------------
# Config (MODEL.md §2, §3, §7.1)
# ---------------------------------------------------------------------------------------------

_ALIASES = {  # alias -> real key
    "moe_latent_size": "routed_expert_hidden_size",
    "mla_output_gate": "mla_use_output_gate",
}


@dataclasses.dataclass
class K3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_token: int
    num_shared_experts: int
    moe_router_activation_func: str
    moe_renormalize: bool
    routed_scaling_factor: float
    use_grouped_topk: bool
    num_expert_group: int
    topk_group: int
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    hidden_act: str
    activation_situ_beta: float | None
    activation_situ_linear_beta: float | None
    mla_use_output_gate: bool
    routed_expert_hidden_size: int | None
    latent_moe_use_norm: bool
    attn_res_block_size: int | None
    kda_num_heads: int
    kda_head_dim: int
    conv_kernel: int
    kda_layers: list
    full_attn_layers: list
    gate_lower_bound: float | None
    use_full_rank_gate: bool
    tie_word_embeddings: bool
    eos_token_id: int | None
    k3_layout: bool  # config root was model_type kimi_k3 with text_config -> tensors prefixed language_model.

    @staticmethod
    def from_dict(root: dict) -> "K3Config":
        k3 = "text_config" in root
        t = dict(root["text_config"] if k3 else root)
        for a, real in _ALIASES.items():
            if a in t and real not in t:
                t[real] = t[a]
        lac = t["linear_attn_config"]
        L = t["num_hidden_layers"]
        kda, full = list(lac["kda_layers"]), list(lac["full_attn_layers"])
        if set(kda) & set(full) or sorted(kda + full) != list(range(1, L + 1)):
            raise ValueError(f"kda_layers {kda} / full_attn_layers {full} must partition 1..{L} (1-based)")
        return K3Config(
            vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
            moe_intermediate_size=t["moe_intermediate_size"], num_hidden_layers=L,
            num_attention_heads=t["num_attention_heads"], q_lora_rank=t.get("q_lora_rank"),
            kv_lora_rank=t["kv_lora_rank"], qk_nope_head_dim=t["qk_nope_head_dim"],
            qk_rope_head_dim=t["qk_rope_head_dim"], v_head_dim=t["v_head_dim"],
            num_experts=t["num_experts"], num_experts_per_token=t["num_experts_per_token"],
            num_shared_experts=t["num_shared_experts"],
            moe_router_activation_func=t.get("moe_router_activation_func", "sigmoid"),
            moe_renormalize=bool(t.get("moe_renormalize", True)),
            routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
            use_grouped_topk=bool(t.get("use_grouped_topk", True)),
            num_expert_group=t.get("num_expert_group", 1) or 1, topk_group=t.get("topk_group", 1) or 1,
            first_k_dense_replace=t.get("first_k_dense_replace", 0), moe_layer_freq=t.get("moe_layer_freq", 1),
            rms_norm_eps=float(t["rms_norm_eps"]), hidden_act=t["hidden_act"],
            activation_situ_beta=t.get("activation_situ_beta"),
            activation_situ_linear_beta=t.get("activation_situ_linear_beta"),
            mla_use_output_gate=bool(t.get("mla_use_output_gate", False)),
            routed_expert_hidden_size=t.get("routed_expert_hidden_size"),
            latent_moe_use_norm=bool(t.get("latent_moe_use_norm", False)),
            attn_res_block_size=t.get("attn_res_block_size"),
            kda_num_heads=lac["num_heads"], kda_head_dim=lac["head_dim"],
            conv_kernel=lac.get("short_conv_kernel_size", 4), kda_layers=kda, full_attn_layers=full,
            gate_lower_bound=lac.get("gate_lower_bound"), use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)), eos_token_id=t.get("eos_token_id"),
            k3_layout=k3,
        )

    def is_mla(self, i: int, zero_based_trap: bool = False) -> bool:
        if zero_based_trap:  # WRONG on purpose: lists read as 0-based; anything not "full" is KDA
            return i in self.full_attn_layers
        return (i + 1) in self.full_attn_layers  # lists are 1-based (§3)

    def is_moe(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0


# ---------------------------------------------------------------------------------------------
# Checkpoint loading
# ---------------------------------------------------------------------------------------------


def load_checkpoint(path: str | Path) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """Read config.json + *.safetensors. Returns text weights WITHOUT the ``language_model.`` prefix
    (``model.layers.{i}...``, ``lm_head.weight``); MXFP4 ``X.weight_packed`` + ``X.weight_scale`` pairs
    are returned dequantized (float64, exact) as ``X.weight``. Non-text tensors are ignored."""
    from safetensors import safe_open

    path = Path(path)
    root = json.loads((path / "config.json").read_text())
    cfg = K3Config.from_dict(root)
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if cfg.k3_layout:
                    if not k.startswith(TEXT_PREFIX):
                        continue  # vision tower / projector: not part of the text model
                    name = k[len(TEXT_PREFIX):]
                else:
                    name = k
                raw[name] = h.get_tensor(k)
    weights: dict[str, torch.Tensor] = {}
    for k, v in raw.items():
        if k.endswith(".weight_scale"):
            continue
        if k.endswith(".weight_packed"):
            base = k[: -len("_packed")]
            weights[base] = mxfp4_decode(v, raw[base + "_scale"], torch.float64)
        else:
            weights[k] = v
    return cfg, weights


# ---------------------------------------------------------------------------------------------
# KDA core (MODEL.md K6 and §6). q, k already l2-normalised, q already scaled by 1/sqrt(d).
# Shapes: q, k, g [T, n, dk]; v [T, n, dv]; beta [T, n]; state [n, dk, dv] (row = key channel).
# ---------------------------------------------------------------------------------------------


def kda_recurrent(q, k, v, g, beta, state=None):
    T, n, dk = k.shape
    dv = v.shape[-1]
    S = torch.zeros(n, dk, dv, dtype=v.dtype) if state is None else state.clone()
    out = torch.empty(T, n, dv, dtype=v.dtype)
    for t in range(T):
        S = S * torch.exp(g[t]).unsqueeze(-1)                      # decay each key row j by exp(g_t[j])
        e = v[t] - torch.einsum("njv,nj->nv", S, k[t])             # error against the DECAYED state
        S = S + k[t].unsqueeze(-1) * (beta[t].unsqueeze(-1) * e).unsqueeze(-2)
        out[t] = torch.einsum("njv,nj->nv", S, q[t])               # read the UPDATED state
    return out, S


def kda_chunked(q, k, v, g, beta, state=None, chunk: int = KDA_CHUNK):
    """§6 chunked form. The last chunk is processed at its true length (identical to zero-padding with
    q=k=v=0, beta=0, g=0). D_rj = exp(gamma_r - gamma_j) is computed from the pairwise difference."""
    T, n, dk = k.shape
    dv = v.shape[-1]
    S = torch.zeros(n, dk, dv, dtype=v.dtype) if state is None else state.clone()
    out = torch.empty(T, n, dv, dtype=v.dtype)
    for s0 in range(0, T, chunk):
        s1 = min(T, s0 + chunk)
        L = s1 - s0
        qc, kc, vc, gc = (x[s0:s1].transpose(0, 1) for x in (q, k, v, g))  # [n, L, d]
        bc = beta[s0:s1].transpose(0, 1)                                 # [n, L]
        gam = torch.cumsum(gc, dim=1)                                    # [n, L, dk], <= 0
        le = torch.tril(torch.ones(L, L, dtype=torch.bool))              # j <= r
        lt = torch.tril(torch.ones(L, L, dtype=torch.bool), diagonal=-1)  # j < r
        diff = gam.unsqueeze(2) - gam.unsqueeze(1)                       # [n, r, j, dk] = gamma_r - gamma_j
        D = torch.exp(diff.masked_fill(~le[None, :, :, None], float("-inf")))
        A = bc.unsqueeze(-1) * torch.einsum("nrc,njc,nrjc->nrj", kc, kc, D) * lt
        M = torch.einsum("nrc,njc,nrjc->nrj", qc, kc, D)
        eg = torch.exp(gam)
        rhs = bc.unsqueeze(-1) * vc - bc.unsqueeze(-1) * ((kc * eg) @ S)  # diag(b)V - diag(b)(K*e^g)S0
        I_A = A + torch.eye(L, dtype=A.dtype)
        U = torch.linalg.solve_triangular(I_A, rhs, upper=False, unitriangular=True)
        out[s0:s1] = ((qc * eg) @ S + M @ U).transpose(0, 1)
        S = torch.exp(gam[:, -1]).unsqueeze(-1) * S + (kc * torch.exp(gam[:, -1:] - gam)).transpose(1, 2) @ U
    return out, S


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def l2n(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def situ(a, b, beta, beta_lin):
    y = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    return y * (b if beta_lin is None else beta_lin * torch.tanh(b / beta_lin))


@dataclasses.dataclass
class Traps:
    """Deliberately wrong variants (all off = the reference). Used only by the self-checks."""
    silu_instead_of_situ: bool = False          # SiLU(a)*b in every FFN instead of SiTU
    drop_final_attnres: bool = False            # final norm reads the last partial block P, no output AR
    zero_based_layer_lists: bool = False        # layer i is MLA iff i (not i+1) is in full_attn_layers
    latent_norm_after_up_proj: bool = False     # RMSNorm after routed_expert_up_proj (over H, unit weight)
    mla_gate_per_head_scalar: bool = False      # one sigmoid per head (g_proj rows 0..n_h-1), not elementwise
    kda_gate_unbounded: bool = False            # base gate -exp(A_log)*softplus(f+dt_bias) despite lb
    duplicate_embedding_in_attnres: bool = False  # README variant: block list pre-seeded with e
    # extra (informational) traps
    mla_norm_eps_rms: bool = False              # q_a/kv_a_layernorm with rms_norm_eps instead of 1e-6
    router_weights_biased: bool = False         # weights from s + bias instead of unbiased s
    kda_gated_norm_silu: bool = False           # SiLU instead of sigmoid in the KDA gated norm
    attnres_scaled_by_sqrt_h: bool = False      # AttnRes logits divided by sqrt(H)
    attnres_unnormalized_keys: bool = False     # AttnRes keys = w_n * V (no RMS normalisation)

    @staticmethod
    def names():
        return [f.name for f in dataclasses.fields(Traps)]


class K3Cache:
    """Per-sequence decode state. KDA: conv window (last K_c-1 PRE-conv q/k/v inputs) + state S
    [n, dk, dv]. MLA: post-norm latent c [t, r_kv] and raw shared key k_r [t, d_r]. AttnRes: none."""

    def __init__(self, n_layers: int):
        self.layers = [dict() for _ in range(n_layers)]
        self.seq_len = 0


class K3Reference:
    def __init__(self, cfg: K3Config, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 traps: Traps | None = None):
        self.cfg, self.dtype, self.traps = cfg, dtype, traps or Traps()
        self.w = {k: v.to(dtype) for k, v in weights.items() if v.is_floating_point()}
        self.last_router = []  # per MoE layer call: (layer, sorted selection scores) for margin probes
        self.record_router = False

    # -- helpers ----------------------------------------------------------------------------
    def W(self, name):
        return self.w[name]

    def lin(self, x, name):
        return x @ self.w[name].t()

    def new_cache(self) -> K3Cache:
        return K3Cache(self.cfg.num_hidden_layers)

    def act(self, a, b):
        c = self.cfg
        if self.traps.silu_instead_of_situ or c.hidden_act == "silu":
            return F.silu(a) * b
        assert c.hidden_act == "situ", c.hidden_act
        return situ(a, b, c.activation_situ_beta, c.activation_situ_linear_beta)

    # -- AttnRes (§7.2) ----------------------------------------------------------------------
    def attn_res(self, values, prefix):
        tr = self.traps
        V = torch.stack(values)                                             # [N, T, H]
        if tr.attnres_unnormalized_keys:
            K = V * self.W(prefix + "_norm.weight")
        else:
            K = rms_norm(V, self.W(prefix + "_norm.weight"), self.cfg.rms_norm_eps)
        s = torch.einsum("nth,h->nt", K, self.W(prefix + "_proj.weight").reshape(-1))
        if tr.attnres_scaled_by_sqrt_h:
            s = s / math.sqrt(V.shape[-1])
        a = torch.softmax(s, dim=0)
        return torch.einsum("nt,nth->th", a, V)

    # -- KDA (§4.2 + §7.5) -------------------------------------------------------------------
    def kda(self, i, x, lc, mode):
        c, tr = self.cfg, self.traps
        p = f"model.layers.{i}.self_attn."
        T = x.shape[0]
        n, d, K = c.kda_num_heads, c.kda_head_dim, c.conv_kernel
        P = n * d
        conv_out, new_conv = {}, {}
        for nm in ("q", "k", "v"):
            z = self.lin(x, p + f"{nm}_proj.weight")                       # [T, P] pre-conv
            prev = lc.get(f"conv_{nm}") if lc is not None else None
            if prev is None:
                prev = torch.zeros(K - 1, P, dtype=self.dtype)
            win = torch.cat([prev, z], 0)                                   # [K-1+T, P]
            wc = self.W(p + f"{nm}_conv1d.weight").reshape(P, K)
            y = (win.unfold(0, K, 1) * wc).sum(-1)                          # [T, P]: sum_j C[c,j] z[t-K+1+j]
            conv_out[nm] = F.silu(y)
            new_conv[f"conv_{nm}"] = win[-(K - 1):].clone()
        f = self.lin(self.lin(x, p + "f_a_proj.weight"), p + "f_b_proj.weight")
        fb = (f + self.W(p + "dt_bias").reshape(P)).view(T, n, d)
        A = torch.exp(self.W(p + "A_log").reshape(n, 1))                   # per head, broadcast over d
        if c.gate_lower_bound is not None and not tr.kda_gate_unbounded:
            g = c.gate_lower_bound * torch.sigmoid(A * fb)
        else:
            g = -A * F.softplus(fb, beta=1.0, threshold=20.0)
        beta = torch.sigmoid(self.lin(x, p + "b_proj.weight"))            # [T, n]
        q = l2n(conv_out["q"].view(T, n, d)) / math.sqrt(d)
        k = l2n(conv_out["k"].view(T, n, d))
        v = conv_out["v"].view(T, n, d)
        S0 = lc.get("state") if lc is not None else None
        use_rec = mode == "recurrent" or (mode == "auto" and T == 1 and S0 is not None)
        o, S = (kda_recurrent if use_rec else kda_chunked)(q, k, v, g, beta, S0)
        if lc is not None:
            lc.update(new_conv)
            lc["state"] = S
        if c.use_full_rank_gate:
            zg = self.lin(x, p + "g_proj.weight")
        else:
            zg = self.lin(self.lin(x, p + "g_a_proj.weight"), p + "g_b_proj.weight")
        gate = (F.silu if tr.kda_gated_norm_silu else torch.sigmoid)(zg.view(T, n, d))
        y = rms_norm(o, self.W(p + "o_norm.weight"), c.rms_norm_eps) * gate
        return self.lin(y.reshape(T, P), p + "o_proj.weight")

    # -- gated MLA, NoPE (§4.3 + §7.4) ------------------------------------------------------
    def mla(self, i, x, lc):
        c, tr = self.cfg, self.traps
        p = f"model.layers.{i}.self_attn."
        T = x.shape[0]
        nh, dn, dr, dv, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        eps_small = c.rms_norm_eps if tr.mla_norm_eps_rms else 1e-6
        if c.q_lora_rank is None:
            q = self.lin(x, p + "q_proj.weight")
        else:
            qa = rms_norm(self.lin(x, p + "q_a_proj.weight"), self.W(p + "q_a_layernorm.weight"), eps_small)
            q = self.lin(qa, p + "q_b_proj.weight")
        q = q.view(T, nh, dn + dr)
        ckv = self.lin(x, p + "kv_a_proj_with_mqa.weight")
        lat = rms_norm(ckv[:, :r], self.W(p + "kv_a_layernorm.weight"), eps_small)
        kr = ckv[:, r:]                                                     # raw, never rotated
        past = 0
        if lc is not None:
            if "c" in lc:
                past = lc["c"].shape[0]
                lat = torch.cat([lc["c"], lat], 0)
                kr = torch.cat([lc["kr"], kr], 0)
            lc["c"], lc["kr"] = lat, kr
        Tk = lat.shape[0]
        kv = self.lin(lat, p + "kv_b_proj.weight").view(Tk, nh, dn + dv)
        k = torch.cat([kv[..., :dn], kr.unsqueeze(1).expand(Tk, nh, dr)], -1)
        v = kv[..., dn:]
        s = torch.einsum("thd,shd->hts", q, k) * (dn + dr) ** -0.5
        allowed = torch.arange(Tk).unsqueeze(0) <= (past + torch.arange(T)).unsqueeze(1)  # [T, Tk]
        s = s.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("hts,shd->thd", torch.softmax(s, -1), v).reshape(T, nh * dv)
        if c.mla_use_output_gate:
            if tr.mla_gate_per_head_scalar:
                G = torch.sigmoid(x @ self.W(p + "g_proj.weight")[:nh].t()).repeat_interleave(dv, dim=1)
            else:
                G = torch.sigmoid(self.lin(x, p + "g_proj.weight"))        # elementwise [T, nh*dv]
            o = o * G
        return self.lin(o, p + "o_proj.weight")

    # -- FFNs (§4.4, §4.5, §7.3, §7.6) -------------------------------------------------------
    def dense(self, x, p):
        return self.lin(self.act(self.lin(x, p + "gate_proj.weight"), self.lin(x, p + "up_proj.weight")),
                        p + "down_proj.weight")

    def route(self, i, x):
        c, tr = self.cfg, self.traps
        p = f"model.layers.{i}.block_sparse_moe.gate."
        logits = self.lin(x, p + "weight")
        s = torch.sigmoid(logits) if c.moe_router_activation_func == "sigmoid" else torch.softmax(logits, -1)
        sel = s + self.W(p + "e_score_correction_bias")
        E, G, TG, Kk = c.num_experts, c.num_expert_group, c.topk_group, c.num_experts_per_token
        if c.use_grouped_topk and G > 1:
            gs = sel.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)    # [T, G]
            order = torch.sort(gs, dim=-1, descending=True, stable=True).indices[:, :TG]
            keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, order, True)
            sel = sel.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        srt = torch.sort(sel, dim=-1, descending=True, stable=True)         # ties: lower index first
        idx = srt.indices[:, :Kk]
        if self.record_router:
            self.last_router.append((i, srt.values))
        w = (sel if tr.router_weights_biased else s).gather(1, idx)        # weights from UNBIASED s
        if c.moe_renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * c.routed_scaling_factor, idx

    def moe(self, i, x):
        c, tr = self.cfg, self.traps
        p = f"model.layers.{i}.block_sparse_moe."
        w, idx = self.route(i, x)
        latent = c.routed_expert_hidden_size is not None
        z = self.lin(x, p + "routed_expert_down_proj.weight") if latent else x
        y = torch.zeros_like(z)
        for e in range(c.num_experts):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            ze = z[tok]
            pe = p + f"experts.{e}."
            h = self.act(self.lin(ze, pe + "w1.weight"), self.lin(ze, pe + "w3.weight"))  # w1 gate, w3 up
            y.index_add_(0, tok, self.lin(h, pe + "w2.weight") * w[tok, slot].unsqueeze(-1))
        if latent:
            if c.latent_moe_use_norm and not tr.latent_norm_after_up_proj:
                y = rms_norm(y, self.W(p + "routed_expert_norm.weight"), c.rms_norm_eps)
            y = self.lin(y, p + "routed_expert_up_proj.weight")
            if c.latent_moe_use_norm and tr.latent_norm_after_up_proj:
                y = rms_norm(y, 1.0, c.rms_norm_eps)
        if c.num_shared_experts:
            y = y + self.dense(x, p + "shared_experts.")
        return y

    def ffn(self, i, x):
        if self.cfg.is_moe(i):
            return self.moe(i, x)
        return self.dense(x, f"model.layers.{i}.mlp.")

    # -- model (§7.2 procedure) -------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids, cache: K3Cache | None = None, kda_mode: str = "auto") -> torch.Tensor:
        """ids: list/1-D tensor of T tokens. Returns logits [T, V] (dtype of the model).
        kda_mode: "auto" (chunked, except a 1-token step with an existing state -> recurrent, like HF),
        "chunked" or "recurrent"."""
        c, tr = self.cfg, self.traps
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        e = self.W("model.embed_tokens.weight")[ids]
        S = c.attn_res_block_size
        B = [e] if tr.duplicate_embedding_in_attnres else []
        P = e
        for i in range(c.num_hidden_layers):
            pre = f"model.layers.{i}."
            lc = cache.layers[i] if cache is not None else None
            start = (i % S == 0)
            u = self.attn_res(B + [P], pre + "self_attention_res")
            if start:
                B.append(P)
                P = None
            xn = rms_norm(u, self.W(pre + "input_layernorm.weight"), c.rms_norm_eps)
            if c.is_mla(i, tr.zero_based_layer_lists):
                a = self.mla(i, xn, lc)
            else:
                a = self.kda(i, xn, lc, kda_mode)
            P = a if P is None else P + a
            u = self.attn_res(B + [P], pre + "mlp_res")
            m = self.ffn(i, rms_norm(u, self.W(pre + "post_attention_layernorm.weight"), c.rms_norm_eps))
            P = P + m
        u = P if tr.drop_final_attnres else self.attn_res(B + [P], "model.output_attn_res")
        h = rms_norm(u, self.W("model.norm.weight"), c.rms_norm_eps)
        head = self.W("model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight")
        if cache is not None:
            cache.seq_len += ids.numel()
        return h @ head.t()

    @torch.no_grad()
    def generate_greedy(self, prompt, n_new: int):
        """Greedy decode through the caches (prompt prefill, then one token per step; eos ignored).
        Returns (ids, logits [n_new, V] that produced them)."""
        cache = self.new_cache()
        logits = self.forward(prompt, cache)[-1]
        out, rows = [], []
        for step in range(n_new):
            rows.append(logits)
            tok = int(torch.argmax(logits))
            out.append(tok)
            if step + 1 < n_new:
                logits = self.forward([tok], cache)[-1]
        return out, torch.stack(rows)
