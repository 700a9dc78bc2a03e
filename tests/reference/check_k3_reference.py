#!/usr/bin/env python3
"""Self-checks of the K3 PyTorch reference (k3_reference.py). Exits non-zero on any failure.

    python tests/reference/check_k3_reference.py [--fixture tests/data/tiny-k3]

(a) chunked (§6) vs recurrent (K6) KDA with the K3 lower-bounded gate at K3 ranges (lb = -5, long
    sequences where the in-chunk cumulative decay reaches hundreds), fp32 and fp64; no inf/NaN; and, when
    transformers is importable, against transformers' chunk/recurrent_kimi_delta_attention (fp32).
(b) MXFP4 decode: every E2M1 code x E8M0 scale bytes 0x00, 0x7F, 0xFE, 0xFF (NaN block) and random
    blocks, bit-exact against an independent decoder (ml_dtypes float4_e2m1fn / float8_e8m0fnu, and torch's
    float8_e8m0fnu where present); nibble order of the packer.
(c) tiny-k3: cached decode (70-token prefill + 10 single-token steps, token-by-token from the start, split
    prefills 64+16 and 33+47) vs one full teacher-forced forward, fp32 and fp64.
(d) tiny-k3: every trap flag changes the logits by more than 1e-3 (max abs change printed), and zeroing any
    single sublayer does too (every sublayer visibly matters).
(e) the fixture on disk (if present): layout/dtypes, and oracle.json reproduced by the reference.
"""

from __future__ import annotations

import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["USE_HUB_KERNELS"] = "NO"
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
for _blocked in ("fla", "causal_conv1d", "kernels"):
    sys.modules[_blocked] = None  # type: ignore[assignment]  # force transformers' torch fallbacks

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import k3_reference as kr  # noqa: E402
import make_k3_fixture as mk  # noqa: E402
from k3_reference import K3Config, K3Reference, Traps, kda_chunked, kda_recurrent, l2n  # noqa: E402

FAILURES: list[str] = []
try:
    import ml_dtypes
    HAVE_ML_DTYPES = True
except ImportError:
    ml_dtypes = None
    HAVE_ML_DTYPES = False


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        FAILURES.append(what)


# ---------------------------------------------------------------------------------------------
# (a) KDA chunked vs recurrent, bounded gate
# ---------------------------------------------------------------------------------------------


def kda_inputs(T, n, d, dtype, seed, lb=-5.0, gate="bounded"):
    g_ = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=g_, dtype=torch.float64)
    q = l2n(rn(T, n, d)) / math.sqrt(d)
    k = l2n(rn(T, n, d))
    v = rn(T, n, d)
    beta = torch.sigmoid(rn(T, n))
    A = torch.exp(torch.log(torch.rand(n, 1, generator=g_, dtype=torch.float64) * 15 + 1))  # exp(ln U(1,16))
    f = rn(T, n, d) + 0.5 * rn(n, d)  # f + dt_bias
    if gate == "bounded":
        g = lb * torch.sigmoid(A * f)
    else:
        g = -A * torch.nn.functional.softplus(f)
    S0 = 0.5 * rn(n, d, d)
    return [x.to(dtype) for x in (q, k, v, g, beta, S0)]


def max_chunk_decay(g, chunk=kr.KDA_CHUNK):
    worst = 0.0
    for s in range(0, g.shape[0], chunk):
        worst = max(worst, float(-torch.cumsum(g[s:s + chunk].double(), 0).min()))
    return worst


def hf_kda():
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as m
        return m.chunk_kimi_delta_attention, m.recurrent_kimi_delta_attention
    except Exception as e:  # pragma: no cover
        print(f"  (transformers kimi_linear KDA functions not importable: {type(e).__name__}: {e})")
        return None


