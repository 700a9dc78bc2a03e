#!/usr/bin/env python3
"""Train plow's bundled model: a small K3-architecture code model (every K3 feature on: AttnRes,
LatentMoE, gated MLA, SiTU, bounded and full-rank KDA gates, MXFP4 experts) on the Python sources of
installed, permissively licensed packages, then export it in the real K3 checkpoint layout with a
byte-level BPE tokenizer and chat template, and write the reference fixtures that plow's tests use.

    # GPU machine (one H200): ~6 min of training inside a 555 s wall budget for everything
    python3 tests/reference/train_k3.py --work /tmp/k3 --bundle-out $OUT --train-seconds 420 --total-seconds 555
    # development on a CPU: tiny model, tiny corpus
    python tests/reference/train_k3.py --work /tmp/k3 --size tiny --corpus-mb 4 --train-seconds 60 --device cpu

Stages (each logged with its wall time): corpus -> tokenizer -> encode -> train (stops on the time
budget) -> evaluate with the training forward (fp32) before and after MXFP4 -> export -> reference checks
with k3_reference.py on the exported files (training forward vs reference logits; held-out loss before
and after MXFP4; the held-out text's perplexity; greedy continuations of five prompts) -> model card ->
bundle (tar split into parts of at most 15 MB) and summary.json. Every stage after training is guarded:
a failure is reported in the summary, never loses the trained weights.
"""

from __future__ import annotations

import time

T0 = time.time()  # before the heavy imports: --total-seconds counts from here

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import k3_bundle  # noqa: E402
import k3_corpus  # noqa: E402
from k3_reference import K3Config  # noqa: E402
from k3_train_model import NO_DECAY, K3Train, root_config, text_config  # noqa: E402


