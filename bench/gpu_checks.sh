#!/usr/bin/env bash
# GPU checks on a machine with an H100/H200, from binaries built elsewhere (BIN, default build/bin):
# the five gpu test binaries, then compute-sanitizer memcheck and racecheck on a small plan (the
# megakernel and eager), on split-KV MLA at the real head shape and on chunked KDA (tensor-core phases,
# strong decays; 132 workers at the 48B head dim), on the fused KDA decode op, on Block AttnRes and on MXFP4 routed experts. Logs go to OUT (default /tmp/plow-gpu); a summary is printed last.
# plow and cuda_server_tests link Debian's libcpp-httplib.so.0.11 (and brotli), which the GPU machine's
# Ubuntu lacks: copy them along and put their folder on LD_LIBRARY_PATH (a binary that cannot start
# reports rc 127 and the loader's message below).
set -u
BIN=${BIN:-build/bin}
OUT=${OUT:-/tmp/plow-gpu}
mkdir -p "$OUT"
export PLOW_TEST_DATA=${PLOW_TEST_DATA:-$PWD/tests/data}
summary=()
run() {  # name timeout command...
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc $rc, $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$name.log" | tr '\n' ' ')$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$name.log" | tr '\n' ' ')$( [ $rc -eq 127 ] && head -c 300 "$OUT/$name.log")")
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
run gemv_tests 240 "$BIN/cuda_gemv_tests"
run ops_tests 120 "$BIN/cuda_ops_tests"
run model_tests 300 "$BIN/cuda_model_tests"
run prefill_tests 300 "$BIN/cuda_prefill_tests"
run server_tests 120 "$BIN/cuda_server_tests"
small='Fixtures/CudaModelTest.RunToRunBitIdentical/tiny_kimi_linear_w7_'
run memcheck_mega 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_model_tests" --gtest_filter="${small}mega"
run memcheck_eager 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_model_tests" --gtest_filter="${small}eager"
run racecheck_mega 120 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/cuda_model_tests" --gtest_filter="${small}mega"
# MLA split-KV with the tensor-core B item and the vector W_UV rows (bf16, the real head shape), both modes.
mla='MlaLong/CudaMlaLongTest.MatchesReference/h2_rank512_ctx700_b3_w3_bf16'
run memcheck_mla 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_ops_tests" --gtest_filter="$mla"
run racecheck_mla 180 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/cuda_ops_tests" --gtest_filter="$mla"
kda='Ops/CudaOpTest.MatchesReference/kda_prefill_h2_d64_strong_f32_*'  # the worker count suffix follows the case's index
run memcheck_kda 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_ops_tests" --gtest_filter="$kda:*kda_prefill_h4_d128_bounded_bf16_w132"
run racecheck_kda 180 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/cuda_ops_tests" --gtest_filter="$kda"
# The fused KDA decode op: a task per (sequence, head) owning its conv windows (the 48B head shape on 132
# workers with the output norm, a kernel-3 case whose head dim, 24, pads to 32, and d = 22, whose
# one-token pairs load the state without cp.async).
fused='Ops/CudaOpTest.MatchesReference/kda_fused_core_h4_d128*:Ops/CudaOpTest.MatchesReference/kda_fused_core_h1_d24_f21_k3_norm*:Ops/CudaOpTest.MatchesReference/kda_fused_core_h2_d22*'
run memcheck_fused_core 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_ops_tests" --gtest_filter="$fused"
run racecheck_fused_core 180 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/cuda_ops_tests" --gtest_filter="$fused"
# Block AttnRes: its phases' hand-offs through the workspace at K3's width and depth on 132 workers.
ar='Ops/CudaOpTest.MatchesReference/attn_res_*_j9_w7168*'
run memcheck_attn_res 120 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_ops_tests" --gtest_filter="$ar"
run racecheck_attn_res 180 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/cuda_ops_tests" --gtest_filter="$ar"
# MXFP4 routed experts: lane groups a row (1, 2 and 16 lanes, lanes one block short), gate/up and down.
mx='Ops/CudaGemvTest.MatchesTheReference/moe_down_64x96_mxfp4_F32:Ops/CudaGemvTest.MatchesTheReference/moe_down_add_1056x160_mxfp4_BF16'
run memcheck_mxfp4 240 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_gemv_tests" --gtest_filter="$mx"
run racecheck_mxfp4 240 compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/cuda_gemv_tests" --gtest_filter="$mx"
for line in "${summary[@]}"; do echo "$line"; done
grep -h -E '^\[  FAILED  \]' "$OUT"/*_tests.log | sort -u | head -40
