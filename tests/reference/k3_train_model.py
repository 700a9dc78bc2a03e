"""Batched, differentiable K3 forward for training (train_k3.py): the math of k3_reference.py (MODEL.md
§4 + §7) over [B, T] token batches on any device, with parameters named exactly like the checkpoint's
text tensors (without the ``language_model.`` prefix), so export is a rename-free copy.

Where it differs from the reference, only in evaluation order, never in math:
* KDA core: §6 chunks of 64 run in parallel over batch, heads and chunks; only the state hand-off
  between chunks is a loop. The pairwise decay exp(γ_r − γ_j) is never formed as a [C, C, d] tensor:
  it is factored as exp(γ_r − ρ)·exp(ρ − γ_j) with a reference point ρ = γ at the end of the column's
  16-position sub-block (both factors ≤ 1 off the diagonal sub-blocks) or at the middle of the
  diagonal sub-block (factors ≤ e^{8·5} with the K3 gate bound −5), so nothing overflows in fp32.
* MoE: routed experts run as one padded batched matmul over experts; routing is the reference's.
* bf16 autocast for the linear layers when training on a GPU; the KDA core, router, norms and AttnRes
  run in fp32. check_against_reference() in train_k3.py holds the fp32 forward to k3_reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from k3_reference import E2M1_VALUES, E8M0_VALUES, MX_BLOCK, K3Config

KDA_CHUNK = 64
KDA_SUB = 16

# -- MXFP4 (MODEL.md §7.7) ------------------------------------------------------------------------------

_E2M1_MAG = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MID = (_E2M1_MAG[1:] + _E2M1_MAG[:-1]) / 2


def mxfp4_quantize(w: torch.Tensor):
    """w [out, in] float -> (codes uint8 [out, in] 0..15, scale bytes uint8 [out, in/32]).
    Scale 2^e per block of 32 inputs with e = ceil(log2(amax / 6)), so no element clips; each element
    rounds to the nearest E2M1 magnitude (sign in bit 3)."""
    out, n_in = w.shape
    assert n_in % MX_BLOCK == 0, w.shape
    wb = w.detach().float().reshape(out, n_in // MX_BLOCK, MX_BLOCK)
    amax = wb.abs().amax(-1)
    e = torch.ceil(torch.log2(amax.clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    e = torch.where(amax > 0, e, torch.full_like(e, -127.0))
    scaled = wb / torch.exp2(e).unsqueeze(-1)
    mag = torch.bucketize(scaled.abs(), _E2M1_MID.to(w.device))              # 0..7
    codes = (mag | ((scaled < 0).to(torch.long) << 3)).to(torch.uint8).reshape(out, n_in)
    return codes, (e + 127).to(torch.uint8)


def mxfp4_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Exact: both factors come from tables of exact values, and their product is a power-of-two scaling."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    slut = torch.tensor(E8M0_VALUES, dtype=torch.float32, device=codes.device)
    out, n_in = codes.shape
    s = slut[scales.long()]
    return (lut[codes.long()].view(out, n_in // MX_BLOCK, MX_BLOCK) * s.unsqueeze(-1)).view(out, n_in)


def fake_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize with a straight-through gradient (for quantization-aware training)."""
    flat = w.reshape(-1, w.shape[-1])
    q = mxfp4_dequantize(*mxfp4_quantize(flat)).view_as(w).to(w.dtype)
    return w + (q - w).detach()


# -- building blocks -------------------------------------------------------------------------------------


