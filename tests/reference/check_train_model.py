#!/usr/bin/env python3
"""Self-checks of the training forward (k3_train_model.py) against the reference (k3_reference.py):

  (a) batched chunked KDA == recurrent K6 in float64 (≤ 1e-12), K3 gate steps down to −5 per token,
      T not a multiple of the chunk; its gradients == autograd through the recurrent form (≤ 1e-10);
  (b) K3Train == K3Reference in float64 on the tiny and small configs with random weights, non-zero
      AttnRes queries and router biases (max |logit diff| ≤ 1e-9), and in float32 (≤ 2e-3);
  (c) the MXFP4 quantizer: every element at its nearest representable value, nothing clipped, the packed
      bytes decode (reference decoder) to exactly the dequantized values, straight-through gradient = 1.

    python tests/reference/check_train_model.py      # exit code != 0 on any failure; ~1 min on a CPU
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from k3_reference import K3Config, K3Reference, kda_recurrent, l2n, mxfp4_decode, mxfp4_pack  # noqa: E402
from k3_train_model import (K3Train, fake_mxfp4, kda_chunked_batched, mxfp4_dequantize,  # noqa: E402
                            mxfp4_quantize, root_config, text_config)

FAILURES = []


def check(name: str, ok: bool, detail: str):
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        FAILURES.append(name)


def check_kda():
    g = torch.Generator().manual_seed(0)
    B, T, n, d = 2, 150, 3, 16
    q = l2n(torch.randn(B, T, n, d, generator=g, dtype=torch.float64)) / math.sqrt(d)
    k = l2n(torch.randn(B, T, n, d, generator=g, dtype=torch.float64))
    v = torch.randn(B, T, n, d, generator=g, dtype=torch.float64)
    gate = -5 * torch.sigmoid(3 * torch.randn(B, T, n, d, generator=g, dtype=torch.float64) + 2)
    beta = torch.sigmoid(torch.randn(B, T, n, generator=g, dtype=torch.float64))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, gate, beta)]
    out = kda_chunked_batched(*leaves)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * w).sum().backward()
    worst, worst_grad = 0.0, 0.0
    for b in range(B):
        rl = [x[b].clone().requires_grad_() for x in (q, k, v, gate, beta)]
        r, _ = kda_recurrent(*rl)
        (r * w[b]).sum().backward()
        worst = max(worst, float((out[b] - r).detach().abs().max()))
        worst_grad = max(worst_grad, max(float((a.grad[b] - c.grad).abs().max()) for a, c in zip(leaves, rl)))
    check("(a) batched chunked KDA vs recurrent, float64", worst <= 1e-12, f"max |diff| {worst:.2e}")
    check("(a) gradients vs autograd through the recurrent form", worst_grad <= 1e-10, f"max |diff| {worst_grad:.2e}")


def reference_weights(m: K3Train) -> dict:
    w = {}
    for k, p in m.named_weights().items():
        if ".experts.w" in k:
            pre, j = k.rsplit(".", 1)
            for e in range(p.shape[0]):
                w[f"{pre}.{e}.{j}.weight"] = p[e].detach()
        else:
            w[k] = p.detach()
    for slot, layer in enumerate(m.moe_layers):
        w[f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"] = m.router_bias[slot]
    return w


def check_model(size: str, T: int):
    cfg = K3Config.from_dict(root_config(text_config(size, 512, [0, 2], 3, 4096)))
    m = K3Train(cfg, seed=1)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # away from the init's symmetric values: AttnRes mixing and routing matter
        for k, p in m.named_weights().items():
            if k.endswith("_res_proj.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
        m.router_bias.copy_(0.05 * torch.randn(m.router_bias.shape, generator=g))
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=g)
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-3)):
        m = m.to(dtype)
        with torch.no_grad():
            mine = m(ids)
        ref = K3Reference(cfg, reference_weights(m), dtype=dtype)
        worst = max(float((mine[b] - ref.forward(ids[b])).abs().max()) for b in range(ids.shape[0]))
        check(f"(b) K3Train vs K3Reference, {size}, T={T}, {dtype}", worst <= tol, f"max |logit diff| {worst:.2e}")


def check_mxfp4():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1)
    w[3, :32] = 0
    codes, scales = mxfp4_quantize(w)
    dq = mxfp4_dequantize(codes, scales)
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6.0])
    scale = torch.exp2(scales.double() - 127).repeat_interleave(32, 1).float()
    cand = torch.cat([grid, -grid]).view(1, 1, -1) * scale.unsqueeze(-1)
    nearest = (cand - w.unsqueeze(-1)).abs().min(-1).values
    check("(c) MXFP4: nearest representable", torch.allclose((dq - w).abs(), nearest), "every element")
    check("(c) MXFP4: no clipping", bool((w.abs() <= 6 * scale).all()), "|w| <= 6 * scale")
    check("(c) MXFP4: packed bytes decode exactly", torch.equal(mxfp4_decode(mxfp4_pack(codes), scales), dq), "reference decoder")
    x = torch.randn(4, 8, 64, generator=g, requires_grad=True)
    fake_mxfp4(x).sum().backward()
    check("(c) MXFP4: straight-through gradient", torch.equal(x.grad, torch.ones_like(x)), "d/dx = 1")


def main():
    torch.set_num_threads(max(1, torch.get_num_threads()))
    check_kda()
    check_model("tiny", 150)
    check_model("small", 80)
    check_mxfp4()
    print("all checks passed" if not FAILURES else f"{len(FAILURES)} FAILED: {FAILURES}")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