def section_a():
    print("(a) KDA chunked (§6) vs recurrent (K6), lower-bounded gate lb=-5")
    hf = hf_kda()
    for T, n, d in ((300, 2, 16), (200, 2, 128), (80, 2, 16)):
        for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-10)):
            q, k, v, g, beta, S0 = kda_inputs(T, n, d, dtype, seed=T + d)
            oc, Sc = kda_chunked(q, k, v, g, beta, S0)
            orr, Sr = kda_recurrent(q, k, v, g, beta, S0)
            finite = bool(torch.isfinite(oc).all() and torch.isfinite(Sc).all())
            do = float((oc - orr).abs().max())
            dS = float((Sc - Sr).abs().max())
            scale = float(orr.abs().max())
            check(finite and do <= tol * max(1.0, scale) and dS <= tol * max(1.0, float(Sr.abs().max())),
                  f"T={T} n={n} d={d} {str(dtype)[6:]}: max in-chunk -gamma = {max_chunk_decay(g):.1f}, "
                  f"min g = {float(g.min()):.3f}, |o_chunk - o_rec| = {do:.2e} (max|o| {scale:.2f}), "
                  f"|S_chunk - S_rec| = {dS:.2e}, finite = {finite}")
    # base (unbounded) gate too, at an extreme decay
    q, k, v, g, beta, S0 = kda_inputs(300, 2, 16, torch.float32, seed=5, gate="base")
    oc, _ = kda_chunked(q, k, v, g, beta, S0)
    orr, _ = kda_recurrent(q, k, v, g, beta, S0)
    d = float((oc - orr).abs().max())
    check(bool(torch.isfinite(oc).all()) and d < 2e-5,
          f"base gate -exp(A_log)*softplus: max in-chunk -gamma = {max_chunk_decay(g):.0f}, |diff| = {d:.2e}")
    # why the pairwise difference matters: exp(gamma_r) * exp(-gamma_j) overflows in fp32
    q, k, v, g, beta, S0 = kda_inputs(64, 2, 16, torch.float32, seed=1)
    gam = torch.cumsum(g, 0)
    naive = torch.exp(gam).unsqueeze(1) * torch.exp(-gam).unsqueeze(0)
    print(f"  (info) naive exp(gamma_r)*exp(-gamma_j) over one chunk: inf/NaN entries = "
          f"{int((~torch.isfinite(naive)).sum())} of {naive.numel()} -> use exp(gamma_r - gamma_j)")
    if hf is not None:
        chunk_hf, rec_hf = hf
        q, k, v, g, beta, S0 = kda_inputs(300, 2, 16, torch.float32, seed=11)
        qn = q * math.sqrt(16)  # HF scales q by 1/sqrt(d) itself
        args = [x.unsqueeze(0) for x in (qn, k, v, g, beta)]
        oc, Sc = kda_chunked(q, k, v, g, beta, S0)
        orr, Sr = kda_recurrent(q, k, v, g, beta, S0)
        try:
            oh, Sh = chunk_hf(*args, initial_state=S0.unsqueeze(0).clone(), output_final_state=True,
                              use_qk_l2norm_in_kernel=False)
            d1 = float((oh[0] - oc).abs().max())
            check(d1 < 2e-5, f"vs transformers chunk_kimi_delta_attention (fp32, T=300): |o diff| = {d1:.2e}, "
                             f"|S diff| = {float((Sh[0] - Sc).abs().max()):.2e}")
            oh, Sh = rec_hf(*args, initial_state=S0.unsqueeze(0).clone(), output_final_state=True,
                            use_qk_l2norm_in_kernel=False)
            d2 = float((oh[0] - orr).abs().max())
            check(d2 < 2e-5, f"vs transformers recurrent_kimi_delta_attention (fp32, T=300): |o diff| = {d2:.2e}, "
                             f"|S diff| = {float((Sh[0] - Sr).abs().max()):.2e}")
        except TypeError as e:  # signature drift between transformers versions
            print(f"  (transformers KDA functions have another signature, skipped: {e})")


# ---------------------------------------------------------------------------------------------
# (b) MXFP4
# ---------------------------------------------------------------------------------------------


