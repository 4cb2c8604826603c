#!/bin/bash
# The GPU kit for one short lease (about 9 minutes on an H200): its checks in priority order, each under its own time
# limit, everything written under OUT (default: gpu_session/) and packed into OUT.tgz at the end.
#
#   bash scripts/gpu_session.sh [OUT]                 # the checks below
#   bash scripts/gpu_session.sh [OUT] long-context    # only scripts/gpu.py long-context (one call, under 9 minutes):
#       TRL's default and "auto" at 163,840 and 262,144 tokens and a StreamSFTTrainer LoRA run at 131,072, the
#       allocator capped at 78 GiB
#   bash scripts/gpu_session.sh [OUT] speed           # only scripts/gpu.py bench (one call, under 9 minutes), the
#       allocator capped at 78 GiB and stream as the trainers plan it (--planned): TRL's default and stream at 16k,
#       32k and 64k; then at 64k stream and stream + offload with keys/values recomputed (offload's cost, and what
#       capture saves); then stream recomputing at 16k and 32k; two measured steps per mode, a fresh process each
#   bash scripts/gpu_session.sh [OUT] compile         # torch_compile=True (one call, under 9 minutes): the compiled
#       layers' dropout replay on the card (tests/test_compiled_layers.py -k cuda, float64), then as the speed check
#       TRL's default compiled whole (as accelerate compiles it) and stream with its layers' per-chunk bodies compiled,
#       at 16k and 32k, then stream eager at the same lengths (whether compiling pays on the card)
#   bash scripts/gpu_session.sh [OUT] qlora           # QLoRA (NF4 base, bf16 compute, LoRA r 16 on every linear
#       layer), Qwen3-8B shapes, the allocator capped at 78 GiB, one optimizer step each: TRL's SFTTrainer (gradient
#       checkpointing) at 118,784 tokens (max-len puts its limit at 121,856), then StreamSFTTrainer with "auto" and
#       memory_budget 78GiB at 262,144 (about 8 minutes). Needs bitsandbytes under .whl/ too (its manylinux wheel,
#       43 MB, beside the others: under the 64 MiB a call carries)
#   bash scripts/gpu_session.sh [OUT] calibrate       # the time model's constants (sizing/plan.py) where the plan
#       must choose: stream at 98,304 tokens in chunks of 4096, 8192 and 16384, keys/values recomputed, then kept
#       (8192, 16384), fixed rather than planned (about 8 minutes)
#
# 1. tests/test_cuda.py with its JSON-lines report (exactness, kernels, offload, memory model): about 110 s;
# 2. scripts/gpu.py bench at 16k tokens, two measured steps per mode (the four modes' peak and time): about 120 s;
# 3. scripts/gpu.py profile at 16,000 tokens (a length no multiple of the chunk: cuDNN's padded last chunk): 80 s;
# 4. Qwen3.5-9B with LoRA, one stream step at the simulator's longest length in 78 GiB (234,496 tokens, chunk 2048,
#    memory_budget 78GiB: the two-node logit form the simulation ran), with the time left (about 4 minutes).
# Wheels under .whl/ (transformers, trl, datasets, peft and their needs: docs/benchmarks.md, the GPU kit) are installed first.
OUT=${1:-gpu_session}
T0=$SECONDS
mkdir -p "$OUT"
trap 'tar -czf "$OUT.tgz" -C "$OUT" . ; ls -la "$OUT"' EXIT
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, transformers, trl; print(sys.version.split()[0], torch.__version__, transformers.__version__, trl.__version__, torch.backends.cudnn.version())"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

if [ "${2:-}" = "long-context" ]; then
  echo "== scripts/gpu.py long-context"
  timeout 530 python3 scripts/gpu.py long-context --out-dir "$OUT" --timeout 120 > "$OUT/gpu_long_context.log" 2>&1
  echo "rc=$?"; tail -12 "$OUT/gpu_long_context.log"
  exit 0
fi

if [ "${2:-}" = "qlora" ]; then  # a real QLoRA step on either side of TRL's default's limit
  echo "== TRL's default, QLoRA, 118,784 tokens"
  timeout 200 python3 scripts/gpu.py long-context --out-dir "$OUT" --name gpu_qlora_trl_default --no-baseline \
    --lengths --quantize --trl-trainer --trainer-steps 1 --trainer-length 118784 --timeout 95 \
    > "$OUT/gpu_qlora_trl_default.log" 2>&1
  echo "rc=$?"; tail -4 "$OUT/gpu_qlora_trl_default.log"
  left=$((545 - (SECONDS - T0)))
  echo "== stream, QLoRA, 262,144 tokens ($left s)"
  timeout "$left" python3 scripts/gpu.py long-context --out-dir "$OUT" --name gpu_qlora_stream --no-baseline \
    --lengths --quantize --trainer-steps 1 --trainer-length 262144 --timeout $(((left - 10) / 2)) \
    > "$OUT/gpu_qlora_stream.log" 2>&1
  echo "rc=$?"; tail -4 "$OUT/gpu_qlora_stream.log"
  exit 0