def up(x):
    """fp32 for half-precision tensors; fp32/fp64 unchanged (fp64 runs the math exactly, for the checks)."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def rms_norm(x, w, eps):
    x = up(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * up(w)


def l2n(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def situ(a, b, beta, beta_lin):
    a, b = up(a), up(b)
    y = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    return y * (b if beta_lin is None else beta_lin * torch.tanh(b / beta_lin))


def _decay_scores(a, b, gam, sub: int):
    """X[..., r, j] = Σ_c a_r[c]·b_j[c]·exp(γ_r[c] − γ_j[c]) for j ≤ r, 0 above the diagonal.
    a, b, gam: [..., C, d] with γ non-increasing along C. Factored per 16-sub-block (module doc)."""
    *lead, C, d = a.shape
    nb = C // sub
    gb = gam.reshape(*lead, nb, sub, d)
    # off-diagonal sub-blocks: rows r (any block) against columns j of block J, reference γ_end(J)
    ref = gb[..., -1, :]                                                          # [..., nb, d]
    ra = a.unsqueeze(-3) * torch.exp((gam.unsqueeze(-3) - ref.unsqueeze(-2)).clamp(max=0.0))  # [..., J, C, d]
    cb = b.reshape(*lead, nb, sub, d) * torch.exp(ref.unsqueeze(-2) - gb)          # [..., J, sub, d], ≤ 1
    off = (ra @ cb.transpose(-1, -2)).movedim(-3, -2).reshape(*lead, C, C)         # [..., r, (J, j)]
    # diagonal sub-blocks: reference at the block's middle, |exponents| ≤ (sub/2)·|γ step|
    mid = gb[..., sub // 2, :].unsqueeze(-2)                                       # [..., nb, 1, d]
    ad = a.reshape(*lead, nb, sub, d) * torch.exp(gb - mid)
    bd = b.reshape(*lead, nb, sub, d) * torch.exp(mid - gb)
    diag = ad @ bd.transpose(-1, -2)                                               # [..., nb, sub, sub]
    eye_nb = torch.eye(nb, device=a.device, dtype=diag.dtype).view(nb, 1, nb, 1)
    dense_diag = (diag.unsqueeze(-2) * eye_nb).reshape(*lead, C, C)               # block-diagonal
    blk = torch.arange(C, device=a.device) // sub
    same = blk.unsqueeze(1) == blk.unsqueeze(0)
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=a.device))
    x = torch.where(same, dense_diag, off)
    return torch.where(lower, x, torch.zeros((), device=a.device, dtype=x.dtype))


def kda_chunked_batched(q, k, v, g, beta, chunk: int = KDA_CHUNK, sub: int = KDA_SUB):
    """q, k, g [B, T, n, dk] (q, k l2-normed, q/√d), v [B, T, n, dv], beta [B, T, n]; fp32. Zero initial
    state. Returns o [B, T, n, dv]. T is zero-padded to a multiple of `chunk` (g = 0, β = 0: no decay,
    no update, outputs discarded)."""
    B, T, n, dk = k.shape
    dv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    Nc = (T + pad) // chunk

    def chunks(x):  # [B, T', n, d] -> [B, n, Nc, C, d]
        return x.reshape(B, Nc, chunk, n, x.shape[-1]).permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc = chunks(q), chunks(k), chunks(v), chunks(g)
    bc = beta.reshape(B, Nc, chunk, n).permute(0, 3, 1, 2).unsqueeze(-1)          # [B, n, Nc, C, 1]
    gam = torch.cumsum(gc, dim=-2)
    strict = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device), diagonal=-1)
    A = bc * _decay_scores(kc, kc, gam, sub) * strict                              # β_r k_r·k_j D_rj, j < r
    M = _decay_scores(qc, kc, gam, sub)                                            # q_r·k_j D_rj, j ≤ r
    eye = torch.eye(chunk, device=q.device, dtype=q.dtype)
    eg = torch.exp(gam)
    rhs = torch.cat([bc * vc, bc * kc * eg], dim=-1)                              # [.., C, dv + dk]
    sol = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    Uv, W = sol[..., :dv], sol[..., dv:]                                           # T·βV, T·β(K⊙e^γ)
    Qg = qc * eg
    Kd = kc * torch.exp(gam[..., -1:, :] - gam)                                    # k_j ⊙ e^{γ_C − γ_j}
    dC = torch.exp(gam[..., -1, :]).unsqueeze(-1)                                  # [B, n, Nc, dk, 1]
    S = torch.zeros(B, n, dk, dv, device=q.device, dtype=q.dtype)
    outs = []
    for c in range(Nc):
        U = Uv[:, :, c] - W[:, :, c] @ S
        outs.append(Qg[:, :, c] @ S + M[:, :, c] @ U)
        S = dC[:, :, c] * S + Kd[:, :, c].transpose(-1, -2) @ U
    o = torch.stack(outs, dim=2)                                                   # [B, n, Nc, C, dv]
    return o.permute(0, 2, 3, 1, 4).reshape(B, Nc * chunk, n, dv)[:, :T]


# -- configs -------------------------------------------------------------------------------------------

QUANT_CONFIG = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32}}}}

# name -> (hidden, layers, full_attn_layers 1-based, kda heads, mla heads, dense width, experts, top-k,
#          expert width I, latent width, attn_res_block_size, q_lora_rank, kv_lora_rank)
SIZES = {
    # the shipped model: ~20M parameters (~14M per token), experts MXFP4; every K3 feature on
    "small": dict(H=384, L=9, full=[4, 8, 9], kda_heads=6, mla_heads=6, dense=1024, E=32, k=4, I=128, lat=192,
                  S=4, q_lora=192, kv_lora=128),
    # CPU development / the pipeline check: seconds per step on two cores
    "tiny": dict(H=64, L=5, full=[4, 5], kda_heads=2, mla_heads=2, dense=128, E=8, k=2, I=32, lat=32,
                 S=2, q_lora=32, kv_lora=32),
}


def text_config(size: str, vocab_size: int, eos_ids: list, pad_id: int, max_len: int) -> dict:
    s = SIZES[size]
    L = s["L"]
    kda = [i for i in range(1, L + 1) if i not in s["full"]]
    return {
        "model_type": "kimi_linear",
        "vocab_size": vocab_size, "hidden_size": s["H"], "intermediate_size": s["dense"],
        "moe_intermediate_size": s["I"], "num_hidden_layers": L,
        "num_attention_heads": s["mla_heads"], "num_key_value_heads": s["mla_heads"],
        "q_lora_rank": s["q_lora"], "kv_lora_rank": s["kv_lora"], "qk_nope_head_dim": 48, "qk_rope_head_dim": 16,
        "v_head_dim": 64, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": s["E"], "num_experts_per_token": s["k"], "num_shared_experts": 2,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "routed_expert_hidden_size": s["lat"], "latent_moe_use_norm": True,
        "attn_res_block_size": s["S"], "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": eos_ids, "pad_token_id": pad_id,
        "max_position_embeddings": max_len, "torch_dtype": "bfloat16",
        "linear_attn_config": {"num_heads": s["kda_heads"], "head_dim": 64, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                               "kda_layers": kda, "full_attn_layers": list(s["full"])},
    }


def root_config(text: dict) -> dict:
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "text_config": text, "quantization_config": QUANT_CONFIG}


# -- parameters ----------------------------------------------------------------------------------------


def param_shapes(c: K3Config) -> dict:
    """Every text tensor of the checkpoint (names without language_model.), routed experts stacked as
    ``model.layers.{i}.block_sparse_moe.experts.w{1,2,3}`` [E, out, in] (split per expert at export)."""
    H, V = c.hidden_size, c.vocab_size
    n, d, K = c.kda_num_heads, c.kda_head_dim, c.conv_kernel
    P = n * d
    nh, dn, dr, dv, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    s = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H),
         "model.output_attn_res_norm.weight": (H,), "model.output_attn_res_proj.weight": (1, H)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for nm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            s[p + nm + ".weight"] = (H,)
        s[p + "self_attention_res_proj.weight"] = (1, H)
        s[p + "mlp_res_proj.weight"] = (1, H)
        a = p + "self_attn."
        if c.is_mla(i):
            s.update({a + "q_a_proj.weight": (c.q_lora_rank, H), a + "q_a_layernorm.weight": (c.q_lora_rank,),
                      a + "q_b_proj.weight": (nh * (dn + dr), c.q_lora_rank),
                      a + "kv_a_proj_with_mqa.weight": (r + dr, H), a + "kv_a_layernorm.weight": (r,),
                      a + "kv_b_proj.weight": (nh * (dn + dv), r), a + "g_proj.weight": (nh * dv, H),
                      a + "o_proj.weight": (H, nh * dv)})
        else:
            for x in "qkv":
                s[a + f"{x}_proj.weight"] = (P, H)
                s[a + f"{x}_conv1d.weight"] = (P, 1, K)
            s.update({a + "A_log": (1, 1, n, 1), a + "dt_bias": (P,), a + "f_a_proj.weight": (d, H),
                      a + "f_b_proj.weight": (P, d), a + "b_proj.weight": (n, H), a + "g_proj.weight": (P, H),
                      a + "o_norm.weight": (d,), a + "o_proj.weight": (H, P)})
        if c.is_moe(i):
            m = p + "block_sparse_moe."
            E, I, Lat, Is = c.num_experts, c.moe_intermediate_size, c.routed_expert_hidden_size, c.num_shared_experts * c.moe_intermediate_size
            s.update({m + "gate.weight": (E, H), m + "routed_expert_down_proj.weight": (Lat, H),
                      m + "routed_expert_norm.weight": (Lat,), m + "routed_expert_up_proj.weight": (H, Lat),
                      m + "experts.w1": (E, I, Lat), m + "experts.w3": (E, I, Lat), m + "experts.w2": (E, Lat, I),
                      m + "shared_experts.gate_proj.weight": (Is, H), m + "shared_experts.up_proj.weight": (Is, H),
                      m + "shared_experts.down_proj.weight": (H, Is)})
        else:
            for nm, shp in (("gate_proj", (c.intermediate_size, H)), ("up_proj", (c.intermediate_size, H)),
                            ("down_proj", (H, c.intermediate_size))):
                s[p + f"mlp.{nm}.weight"] = shp
    return s


def init_value(name: str, shape, c: K3Config, gen: torch.Generator) -> torch.Tensor:
    """Initial values. Output projections (o_proj, down_proj, w2, routed_expert_up_proj) are scaled by
    1/√(2L); AttnRes pseudo-queries start at 0 (uniform mixing over depth, as in the paper)."""
    def normal(std):
        return torch.randn(shape, generator=gen) * std

    L = c.num_hidden_layers
    if name.endswith("A_log"):
        return torch.log(torch.empty(shape).uniform_(1.0, 2.0, generator=gen))
    if name.endswith("dt_bias"):  # K3 gate lb·σ(A·(f + dt_bias)): per-channel decays from ~0.005 to ~1.3 per step
        return torch.empty(shape).uniform_(-7.0, -1.0, generator=gen)
    if name.endswith("_res_proj.weight"):
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape)
    if name.endswith("conv1d.weight"):
        w = normal(0.1)
        w[..., -1] += 1.0  # starts near the identity (the current token)
        return w
    if name.endswith("embed_tokens.weight"):
        return normal(1.0)
    if name.endswith("lm_head.weight"):
        return normal(0.5 / math.sqrt(shape[-1]))
    if name.endswith("gate.weight"):
        return normal(0.02)
    fan_in = shape[-1]
    std = 1.0 / math.sqrt(fan_in)
    if any(name.endswith(x) for x in ("o_proj.weight", "down_proj.weight", "experts.w2", "routed_expert_up_proj.weight")):
        std /= math.sqrt(2 * L)
    return normal(std)


NO_DECAY = ("norm.weight", "_res_proj.weight", "A_log", "dt_bias", "conv1d.weight")


class K3Train(nn.Module):
    """The K3 text model for training. forward(ids [B, T]) -> logits [B, T, V] (float32)."""

    def __init__(self, cfg: K3Config, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(seed)
        self.names = list(param_shapes(cfg))
        self.params = nn.ParameterList(
            [nn.Parameter(init_value(k, s, cfg, gen)) for k, s in param_shapes(cfg).items()])
        self.index = {k: i for i, k in enumerate(self.names)}
        self.moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
        # aux-loss-free load balancing (DeepSeek-V3): selection bias, moved toward equal expert load
        self.register_buffer("router_bias", torch.zeros(len(self.moe_layers), cfg.num_experts))
        self.expert_load = [None] * len(self.moe_layers)
        self.fake_quant_experts = False

    @property
    def fp(self):
        """The dtype of the fp32 parts (float64 when the parameters are float64)."""
        return self.params[0].dtype

    def W(self, name):
        return self.params[self.index[name]]

    def named_weights(self):
        return {k: self.params[i] for i, k in enumerate(self.names)}

    def lin(self, x, name):
        return F.linear(x, self.W(name))

    def act(self, a, b):
        c = self.cfg
        return situ(a, b, c.activation_situ_beta, c.activation_situ_linear_beta)

    # -- AttnRes (§7.2), fp32 elementwise (autocast leaves these alone) --
    def attn_res(self, values, prefix):
        V = torch.stack(values)                                                   # [N, B, T, H] fp32
        K = rms_norm(V, self.W(prefix + "_norm.weight"), self.cfg.rms_norm_eps)
        s = (K * self.W(prefix + "_proj.weight").to(self.fp).reshape(-1)).sum(-1)
        a = torch.softmax(s, dim=0)
        return (a.unsqueeze(-1) * V).sum(0)

    def kda(self, i, x):
        c = self.cfg
        p = f"model.layers.{i}.self_attn."
        B, T, _ = x.shape
        n, d, K = c.kda_num_heads, c.kda_head_dim, c.conv_kernel
        P = n * d
        proj = {nm: self.lin(x, p + f"{nm}_proj.weight") for nm in ("q", "k", "v")}           # [B, T, P]
        f = self.lin(self.lin(x, p + "f_a_proj.weight"), p + "f_b_proj.weight")
        b = self.lin(x, p + "b_proj.weight")
        with torch.autocast(device_type=x.device.type, enabled=False):  # conv, gates and core in fp32
            conv = {}
            for nm, z in proj.items():
                w = self.W(p + f"{nm}_conv1d.weight").to(self.fp)                    # [P, 1, K]
                y = F.conv1d(F.pad(z.to(self.fp).transpose(1, 2), (K - 1, 0)), w, groups=P)  # causal depthwise
                conv[nm] = F.silu(y.transpose(1, 2))
            fb = (f.to(self.fp) + self.W(p + "dt_bias").to(self.fp)).view(B, T, n, d)
            A = torch.exp(self.W(p + "A_log").to(self.fp).reshape(n, 1))
            g = c.gate_lower_bound * torch.sigmoid(A * fb)
            beta = torch.sigmoid(b.to(self.fp))                                      # [B, T, n]
            q = l2n(conv["q"].view(B, T, n, d)) / math.sqrt(d)
            k = l2n(conv["k"].view(B, T, n, d))
            v = conv["v"].view(B, T, n, d)
            o = kda_chunked_batched(q, k, v, g, beta)
        gate = torch.sigmoid(self.lin(x, p + "g_proj.weight").to(self.fp).view(B, T, n, d))
        y = rms_norm(o, self.W(p + "o_norm.weight"), c.rms_norm_eps) * gate
        return self.lin(y.reshape(B, T, P).to(x.dtype), p + "o_proj.weight")

    def mla(self, i, x):
        c = self.cfg
        p = f"model.layers.{i}.self_attn."
        B, T, _ = x.shape
        nh, dn, dr, dv, r = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        qa = rms_norm(self.lin(x, p + "q_a_proj.weight"), self.W(p + "q_a_layernorm.weight"), 1e-6)
        q = self.lin(qa.to(x.dtype), p + "q_b_proj.weight").view(B, T, nh, dn + dr)
        ckv = self.lin(x, p + "kv_a_proj_with_mqa.weight")
        lat = rms_norm(ckv[..., :r], self.W(p + "kv_a_layernorm.weight"), 1e-6)
        kr = ckv[..., r:]
        kv = self.lin(lat.to(x.dtype), p + "kv_b_proj.weight").view(B, T, nh, dn + dv)
        k = torch.cat([kv[..., :dn], kr.unsqueeze(2).expand(B, T, nh, dr).to(kv.dtype)], -1)
        v = kv[..., dn:]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=(dn + dr) ** -0.5)
        o = o.transpose(1, 2).reshape(B, T, nh * dv)
        o = o * torch.sigmoid(self.lin(x, p + "g_proj.weight").to(self.fp)).to(o.dtype)
        return self.lin(o, p + "o_proj.weight")

    def dense(self, x, p):
        h = self.act(self.lin(x, p + "gate_proj.weight"), self.lin(x, p + "up_proj.weight"))
        return self.lin(h.to(x.dtype), p + "down_proj.weight")

    def expert_weights(self, m):
        ws = [self.W(m + f"experts.w{j}") for j in (1, 3, 2)]
        return [fake_mxfp4(w) for w in ws] if self.fake_quant_experts else ws

    def moe(self, i, x):
        c = self.cfg
        m = f"model.layers.{i}.block_sparse_moe."
        slot = self.moe_layers.index(i)
        B, T, H = x.shape
        xf = x.reshape(B * T, H)
        N, E, k = xf.shape[0], c.num_experts, c.num_experts_per_token
        with torch.autocast(device_type=x.device.type, enabled=False):
            s = torch.sigmoid(xf.to(self.fp) @ self.W(m + "gate.weight").to(self.fp).t())   # [N, E]
            sel = s + self.router_bias[slot]
            idx = torch.topk(sel.detach(), k, dim=-1).indices                       # [N, k]
            w = s.gather(1, idx)
            w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        z = self.lin(xf, m + "routed_expert_down_proj.weight")                    # [N, Lat]
        flat = idx.reshape(-1)
        counts = torch.bincount(flat, minlength=E)
        self.expert_load[slot] = counts.detach()
        order = torch.argsort(flat, stable=True)
        e_sorted = flat[order]
        starts = torch.cumsum(counts, 0) - counts
        pos = torch.arange(flat.numel(), device=x.device) - starts[e_sorted]
        cap = int(counts.max())
        tok = order // k
        buf = z.new_zeros(E, cap, z.shape[-1])
        buf[e_sorted, pos] = z[tok]
        w1, w3, w2 = self.expert_weights(m)
        h = self.act(buf @ w1.transpose(1, 2).to(buf.dtype), buf @ w3.transpose(1, 2).to(buf.dtype))
        out = h.to(buf.dtype) @ w2.transpose(1, 2).to(buf.dtype)                    # [E, cap, Lat]
        contrib = out[e_sorted, pos].to(self.fp) * w.reshape(-1)[order].unsqueeze(-1)
        y = torch.zeros(N, z.shape[-1], device=x.device, dtype=self.fp).index_add_(0, tok, contrib)
        y = rms_norm(y, self.W(m + "routed_expert_norm.weight"), c.rms_norm_eps)
        y = self.lin(y.to(x.dtype), m + "routed_expert_up_proj.weight")
        y = y + self.dense(xf, m + "shared_experts.")
        return y.reshape(B, T, H)

    def forward(self, ids):
        c = self.cfg
        e = self.W("model.embed_tokens.weight")[ids].to(self.fp)                      # [B, T, H]
        act_dtype = torch.get_autocast_dtype(ids.device.type) if torch.is_autocast_enabled(ids.device.type) else self.fp
        S = c.attn_res_block_size
        Bl, P = [], e
        for i in range(c.num_hidden_layers):
            pre = f"model.layers.{i}."
            start = i % S == 0
            u = self.attn_res(Bl + [P], pre + "self_attention_res")
            if start:
                Bl.append(P)
                P = None
            xn = rms_norm(u, self.W(pre + "input_layernorm.weight"), c.rms_norm_eps).to(act_dtype)
            a = (self.mla(i, xn) if c.is_mla(i) else self.kda(i, xn)).to(self.fp)
            P = a if P is None else P + a
            u = self.attn_res(Bl + [P], pre + "mlp_res")
            xn = rms_norm(u, self.W(pre + "post_attention_layernorm.weight"), c.rms_norm_eps).to(act_dtype)
            mo = self.moe(i, xn) if c.is_moe(i) else self.dense(xn, pre + "mlp.")
            P = P + mo.to(self.fp)
        u = self.attn_res(Bl + [P], "model.output_attn_res")
        h = rms_norm(u, self.W("model.norm.weight"), c.rms_norm_eps).to(act_dtype)
        return F.linear(h, self.W("lm_head.weight")).to(self.fp)

    @torch.no_grad()
    def update_router_bias(self, rate: float):
        """bias_e += rate·sign(mean load − load_e) per MoE layer, from the last forward's selections."""
        for slot, load in enumerate(self.expert_load):
            if load is not None:
                lf = load.to(self.fp)
                self.router_bias[slot] += rate * torch.sign(lf.mean() - lf)