def _e2m1_bits(codes: np.ndarray) -> np.ndarray:
    """E2M1 from its bit fields (sign | 2-bit exponent, bias 1 | 1-bit mantissa), no table."""
    c = codes.astype(np.int64)
    s, e, m = (c >> 3) & 1, (c >> 1) & 3, c & 1
    mag = np.where(e == 0, 0.5 * m, np.ldexp(1.0 + 0.5 * m, e - 1))
    return np.where(s == 1, -mag, mag)


def _e8m0_bits(b: np.ndarray) -> np.ndarray:
    return np.where(b == 0xFF, np.nan, np.ldexp(1.0, b.astype(np.int64) - 127))


def independent_decode(packed: np.ndarray, scales: np.ndarray, use_ml_dtypes: bool = True) -> np.ndarray:
    """Decoder independent of k3_reference: ml_dtypes float4_e2m1fn / float8_e8m0fnu casts (or, without
    ml_dtypes, the formats' bit-field formulas)."""
    lo = packed & 0x0F
    hi = packed >> 4
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2], codes[:, 1::2] = lo, hi
    if use_ml_dtypes and HAVE_ML_DTYPES:
        vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
        sc = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    else:
        vals, sc = _e2m1_bits(codes), _e8m0_bits(scales)
    return vals * np.repeat(sc, 32, axis=1)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """bitwise-equal values incl. signed zeros and NaN positions"""
    return a.shape == b.shape and np.array_equal(np.isnan(a), np.isnan(b)) and \
        np.array_equal(np.where(np.isnan(a), 0, a), np.where(np.isnan(b), 0, b)) and \
        np.array_equal(np.signbit(np.where(np.isnan(a), 0, a)), np.signbit(np.where(np.isnan(b), 0, b)))


