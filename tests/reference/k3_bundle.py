"""After training (train_k3.py): MXFP4 quantization, export in the K3 checkpoint layout, the reference
checks with k3_reference.py on the exported files, the test fixtures, the model card and the bundle.

Every stage runs under guard(): a failure is recorded in summary["errors"] and the later stages still
run, so one GPU session always returns whatever was produced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import tarfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import k3_card
import k3_corpus
from k3_reference import K3Reference, load_checkpoint, mxfp4_decode, mxfp4_pack
from k3_train_model import mxfp4_dequantize, mxfp4_quantize

FIXTURE_DIR = "tests/data/bundled-model"   # repo-relative; the C++ test reads reference.json there
PART_BYTES = 15 * 1000 * 1000              # bundle parts (the GPU machine returns files of <= 16 MB)
AGREE_TOL = 2e-3                           # training forward vs k3_reference, max |logit diff| (fp32, TF32 off)
MIN_GREEDY_MARGIN = 5e-3                   # top1 - top2 of the reference at every fixture token
CI_PREFIX_TOKENS = (512, 1024)             # perplexities of these prefixes are recorded too (CI runs 1024)
PROMPTS = [
    "def fibonacci(n):\n",
    "import numpy as np\n\n\ndef ",
    "class Stack:\n    def __init__(self):\n        ",
    "    for i in range(len(x)):\n        ",
]
CHAT_MESSAGES = [{"role": "user", "content": "Write a Python function `add(a, b)`: Return the sum of a and b."}]


@dataclasses.dataclass
class State:
    args: object
    work: Path
    cfg: object
    root: dict
    model: object
    tok: object
    corpus: object
    train_tokens: int
    heldout_tokens: int
    n_chats: int
    n_params: int
    training: dict
    windows: torch.Tensor
    device: torch.device
    log: object
    t0: float
    summary: dict = dataclasses.field(default_factory=lambda: {"errors": []})


def guard(st: State, stage: str, fn):
    t = time.time()
    try:
        out = fn()
        st.log(f"{stage}: done in {time.time() - t:.1f}s")
        return out
    except Exception as e:  # noqa: BLE001 - one shot on the GPU: record, keep going
        traceback.print_exc()
        st.summary["errors"].append(f"{stage}: {type(e).__name__}: {e}")
        st.log(f"{stage}: FAILED ({e})")
        return None


@contextlib.contextmanager
def exact_fp32():
    """TF32 off for matmuls and cuDNN convolutions (the KDA short conv) while comparing with the reference."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def render_chat(messages, add_generation_prompt=True) -> str:
    """What k3_corpus.CHAT_TEMPLATE renders (plow's renderer is held to this string by the C++ test)."""
    text = "".join(f"{k3_corpus.IM_START}{m['role']}\n{m['content']}{k3_corpus.IM_END}\n" for m in messages)
    return text + (f"{k3_corpus.IM_START}assistant\n" if add_generation_prompt else "")


# -- quantization and export ------------------------------------------------------------------------------


def expert_names(name: str, e: int) -> str:
    pre, w = name.rsplit(".", 1)              # model.layers.{i}.block_sparse_moe.experts, w1
    return f"{pre}.{e}.{w}.weight"


def quantize_and_round(st: State):
    """In place: non-expert weights rounded to bf16 (what is stored); returns the experts' MXFP4 codes and
    scales and their unquantized values. A_log / dt_bias stay fp32, as stored."""
    quant, raw = {}, {}
    with torch.no_grad():
        for name, p in st.model.named_weights().items():
            if ".experts.w" in name:
                raw[name] = p.detach().clone()
                quant[name] = [mxfp4_quantize(p[e]) for e in range(p.shape[0])]
            elif not (name.endswith("A_log") or name.endswith("dt_bias")):
                p.copy_(p.to(torch.bfloat16).float())
    return quant, raw


