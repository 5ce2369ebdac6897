#!/usr/bin/env bash
# Prints the CMAKE_ARGS llama-cpp-python is built with on this machine.
#
# llama.cpp's default native build turns on AMX kernels on CPUs that announce
# them, and in some VMs the first decode then crashes inside
# ggml_backend_amx_mul_mat. So we never build "native": on x86-64 we enable
# exactly the SIMD extensions /proc/cpuinfo lists and keep AMX off; elsewhere
# llama.cpp's defaults (no AMX exists there). ROUNDHOUSE_LLAMA_CMAKE_ARGS is
# appended (e.g. -DGGML_CUDA=ON on a CUDA host).
set -euo pipefail

args=""
if [[ "$(uname -m)" == "x86_64" && -r /proc/cpuinfo ]]; then
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  has() {  # every named cpuinfo flag is present
    local flag
    for flag in "$@"; do [[ "$flags" == *" $flag "* ]] || return 1; done
  }
  # ggml's AVX512 option compiles with F, CD, VL, DQ and BW together.
  for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 bmi2:BMI2 fma:FMA f16c:F16C \
              avx_vnni:AVX_VNNI \
              avx512f,avx512cd,avx512vl,avx512dq,avx512bw:AVX512 \
              avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
              avx512_bf16:AVX512_BF16; do
    IFS=, read -r -a needed <<< "${pair%%:*}"
    if has "${needed[@]}"; then state=ON; else state=OFF; fi
    args="$args -DGGML_${pair##*:}=$state"
  done
fi
echo "$args ${ROUNDHOUSE_LLAMA_CMAKE_ARGS:-}" | xargs