def section_b():
    print("(b) MXFP4 decode (compressed-tensors mxfp4-pack-quantized)")
    codes = np.tile(np.arange(16, dtype=np.uint8), 2)            # one 32-block: every code twice
    rows = []
    scales = [0x00, 0x7F, 0xFE, 0xFF]
    for s in scales:
        rows.append(codes)
    codes_m = np.stack(rows)                                      # [4, 32]
    packed = kr.mxfp4_pack(torch.from_numpy(codes_m)).numpy()
    check(bool(np.all(packed[:, 0] == (codes_m[:, 0] | (codes_m[:, 1] << 4)))) and packed[0, 0] == 0x10,
          f"packer: byte 0 = 0x{packed[0, 0]:02X} (low nibble = element 0, high nibble = element 1)")
    sc = np.array(scales, dtype=np.uint8).reshape(4, 1)
    ours = kr.mxfp4_decode(torch.from_numpy(packed), torch.from_numpy(sc), torch.float64).numpy()
    if not HAVE_ML_DTYPES:
        print("  (ml_dtypes not installed: the independent decoder falls back to the E2M1/E8M0 bit-field "
              "formulas; pip install ml_dtypes for the cast-based check)")
    ind = independent_decode(packed, sc)
    check(same(ours, independent_decode(packed, sc, use_ml_dtypes=False)),
          "16 codes x scales {0x00,0x7F,0xFE,0xFF}: float64 decode == E2M1/E8M0 bit-field formulas")
    check(same(ours, ind), "16 codes x scales {0x00,0x7F,0xFE,0xFF}: float64 decode == "
                           f"{'ml_dtypes float4_e2m1fn*float8_e8m0fnu' if HAVE_ML_DTYPES else 'bit-field decoder'} (e.g. code 0x7 @0xFE = {ours[2, 7]:.6e}, "
                           f"code 0x1 @0x00 = {ours[0, 1]:.6e}, code 0x8 = {ours[1, 8]})")
    check(bool(np.isnan(ours[3]).all()), "scale 0xFF -> the whole 32-block is NaN (also code 0x0 / 0x8)")
    check(ours[1, 8] == 0 and np.signbit(ours[1, 8]), "code 0x8 = -0.0")
    expect = np.array(kr.E2M1_VALUES)
    check(bool(np.array_equal(ours[1, :16], expect)), f"scale 0x7F = 1.0: values {ours[1, :16].tolist()}")
    o32 = kr.mxfp4_decode(torch.from_numpy(packed), torch.from_numpy(sc), torch.float32).numpy()
    with np.errstate(over="ignore"):
        ind32 = ind.astype(np.float32)
    check(same(o32, ind32), "float32 decode == independent values rounded to float32 "
          f"(2^-127 scale keeps subnormals exactly; 4*2^127 and 6*2^127 -> {o32[2, 6]}, {o32[2, 7]})")
    if hasattr(torch, "float8_e8m0fnu"):
        tsc = torch.from_numpy(sc.copy()).view(torch.float8_e8m0fnu).to(torch.float64).numpy()
        lut = torch.tensor(kr.E2M1_VALUES, dtype=torch.float64)
        tv = lut[torch.from_numpy(codes_m.astype(np.int64))].numpy() * np.repeat(tsc, 32, axis=1)
        check(same(ours, tv), "decode == torch.float8_e8m0fnu scales x E2M1 table")
    try:
        t4 = torch.from_numpy(packed.copy()).view(torch.float4_e2m1fn_x2).to(torch.float32)
        print(f"  (info) torch.float4_e2m1fn_x2 -> float works: {t4.flatten()[:4]}")
    except Exception as e:
        print(f"  (info) torch.float4_e2m1fn_x2 has no float conversion here ({type(e).__name__}); "
              "ml_dtypes is the independent E2M1 decoder")
    rng = np.random.default_rng(0)
    rc = rng.integers(0, 16, size=(64, 128)).astype(np.uint8)
    rs = rng.integers(0, 256, size=(64, 4)).astype(np.uint8)
    rp = kr.mxfp4_pack(torch.from_numpy(rc)).numpy()
    ours = kr.mxfp4_decode(torch.from_numpy(rp), torch.from_numpy(rs), torch.float64).numpy()
    check(same(ours, independent_decode(rp, rs)), "random [64,128] weight, all scale bytes 0..255: exact")
    # a mixed row: scale g covers columns 32g..32g+31
    sc2 = np.array([[0x7F, 0x80, 0x7E, 0xFF]], dtype=np.uint8)
    pk = kr.mxfp4_pack(torch.full((1, 128), 2, dtype=torch.uint8))  # all 1.0
    row = kr.mxfp4_decode(pk, torch.from_numpy(sc2), torch.float64).numpy()[0]
    check(bool(np.all(row[:32] == 1) and np.all(row[32:64] == 2) and np.all(row[64:96] == 0.5)
               and np.isnan(row[96:]).all()), "scale g applies to columns 32g..32g+31 (1, 2, 0.5, NaN blocks)")


# ---------------------------------------------------------------------------------------------
# tiny-k3 model
# ---------------------------------------------------------------------------------------------


def load_tiny(fixture: Path | None):
    if fixture is not None and (fixture / "config.json").exists():
        cfg, w = kr.load_checkpoint(fixture)
        src = str(fixture)
    else:
        cfg = K3Config.from_dict(mk.ROOT_CONFIG)
        w = mk.dequantized(mk.make_tensors())
        src = "in-memory make_k3_fixture.make_tensors()"
    return cfg, w, src