fi

if [ "${2:-}" = "calibrate" ]; then  # the time model's chunk and capture costs where the plan must choose
  for kv in recompute capture; do
    for chunk in 4096 8192 16384; do
      [ "$kv/$chunk" = "capture/4096" ] && continue
      echo "== chunk $chunk, keys/values $kv"
      left=$((545 - (SECONDS - T0)))
      [ "$left" -gt 60 ] || break 2
      timeout "$left" python3 scripts/gpu.py bench --device cuda --memory-cap 78GiB --repeats 2 --no-max-len \
        --seq-len 98304 --mode stream --chunk $chunk --kv-mode $kv --time-budget $((left - 10)) --out-dir "$OUT" \
        --name "gpu_calibrate_${kv}_$chunk" > "$OUT/gpu_calibrate_${kv}_$chunk.log" 2>&1
      echo "rc=$?"; grep -A3 "^| mode" "$OUT/gpu_calibrate_${kv}_$chunk.log" | head -4
    done
  done
  exit 0
fi

if [ "${2:-}" = "speed" ] || [ "${2:-}" = "compile" ]; then
  # bench NAME SECONDS ARGS...: scripts/gpu.py bench with stream as the trainers plan it, in at most SECONDS
  bench() {
    local name=$1 most=$2 left; shift 2
    left=$((545 - (SECONDS - T0))); left=$((left < most ? left : most))
    echo "== $name at $((SECONDS - T0)) s ($left s)"
    [ "$left" -gt 40 ] || return 0
    timeout "$left" python3 scripts/gpu.py bench --device cuda --planned --memory-cap 78GiB --repeats 2 --no-max-len \
      --time-budget $((left - 15)) --out-dir "$OUT" --name "$name" "$@" > "$OUT/$name.log" 2>&1
    echo "rc=$?"; tail -14 "$OUT/$name.log"
  }
  if [ "${2:-}" = "compile" ]; then
    echo "== tests/test_compiled_layers.py -k cuda"
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_compiled_layers.py -k cuda \
      > "$OUT/test_compiled_cuda.log" 2>&1
    echo "rc=$?"; tail -4 "$OUT/test_compiled_cuda.log"
    bench gpu_compile 300 --seq-len 16384 32768 --mode checkpoint+chunked-loss stream --compile
    bench gpu_compile_eager 150 --seq-len 16384 32768 --mode stream
    exit 0
  fi
  bench gpu_speed 360 --seq-len 16384 32768 65536 --mode checkpoint+chunked-loss stream
  bench gpu_speed_recompute_64k 200 --seq-len 65536 --mode stream stream+offload --kv-mode recompute
  bench gpu_speed_recompute 200 --seq-len 16384 32768 --mode stream --kv-mode recompute
  exit 0
fi

echo "== tests/test_cuda.py"
STREAMBP_CUDA_REPORT="$OUT/test_cuda.jsonl" timeout 175 python3 -m pytest -q -p no:cacheprovider -rfs tests/test_cuda.py \
  > "$OUT/test_cuda.log" 2>&1
echo "rc=$?"; tail -15 "$OUT/test_cuda.log"

echo "== scripts/gpu.py bench at $((SECONDS - T0)) s"
timeout 175 python3 scripts/gpu.py bench --device cuda --seq-len 16384 --repeats 2 --no-max-len --time-budget 150 \
  --out-dir "$OUT" > "$OUT/gpu_bench.log" 2>&1
echo "rc=$?"; tail -12 "$OUT/gpu_bench.log"

echo "== scripts/gpu.py profile at $((SECONDS - T0)) s"
timeout 110 python3 scripts/gpu.py profile --configs trl stream:4096 --seq-len 16000 --repeats 2 --timeout 52 \
  --out-dir "$OUT" --name gpu_profile_16000 > "$OUT/gpu_profile.log" 2>&1
echo "rc=$?"; tail -8 "$OUT/gpu_profile.log"

rest=$((555 - (SECONDS - T0)))
echo "== Qwen3.5-9B, LoRA, 234,496 tokens in 78 GiB ($rest s left)"
if [ "$rest" -gt 60 ]; then
  spec='{"mode": "stream", "seq_len": 234496, "model": "qwen3.5-9b", "device": "cuda", "dtype": "bfloat16",
         "lora": true, "stream_chunk_size": 2048, "logits_chunk_size": 2048, "warmup_seq_len": 2048,
         "memory_budget": "78GiB"}'
  timeout "$rest" python3 streambp_trl/bench/worker.py "$spec" > "$OUT/qwen3_5_9b_lora_234496.log" 2>&1
  echo "rc=$?"; grep BENCH_BP_RESULT "$OUT/qwen3_5_9b_lora_234496.log" | cut -c1-1200
fi
echo "== done at $((SECONDS - T0)) s"
