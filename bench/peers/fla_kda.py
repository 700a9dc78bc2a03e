#!/usr/bin/env python3
"""The fla peer of `plow bench prefill` for KDA: fla's chunk_kda (Triton) on one layer's shape.

Times `fla.ops.kda.chunk_kda` on random inputs of the KDA layer's shape (one sequence of `tokens`
positions, `heads` heads of `dim`, bf16 q/k/v, fp32 log-decay g, bf16 beta, fp32 initial state, q/k
l2-normalized inside the kernel, final state returned): the same work as plow's kda_delta_rule op over
a prompt of that length on one layer. A call is several Triton kernels launched from Python, so up to
~8K tokens the host's launches can take longer than the kernels: "ms" is the time of CUDA graph
replays of one call when it captures ("timing" says which; "eager_ms" is the eager calls' time).
Prints one JSON array of records {"tokens", "ms", "timing", "eager_ms"} or {"tokens", "skipped":
reason} on stdout; progress on stderr. Run by `plow bench prefill --kda-peer '...'`
before plow takes the GPU. fla (fla-core, with einops) is not on the GPU machine: install its wheel with
`pip install --no-deps --target DIR` and put DIR on PYTHONPATH.
"""
import argparse
import json
import sys


def log(msg):
    print(f"fla_kda: {msg}", file=sys.stderr, flush=True)


def timed_ms(torch, call, reps):
    """Mean ms of `reps` calls of `call` between two events on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1024", help="comma-separated sequence lengths")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10, help="timed calls per length (after two warm-up calls)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    try:
        import torch
        import torch.nn.functional as F
        from fla.ops.kda import chunk_kda
        import fla
    except Exception as e:  # no fla or no Triton on this machine: a finding, not a crash of the benchmark
        print(json.dumps([{"tokens": t, "skipped": f"{type(e).__name__}: {str(e)[:200]}"} for t in lengths]))
        return
    log(f"fla {getattr(fla, '__version__', '?')}, torch {torch.__version__}")
    torch.manual_seed(args.seed)
    h, d = args.heads, args.dim
    records = []
    graphs = True  # until a capture fails: a failed capture is not tried again at the next length
    for t in lengths:
        try:
            q = torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16)
            g = F.logsigmoid(torch.randn(1, t, h, d, device="cuda", dtype=torch.float32))  # log-decay in (−∞, 0)
            beta = torch.sigmoid(torch.randn(1, t, h, device="cuda", dtype=torch.float32)).to(torch.bfloat16)
            s0 = torch.zeros(1, h, d, d, device="cuda", dtype=torch.float32)

            def call():
                return chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)

            with torch.no_grad():
                for _ in range(2):  # Triton compiles and autotunes here
                    call()
                torch.cuda.synchronize()
                eager_ms = timed_ms(torch, call, args.reps)
                record = {"tokens": t, "ms": eager_ms, "timing": "eager calls (the host's launch time may show)", "eager_ms": eager_ms}
                try:  # the GPU's time alone: chunk_kda is several kernels a call, launched from Python
                    if not graphs:
                        raise RuntimeError("a capture failed at a shorter length")
                    graph = torch.cuda.CUDAGraph()
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        call()
                    torch.cuda.current_stream().wait_stream(side)
                    with torch.cuda.graph(graph):
                        call()
                    graph.replay()
                    torch.cuda.synchronize()
                    record["ms"] = timed_ms(torch, graph.replay, args.reps)
                    record["timing"] = "CUDA graph replays (the GPU's time, no host launches)"
                except Exception as e:  # not capturable: the eager time stands, and says so
                    graphs = False
                    record["graph_refused"] = f"{type(e).__name__}: {str(e)[:200]}"
            records.append(record)
            log(f"{t} tokens x {h} heads x {d}: {record['ms']:.3f} ms ({record['timing']}; eager calls {eager_ms:.3f} ms)")
        except Exception as e:
            records.append({"tokens": t, "skipped": f"{type(e).__name__}: {str(e)[:200]}"})
            log(f"{t} tokens: {records[-1]['skipped']}")
        finally:
            torch.cuda.empty_cache()
    print(json.dumps(records))


if __name__ == "__main__":
    main()