def section_c(cfg, w):
    print("(c) tiny-k3: cached decode vs one teacher-forced forward")
    rng = np.random.default_rng(123)
    ids = rng.integers(3, 256, size=80).tolist()
    for dtype, tol in ((torch.float32, 2e-4), (torch.float64, 1e-10)):
        m = K3Reference(cfg, w, dtype)
        full = m.forward(ids)
        nm = str(dtype)[6:]
        # 70-token prefill + 10 single-token (recurrent) steps
        cache = m.new_cache()
        rows = [m.forward(ids[:70], cache)]
        for t in range(70, 80):
            rows.append(m.forward(ids[t:t + 1], cache))
        d1 = float((torch.cat(rows) - full).abs().max())
        check(d1 < tol, f"{nm}: prefill 70 + 10 decode steps vs full forward: max|dlogit| = {d1:.2e}")
        for split in ((64, 16), (33, 47)):
            cache = m.new_cache()
            a = m.forward(ids[:split[0]], cache)
            b = m.forward(ids[split[0]:], cache)
            d2 = float((torch.cat([a, b]) - full).abs().max())
            check(d2 < tol, f"{nm}: split prefill {split[0]}+{split[1]} vs full forward: max|dlogit| = {d2:.2e}")
        cache = m.new_cache()
        rows = [m.forward(ids[t:t + 1], cache) for t in range(80)]
        d3 = float((torch.cat(rows) - full).abs().max())
        check(d3 < tol, f"{nm}: token-by-token through the caches vs full forward: max|dlogit| = {d3:.2e}")
        d4 = float((m.forward(ids, kda_mode="recurrent") - full).abs().max())
        check(d4 < tol, f"{nm}: full forward with recurrent KDA vs chunked KDA: max|dlogit| = {d4:.2e}")
        greedy, glog = m.generate_greedy(ids[:5], 10)
        tf = m.forward(ids[:5] + greedy[:-1])[4:]
        check(tf.argmax(-1).tolist() == greedy and float((glog - tf).abs().max()) < tol,
              f"{nm}: generate_greedy (cached) == argmax of teacher-forced rows, "
              f"max|dlogit| = {float((glog - tf).abs().max()):.2e}")
    m32, m64 = K3Reference(cfg, w, torch.float32), K3Reference(cfg, w, torch.float64)
    d = float((m32.forward(ids).double() - m64.forward(ids)).abs().max())
    print(f"  (info) float32 vs float64 reference, 80-token forward: max|dlogit| = {d:.2e}")


# ---------------------------------------------------------------------------------------------
# (d) traps
# ---------------------------------------------------------------------------------------------

REQUIRED_TRAPS = ["silu_instead_of_situ", "drop_final_attnres", "zero_based_layer_lists",
                  "latent_norm_after_up_proj", "mla_gate_per_head_scalar", "kda_gate_unbounded",
                  "duplicate_embedding_in_attnres"]


def alt_mixer_weights(cfg, w):
    """Weights for the mixer kind a 0-based reading of the layer lists would wrongly ask for."""
    extra = {}
    for i in range(cfg.num_hidden_layers):
        right, wrong = cfg.is_mla(i), cfg.is_mla(i, zero_based_trap=True)
        if right != wrong:
            for k, v in mk.mixer_tensors(mk.TEXT_CONFIG, i, "mla" if wrong else "kda", seed=999).items():
                if k not in w:
                    extra[k] = v
    return extra


def section_d(cfg, w):
    print("(d) tiny-k3: each trap flag changes the logits by > 1e-3 (float64; 80-token prompt + 10 steps)")
    rng = np.random.default_rng(321)
    ids = rng.integers(3, 256, size=90).tolist()
    base = K3Reference(cfg, w, torch.float64).forward(ids)
    noise = float((K3Reference(cfg, w, torch.float32).forward(ids).double() - base).abs().max())
    print(f"  float32-vs-float64 noise on the same input: {noise:.2e}")
    ww = dict(w)
    ww.update(alt_mixer_weights(cfg, w))
    for name in Traps.names():
        out = K3Reference(cfg, ww, torch.float64, Traps(**{name: True})).forward(ids)
        dlt = float((out - base).abs().max())
        if name in REQUIRED_TRAPS:
            check(dlt > 1e-3, f"trap {name:32s} max|dlogit| = {dlt:.4f}")
        else:
            print(f"  (extra) trap {name:26s} max|dlogit| = {dlt:.4f}{'' if dlt > 1e-3 else '  (below 1e-3)'}")
    print("  every sublayer visibly matters (output of one sublayer zeroed):")
    worst = math.inf
    parts = []
    for i in range(cfg.num_hidden_layers):
        for sub in ("mixer", "ffn"):
            m = K3Reference(cfg, w, torch.float64)
            if sub == "mixer":
                attr = "mla" if cfg.is_mla(i) else "kda"
            else:
                attr = "ffn"
            orig = getattr(m, attr)

            def zeroed(j, x, *a, _o=orig, _i=i):
                y = _o(j, x, *a)
                return torch.zeros_like(y) if j == _i else y
            setattr(m, attr, zeroed)
            dlt = float((m.forward(ids) - base).abs().max())
            worst = min(worst, dlt)
            parts.append(f"{i}.{attr}={dlt:.2f}")
    print("   " + " ".join(parts))
    check(worst > 1e-3, f"smallest logit change from zeroing one sublayer = {worst:.3f}")