def log(msg: str):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="scratch directory (model dir and fixtures are written here)")
    ap.add_argument("--bundle-out", help="where the bundle parts, summary.json and log copies go (e.g. $OUT)")
    ap.add_argument("--name", default="plow-k3-code-small", help="model directory name under models/")
    ap.add_argument("--size", default="small", choices=["small", "tiny"])
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    ap.add_argument("--train-seconds", type=float, default=400.0, help="training time budget (wall)")
    ap.add_argument("--total-seconds", type=float, default=0.0,
                    help="deadline for the whole script from its start: training stops early enough to leave "
                         "--reserve-seconds for export and checks (0 = no deadline)")
    ap.add_argument("--reserve-seconds", type=float, default=150.0)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--qat-frac", type=float, default=0.2, help="last fraction of training with fake-MXFP4 experts")
    ap.add_argument("--router-bias-rate", type=float, default=1e-3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--corpus-mb", type=float, default=120.0)
    ap.add_argument("--per-package-mb", type=float, default=30.0)
    ap.add_argument("--tokenizer-mb", type=float, default=24.0, help="train text used to learn the BPE merges")
    ap.add_argument("--chat-examples", type=int, default=6000)
    ap.add_argument("--heldout-tokens", type=int, default=2048, help="tokens of the held-out text fixture")
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows of --seq-len for eval losses")
    ap.add_argument("--ref-windows", type=int, default=4, help="held-out windows the reference evaluates")
    ap.add_argument("--gen-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--placeholder", action="store_true", help="mark the model card as a CPU placeholder")
    return ap.parse_args(argv)


# -- data ----------------------------------------------------------------------------------------------


def prepare_data(args, work: Path):
    corpus = k3_corpus.collect(int(args.corpus_mb * 1e6), int(args.per_package_mb * 1e6), log=log)
    if not corpus.train or not corpus.heldout:
        raise SystemExit(f"corpus too small: {len(corpus.train)} train / {len(corpus.heldout)} held-out files")
    log(f"corpus: {len(corpus.train)} train files, {len(corpus.heldout)} held-out files; skipped {corpus.skipped}")
    chats = k3_corpus.chat_examples(corpus.train, args.chat_examples, seed=args.seed)
    log(f"chat examples: {len(chats)}")
    rng = np.random.default_rng(args.seed)
    tok_texts, budget = [], args.tokenizer_mb * 1e6
    for i in rng.permutation(len(corpus.train)):
        tok_texts.append(corpus.train[i][1])
        budget -= len(corpus.train[i][1])
        if budget <= 0:
            break
    tok = k3_corpus.train_tokenizer(tok_texts + chats[:500], args.vocab)
    log(f"tokenizer: vocab {tok.get_vocab_size()} trained on {len(tok_texts)} files")
    docs = [t for _, t in corpus.train] + chats
    order = rng.permutation(len(docs))
    train_ids = k3_corpus.encode_documents(tok, [docs[i] for i in order], eot_id=0)
    held_ids = k3_corpus.encode_documents(tok, [t for _, t in corpus.heldout], eot_id=0)
    train_bytes = sum(len(t.encode()) for t in docs)
    log(f"encoded: {train_ids.size / 1e6:.2f}M train tokens ({train_bytes / max(1, train_ids.size):.2f} bytes/token), "
        f"{held_ids.size / 1e6:.3f}M held-out tokens")
    return corpus, tok, train_ids, held_ids, len(chats)


def eval_windows(held_ids: np.ndarray, n: int, seq_len: int) -> torch.Tensor:
    """n held-out windows of seq_len + 1 tokens, evenly spaced over the held-out stream."""
    n = max(1, min(n, (held_ids.size - 1) // (seq_len + 1)))
    starts = np.linspace(0, held_ids.size - seq_len - 1, n).astype(np.int64)
    return torch.from_numpy(np.stack([held_ids[s:s + seq_len + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def eval_loss(model, windows: torch.Tensor, device, amp: bool, batch: int = 16) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(w[:, :-1])
        total += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"))
        count += w[:, 1:].numel()
    model.train()
    return total / count


# -- training ------------------------------------------------------------------------------------------


def train(args, model: K3Train, train_ids: np.ndarray, windows: torch.Tensor, device, deadline: float):
    amp = device.type == "cuda"
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    decay, no_decay = [], []
    for name, p in model.named_weights().items():
        (no_decay if any(name.endswith(s) for s in NO_DECAY) else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=amp)
    data = torch.from_numpy(train_ids.astype(np.int64)).to(device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    T, B = args.seq_len, args.batch
    offsets = torch.arange(T + 1, device=device)
    t_start = time.time()
    budget = max(1.0, min(args.train_seconds, deadline - t_start))
    log(f"training: budget {budget:.0f}s, batch {B}x{T}, lr {args.lr}, device {device}")
    history, step, tokens, last_eval, last_log = [], 0, 0, t_start, t_start
    loss_f = float("nan")
    while True:
        frac = (time.time() - t_start) / budget
        if frac >= 1.0:
            break
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for gr in opt.param_groups:
            gr["lr"] = lr
        model.fake_quant_experts = args.qat_frac > 0 and frac >= 1.0 - args.qat_frac
        starts = torch.randint(0, data.numel() - T - 1, (B,), device=device, generator=gen)
        batch = data[starts.unsqueeze(1) + offsets]
        try:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except torch.OutOfMemoryError:
            if step > 2 or B <= 8:
                raise
            logits = loss = None
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            B //= 2
            log(f"out of memory: batch halved to {B}")
            continue
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.update_router_bias(args.router_bias_rate)
        step += 1
        tokens += B * T
        now = time.time()
        if step % 25 == 0 or step == 1 or now - last_log > 20:
            loss_f = loss.item()
            if not math.isfinite(loss_f):
                raise RuntimeError(f"loss is {loss_f} at step {step}")
            last_log = now
            log(f"step {step} loss {loss_f:.4f} gnorm {float(gnorm):.2f} lr {lr:.2e} "
                f"{tokens / (now - t_start) / 1e3:.0f}k tok/s qat={model.fake_quant_experts}")
        if now - last_eval > max(45.0, budget / 6):
            last_eval = now
            ev = eval_loss(model, windows[:16], device, amp)
            history.append({"step": step, "seconds": round(now - t_start, 1), "train_loss": round(loss_f, 4),
                            "heldout_loss": round(ev, 4)})
            log(f"eval step {step}: held-out loss {ev:.4f}")
    seconds = time.time() - t_start
    model.fake_quant_experts = False  # evaluations choose their expert weights explicitly
    log(f"training done: {step} steps, {tokens / 1e6:.1f}M tokens, {seconds:.0f}s")
    return {"steps": step, "tokens": tokens, "seconds": round(seconds, 1), "history": history,
            "last_train_loss": round(loss_f, 4), "batch": B, "seq_len": T, "peak_lr": args.lr,
            "warmup_steps": args.warmup_steps, "weight_decay": args.weight_decay, "qat_frac": args.qat_frac,
            "router_bias_rate": args.router_bias_rate, "optimizer": "AdamW(0.9, 0.95), clip 1.0, cosine to 10%",
            "autocast": "bf16" if amp else "fp32"}


def main(argv=None):
    args = parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    deadline = T0 + args.total_seconds - args.reserve_seconds if args.total_seconds > 0 else float("inf")
    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          (args.device if args.device != "auto" else "cpu"))
    torch.manual_seed(args.seed)
    log(f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(0)})" if device.type == "cuda" else ""))
    corpus, tok, train_ids, held_ids, n_chats = prepare_data(args, work)
    eot = 0
    tc = text_config(args.size, tok.get_vocab_size(), [eot, tok.token_to_id(k3_corpus.IM_END)],
                     tok.token_to_id(k3_corpus.PAD), 1 << 20)
    cfg = K3Config.from_dict(root_config(tc))
    model = K3Train(cfg, seed=args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, layers {cfg.num_hidden_layers}, hidden {cfg.hidden_size}")
    windows = eval_windows(held_ids, args.eval_windows, args.seq_len)
    try:
        trained = train(args, model, train_ids, windows, device, deadline)
    except Exception as e:  # noqa: BLE001 - one shot: keep what was trained if the weights are finite
        traceback.print_exc()
        finite = all(torch.isfinite(p).all() for p in model.parameters())
        log(f"training stopped by {type(e).__name__}: {e}; weights finite: {finite}")
        if not finite:
            raise
        model.fake_quant_experts = False
        trained = {"error": f"{type(e).__name__}: {e}", "steps": None, "tokens": None}
    # Everything below is guarded: the bundle is written with whatever succeeded.
    state = k3_bundle.State(args=args, work=work, cfg=cfg, root=root_config(tc), model=model, tok=tok,
                            corpus=corpus, train_tokens=int(train_ids.size), heldout_tokens=int(held_ids.size),
                            n_chats=n_chats, n_params=n_params, training=trained, windows=windows, device=device,
                            log=log, t0=T0)
    k3_bundle.finish(state, eval_loss)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
