#!/usr/bin/env python3
"""The PyTorch SDPA peer of `plow bench prefill` for MLA: causal attention over a whole prompt.

Times `torch.nn.functional.scaled_dot_product_attention` (is_causal) on random bf16 q, k of head dim
`qk_dim` and v of `v_dim`, `heads` heads, one sequence of `tokens` positions: the attention work one
MLA layer does over a prompt of that length in the expanded form (plow's chunked prefill attends each
chunk to its cached prefix and itself: the same causal pairs). Tries the flash backend, then cuDNN,
then memory-efficient, and reports which ran. Prints one JSON array of records {"tokens", "ms",
"backend"} or {"tokens", "skipped": reason} on stdout; progress on stderr. Run by `plow bench prefill
--mla-peer '...'` before plow takes the GPU.
"""
import argparse
import json
import sys


def log(msg):
    print(f"sdpa_mla: {msg}", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024", help="comma-separated prompt lengths")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--qk-dim", type=int, default=192)
    ap.add_argument("--v-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10, help="timed calls per length (after two warm-up calls)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # no torch on this machine: a finding, not a crash of the benchmark
        print(json.dumps([{"tokens": t, "skipped": f"{type(e).__name__}: {str(e)[:200]}"} for t in lengths]))
        return
    torch.manual_seed(args.seed)
    h = args.heads
    scale = args.qk_dim ** -0.5  # MODEL.md: (d_nope + d_rope)^(-1/2)
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    records = []
    for t in lengths:
        record = {"tokens": t, "skipped": "no SDPA backend ran this shape"}
        q = torch.randn(1, h, t, args.qk_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, h, t, args.qk_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, h, t, args.v_dim, device="cuda", dtype=torch.bfloat16)
        failures = []
        for name, backend in backends:
            try:
                with torch.no_grad(), sdpa_kernel([backend]):
                    for _ in range(2):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(args.reps):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                    end.record()
                    torch.cuda.synchronize()
                record = {"tokens": t, "ms": start.elapsed_time(end) / args.reps, "backend": name}
                if failures:
                    record["backends_refused"] = failures
                log(f"{t} tokens x {h} heads, qk {args.qk_dim}, v {args.v_dim}: {record['ms']:.3f} ms ({name})")
                break
            except Exception as e:  # this backend does not take the shape (e.g. unequal head dims): the next
                failures.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
        if "skipped" in record:
            record["skipped"] += "; " + " | ".join(failures)
            log(f"{t} tokens: {record['skipped']}")
        del q, k, v
        torch.cuda.empty_cache()
        records.append(record)
    print(json.dumps(records))


if __name__ == "__main__":
    main()