# ---------------------------------------------------------------------------------------------
# (e) fixture on disk
# ---------------------------------------------------------------------------------------------


def section_e(fixture: Path):
    print(f"(e) fixture {fixture}")
    from safetensors import safe_open
    root = json.loads((fixture / "config.json").read_text())
    check(root.get("model_type") == "kimi_k3" and root["text_config"]["model_type"] == "kimi_linear"
          and root["quantization_config"]["format"] == "mxfp4-pack-quantized", "config.json K3 layout")
    with safe_open(str(fixture / "model.safetensors"), framework="pt") as h:
        keys = list(h.keys())
        dt = {k: h.get_tensor(k).dtype for k in keys}
    bad = [k for k in keys if not (k.startswith("language_model.") or k.startswith(("vision_tower.", "multi_modal_projector.")))]
    check(not bad, f"{len(keys)} tensors, all language_model.* or non-text ({bad[:3]})")
    q = [k for k in keys if k.endswith((".weight_packed", ".weight_scale"))]
    check(all(dt[k] == torch.uint8 for k in q) and all(dt[k] == torch.float32 for k in keys if k not in q),
          f"{len(q)} MXFP4 tensors uint8, all other tensors float32")
    man = json.loads((fixture / "oracle.json").read_text())
    cfg, w = kr.load_checkpoint(fixture)
    m64 = K3Reference(cfg, w, torch.float64)
    for c in man["cases"]:
        r = c["runs"]["float32"]
        P, N = len(c["prompt_ids"]), len(r["greedy_ids"])
        arr = np.load(fixture / r["logits"])
        greedy, _ = m64.generate_greedy(c["prompt_ids"], N)
        tf = m64.forward(c["prompt_ids"] + greedy[:-1]).numpy()
        d = float(np.abs(arr.astype(np.float64) - tf).max())
        rows = arr[P - 1:]
        top2 = np.sort(rows, axis=-1)[:, -2:]
        check(arr.dtype == np.dtype("<f4") and arr.shape == (P + N - 1, cfg.vocab_size) and greedy == r["greedy_ids"]
              and d < 1e-6 and rows.argmax(-1).tolist() == greedy and N >= 10,
              f"{c['name']}: shape {arr.shape}, greedy ids reproduced, |npy - reference| = {d:.1e}, "
              f"min_margin {r['min_margin']:.4f} (npy: {float((top2[:, 1] - top2[:, 0]).min()):.4f})")
    total = sum(p.stat().st_size for p in fixture.iterdir() if p.is_file())
    check(total < 2 * 10**6, f"fixture size {total} bytes < 2 MB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default=str(HERE.parent / "data" / "tiny-k3"))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, numpy {np.__version__}")
    section_a()
    section_b()
    fixture = Path(args.fixture)
    cfg, w, src = load_tiny(fixture)
    print(f"tiny-k3 weights from {src}")
    section_c(cfg, w)
    section_d(cfg, w)
    if (fixture / "oracle.json").exists():
        section_e(fixture)
    else:
        print(f"(e) skipped: no {fixture}/oracle.json (run make_k3_fixture.py)")
    print()
    if FAILURES:
        print(f"FAILED: {len(FAILURES)} check(s)")
        for f in FAILURES:
            print("  - " + f)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
