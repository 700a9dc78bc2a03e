#!/usr/bin/env python3
"""The HF transformers peer of `plow bench decode` (Kimi Linear shapes).

Builds the model from a config with random bf16 weights on the GPU (transformers' own modeling code,
with whatever kernels it falls back to when the hub kernels are absent), prefills `context` tokens per
sequence and times decode steps with the cache. Prints one JSON array of records
{"batch", "context", "ms_per_step"} or {"batch", "context", "skipped": reason} on stdout; progress on
stderr. Run by `plow bench decode --hf-peer '...'` after plow has freed the GPU, so that both are
measured in the same run on the same shape.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time


def log(msg):
    print(f"hf_decode: {msg}", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="config.json of the model (Moonshot or HF names)")
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--context", default="0", help="comma-separated cached tokens per sequence")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per point")
    ap.add_argument("--max-prefill-tokens", type=int, default=32768, help="skip points whose prefill (batch x context) is larger")
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip the remaining points once this much time has passed")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.time()
    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(args.config, os.path.join(tmp, "config.json"))
        config = AutoConfig.from_pretrained(tmp, trust_remote_code=False)
    config.torch_dtype = torch.bfloat16
    torch.manual_seed(args.seed)
    log(f"building {type(config).__name__} with random bf16 weights on the GPU")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.eval()
    log(f"model ready in {time.time() - start:.1f} s, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
    vocab = config.vocab_size
    for batch in batches:
        for context in contexts:
            point = {"batch": batch, "context": context}
            if batch * max(context, 1) > args.max_prefill_tokens:
                point["skipped"] = f"prefill of {batch}x{context} tokens exceeds --max-prefill-tokens {args.max_prefill_tokens}"
                records.append(point)
                continue
            if time.time() - start > args.budget_s:
                point["skipped"] = f"time budget of {args.budget_s:.0f} s spent"
                records.append(point)
                continue
            try:
                with torch.no_grad():
                    prompt = torch.randint(0, vocab, (batch, max(context, 1)), device="cuda")
                    out = model(input_ids=prompt, use_cache=True)
                    cache = out.past_key_values
                    token = out.logits[:, -1:].argmax(-1)
                    for _ in range(2):  # warm-up steps
                        out = model(input_ids=token, past_key_values=cache, use_cache=True)
                        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                    t0 = time.time()
                    for _ in range(args.steps):
                        out = model(input_ids=token, past_key_values=cache, use_cache=True)
                        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                    point["ms_per_step"] = (time.time() - t0) * 1e3 / args.steps
                    log(f"batch {batch} context {context}: {point['ms_per_step']:.2f} ms/step")
            except Exception as e:  # an OOM or a missing kernel is a finding, not a crash of the benchmark
                point["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
                log(f"batch {batch} context {context}: {point['skipped']}")
            finally:
                torch.cuda.empty_cache()
            records.append(point)
    print(json.dumps(records))


if __name__ == "__main__":
    main()