def set_experts(st: State, values: dict):
    with torch.no_grad():
        for name, v in values.items():
            st.model.W(name).copy_(v)


def dequantized(quant: dict, device) -> dict:
    return {name: torch.stack([mxfp4_dequantize(c, s) for c, s in per]).to(device) for name, per in quant.items()}


def export_model(st: State, quant: dict, model_dir: Path):
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors, mismatched = {}, []
    for name, p in st.model.named_weights().items():
        if ".experts.w" in name:
            for e, (codes, scales) in enumerate(quant[name]):
                base = "language_model." + expert_names(name, e)
                packed = mxfp4_pack(codes.cpu())
                # the stored bytes decode (reference decoder) to exactly the values evaluated with
                if not torch.equal(mxfp4_decode(packed, scales.cpu()), mxfp4_dequantize(codes, scales).cpu()):
                    mismatched.append(base)
                tensors[base + "_packed"] = packed
                tensors[base + "_scale"] = scales.cpu().contiguous()
        else:
            keep32 = name.endswith("A_log") or name.endswith("dt_bias")
            tensors["language_model." + name] = p.detach().cpu().to(torch.float32 if keep32 else torch.bfloat16).contiguous()
    for slot, layer in enumerate(st.model.moe_layers):
        key = f"language_model.model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"
        tensors[key] = st.model.router_bias[slot].detach().cpu().float().contiguous()
    if mismatched:
        st.summary["errors"].append(f"export: {len(mismatched)} MXFP4 tensors decode differently, e.g. {mismatched[0]}")
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps(st.root, indent=2) + "\n")
    st.tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(k3_corpus.tokenizer_config(st.args.seq_len * 8), indent=2) + "\n")
    gen = {"eos_token_id": st.root["text_config"]["eos_token_id"], "pad_token_id": st.root["text_config"]["pad_token_id"],
           "do_sample": False}
    (model_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return sum(f.stat().st_size for f in model_dir.iterdir())


# -- reference checks --------------------------------------------------------------------------------------


def nll_of(logits: torch.Tensor, ids) -> tuple[float, int]:
    ids = torch.as_tensor(ids, dtype=torch.long)
    return float(F.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum")), ids.numel() - 1


def reference_loss(ref: K3Reference, windows: torch.Tensor) -> float:
    total, count = 0.0, 0
    for w in windows:
        s, n = nll_of(ref.forward(w), w)
        total, count = total + s, count + n
    return total / count


@torch.no_grad()
def agreement(st: State, ref: K3Reference, ids: torch.Tensor) -> dict:
    """Training forward (fp32 on the training device, TF32 off) vs k3_reference (fp32, CPU)."""
    st.model.eval()
    try:
        with exact_fp32():
            mine = st.model(ids.unsqueeze(0).to(st.device))[0].float().cpu()
    finally:
        st.model.train()
    theirs = ref.forward(ids)
    diff = (mine - theirs).abs()
    return {"tokens": int(ids.numel()), "max_abs_logit_diff": float(diff.max()),
            "median_abs_logit_diff": float(diff.median()), "max_abs_logit": float(theirs.abs().max()),
            "argmax_agreement": float((mine.argmax(-1) == theirs.argmax(-1)).float().mean()),
            "nll_training_forward": nll_of(mine, ids)[0] / (ids.numel() - 1),
            "nll_reference": nll_of(theirs, ids)[0] / (ids.numel() - 1),
            "tolerance_max_abs": AGREE_TOL, "ok": bool(float(diff.max()) <= AGREE_TOL)}


def greedy_case(ref: K3Reference, tok, prompt_text: str, n: int) -> dict:
    ids = tok.encode(prompt_text, add_special_tokens=False).ids
    out, rows = ref.generate_greedy(ids, n)
    top2 = torch.topk(rows, 2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    safe = n
    for i, m in enumerate(margins):
        if m < MIN_GREEDY_MARGIN:
            safe = i
            break
    safe = max(safe, 1)
    return {"prompt": prompt_text, "prompt_ids": ids, "greedy_ids": out[:safe],
            "greedy_text": tok.decode(out[:safe], skip_special_tokens=False),
            "full_greedy_ids": out, "full_greedy_text": tok.decode(out, skip_special_tokens=False),
            "min_margin": min(margins[:safe]), "cut_at_low_margin": safe < n}


def time_left(st: State) -> float:
    a = st.args
    return st.t0 + a.total_seconds - time.time() if a.total_seconds > 0 else float("inf")


def affordable(st: State, stage: str, seconds: float) -> bool:
    """False (and recorded) when the stage's estimated time would pass the --total-seconds deadline."""
    if seconds < time_left(st) - 5:
        return True
    st.summary["errors"].append(f"{stage}: skipped, needs ~{seconds:.0f}s, {time_left(st):.0f}s left")
    st.log(f"{stage}: SKIPPED (needs ~{seconds:.0f}s, {time_left(st):.0f}s left)")
    return False


def ppl_fixture(st: State, ref: K3Reference, fixture_dir: Path, n_tokens: int) -> dict:
    text, sources = k3_corpus.heldout_slice(st.tok, st.corpus.heldout, n_tokens)
    (fixture_dir / "heldout-python.txt").write_text(text)
    ids = st.tok.encode(text, add_special_tokens=False).ids
    logits = ref.forward(ids)
    per = F.cross_entropy(logits[:-1].double(), torch.as_tensor(ids[1:]), reduction="none")
    ppl = {"text_file": f"{FIXTURE_DIR}/heldout-python.txt", "tokens": len(ids), "predicted_tokens": len(ids) - 1,
           "nll": float(per.mean()), "ppl": math.exp(float(per.mean())), "first_ids": ids[:16],
           "ids_sha256": hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest(), "prefixes": [],
           "source_files": sources,
           "source_packages": {p.distribution: f"{p.version} ({p.license})" for p in st.corpus.packages
                               if any(src.split("/")[0] == p.name for src in sources)}}
    for n in CI_PREFIX_TOKENS:  # `plow eval-ppl --max-tokens n` scores the first n tokens of the same sequence
        if n < len(ids):
            m = float(per[: n - 1].mean())
            ppl["prefixes"].append({"max_tokens": n, "predicted_tokens": n - 1, "nll": m, "ppl": math.exp(m)})
    st.log(f"held-out text: {len(ids)} tokens, reference nll {ppl['nll']:.4f}, ppl {ppl['ppl']:.3f}")
    return ppl


def write_fixtures(st: State, ref: K3Reference, fixture_dir: Path, model_rel: str, sec_per_token: float) -> dict:
    fixture_dir.mkdir(parents=True, exist_ok=True)
    fixture = {
        "model_dir": model_rel, "reference": "tests/reference/k3_reference.py (float32, CPU)",
        "made_by": "tests/reference/train_k3.py", "torch": torch.__version__,
        "ppl_tolerance_relative": 0.005,
        "greedy_note": f"greedy ids stop before the first step whose top1-top2 margin is < {MIN_GREEDY_MARGIN}; "
                       "eos is ignored (plow generate --ignore-eos)",
    }
    # the text shrinks (not below 256 tokens) when the deadline is near; ~30 s stay for the greedy cases
    n_tokens = int(min(st.args.heldout_tokens, (time_left(st) - 30) / (1.5 * sec_per_token)))
    if n_tokens < 256:
        st.summary["errors"].append(f"fixture: held-out perplexity skipped, {time_left(st):.0f}s left")
    else:
        if n_tokens < st.args.heldout_tokens:
            st.summary["errors"].append(f"fixture: held-out text cut to {n_tokens} tokens by the deadline")
        fixture["perplexity"] = guard(st, "fixture: held-out perplexity", lambda: ppl_fixture(st, ref, fixture_dir, n_tokens))
    prompts = PROMPTS + [render_chat(CHAT_MESSAGES)]
    cases = []
    for i, prompt in enumerate(prompts):
        # a decode step costs about 20 prefill tokens; shorten the continuations rather than drop a prompt
        per_case = (time_left(st) - 10) / (len(prompts) - i)
        n = int(min(st.args.gen_tokens, max(4, per_case / (20 * sec_per_token * 1.5))))
        case = guard(st, f"fixture: greedy {i}", lambda: greedy_case(ref, st.tok, prompt, n))
        if case is None:
            continue
        if prompt == prompts[-1]:
            case["messages"] = CHAT_MESSAGES
        st.log(f"greedy {case['prompt']!r} -> {case['full_greedy_text']!r} (fixture keeps {len(case['greedy_ids'])})")
        cases.append(case)
    fixture["greedy"] = cases
    (fixture_dir / "reference.json").write_text(json.dumps(fixture, indent=1) + "\n")
    return fixture


def reference_stages(st: State, model_dir: Path, fixture_dir: Path, model_rel: str, raw_experts: dict, eval_loss):
    """On the exported files: agreement, fixtures, then (time permitting) the reference's held-out losses."""
    sm = st.summary
    cfg, weights = load_checkpoint(model_dir)
    ref = K3Reference(cfg, weights, dtype=torch.float32)
    checks = sm.setdefault("reference", {})
    win = st.windows[0][: min(256, st.windows.shape[1])]
    t = time.time()
    checks["agreement"] = guard(st, "reference: training forward vs reference", lambda: agreement(st, ref, win))
    sec_per_token = (time.time() - t) / win.numel()
    sm["fixture"] = guard(st, "fixtures", lambda: write_fixtures(st, ref, fixture_dir, model_rel, sec_per_token))
    ref_windows = st.windows[: st.args.ref_windows]
    need = 1.5 * sec_per_token * ref_windows.numel()
    checks["reference_tokens"] = int(ref_windows.shape[0] * (ref_windows.shape[1] - 1))
    with exact_fp32():
        checks["training_forward_loss_same_windows"] = guard(
            st, "eval: training forward on the reference's windows", lambda: eval_loss(st.model, ref_windows, st.device, amp=False))
    if affordable(st, "reference: held-out loss (MXFP4)", need):
        checks["heldout_loss_after_mxfp4"] = guard(st, "reference: held-out loss (MXFP4)",
                                                   lambda: reference_loss(ref, ref_windows))

    def before():
        w = dict(weights)
        for name, v in raw_experts.items():
            for e in range(v.shape[0]):
                w[expert_names(name, e)] = v[e].cpu()
        return reference_loss(K3Reference(cfg, w, dtype=torch.float32), ref_windows)

    if affordable(st, "reference: held-out loss (unquantized experts)", need):
        checks["heldout_loss_before_mxfp4"] = guard(st, "reference: held-out loss (unquantized experts)", before)


# -- driver ------------------------------------------------------------------------------------------------


def finish(st: State, eval_loss):
    a, sm = st.args, st.summary
    bundle = st.work / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    model_rel = f"models/{a.name}"
    model_dir, fixture_dir = bundle / model_rel, bundle / FIXTURE_DIR
    sm.update({"name": a.name, "size": a.size, "parameters": st.n_params, "training": st.training})

    def ev():
        with exact_fp32():
            return eval_loss(st.model, st.windows, st.device, amp=False)

    sm["heldout_loss_trained_fp32"] = guard(st, "eval: trained weights (fp32)", ev)
    qr = guard(st, "quantize", lambda: quantize_and_round(st))
    if qr is None:
        sm["final"] = True
        return write_summary(st, bundle)
    quant, raw = qr
    sm["heldout_loss_before_mxfp4"] = guard(st, "eval: bf16 weights, unquantized experts", ev)
    set_experts(st, dequantized(quant, st.device))
    sm["heldout_loss_after_mxfp4"] = guard(st, "eval: bf16 weights, MXFP4 experts", ev)
    sm["eval_tokens"] = int(st.windows.shape[0] * (st.windows.shape[1] - 1))
    st.log(f"held-out loss (training forward, fp32): trained {sm['heldout_loss_trained_fp32']}, "
           f"before MXFP4 {sm['heldout_loss_before_mxfp4']}, after MXFP4 {sm['heldout_loss_after_mxfp4']}")
    sm["model_bytes"] = guard(st, "export", lambda: export_model(st, quant, model_dir))
    if sm["model_bytes"] is None:
        sm["final"] = True
        return write_summary(st, bundle)
    guard(st, "model card (before the reference stages)", lambda: k3_card.write(st, model_dir / "README.md"))
    write_summary(st, bundle)  # a first bundle, in case the reference stages overrun the session
    guard(st, "reference stages", lambda: reference_stages(st, model_dir, fixture_dir, model_rel, raw, eval_loss))
    guard(st, "model card", lambda: k3_card.write(st, model_dir / "README.md"))
    sm["final"] = True
    return write_summary(st, bundle)


def write_summary(st: State, bundle: Path):
    a, sm = st.args, st.summary
    sm["wall_seconds"] = round(time.time() - st.t0, 1)
    out = Path(a.bundle_out) if a.bundle_out else st.work
    out.mkdir(parents=True, exist_ok=True)
    if bundle.exists():
        tar_path = st.work / "bundle.tar"
        with tarfile.open(tar_path, "w") as tf:
            for p in sorted(bundle.rglob("*")):
                if p.is_file():
                    tf.add(p, arcname=str(p.relative_to(bundle)))
        data = tar_path.read_bytes()
        for old in out.glob("bundle.tar.part-*"):
            old.unlink()
        parts = []
        for i in range(0, len(data), PART_BYTES):
            part = out / f"bundle.tar.part-{i // PART_BYTES:02d}"
            part.write_bytes(data[i:i + PART_BYTES])
            parts.append(part.name)
        sm["bundle"] = {"parts": parts, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                        "unpack": "cat bundle.tar.part-* | tar -xf - -C <repo root>"}
    (out / "summary.json").write_text(json.dumps(sm, indent=1, default=str) + "\n")
    if not sm.get("final"):
        st.log(f"first bundle written to {out}: {(sm.get('bundle') or {}).get('parts')}")
        return sm
    print("==== SUMMARY ====")
    print(json.dumps(short_summary(sm), indent=1, default=str))
    return sm


def short_summary(sm: dict) -> dict:
    ref = sm.get("reference") or {}
    agr = ref.get("agreement") or {}
    fx = sm.get("fixture") or {}
    tr = sm.get("training") or {}
    return {"errors": sm.get("errors"), "steps": tr.get("steps"), "train_tokens_M": round((tr.get("tokens") or 0) / 1e6, 1),
            "train_seconds": tr.get("seconds"), "last_train_loss": tr.get("last_train_loss"),
            "heldout_loss_fp32/before/after_mxfp4": [sm.get("heldout_loss_trained_fp32"), sm.get("heldout_loss_before_mxfp4"),
                                                     sm.get("heldout_loss_after_mxfp4")],
            "reference_heldout_before/after": [ref.get("heldout_loss_before_mxfp4"), ref.get("heldout_loss_after_mxfp4")],
            "agreement_max_abs/ok": [agr.get("max_abs_logit_diff"), agr.get("ok")],
            "heldout_text_tokens/ppl": [(fx.get("perplexity") or {}).get("tokens"), (fx.get("perplexity") or {}).get("ppl")],
            "greedy": [c.get("full_greedy_text") for c in fx.get("greedy", [])],
            "model_bytes": sm.get("model_bytes"), "bundle": sm.get("bundle"), "wall_seconds": sm.get("wall_seconds")}
