#!/usr/bin/env bash
# The GPU path on a real NVIDIA card, in one prepared run (issue 34): a ~1B
# transformers model served by a real engine process against transformers' own
# `generate` (bench/gpu_check.py says what is measured).
#
#   scripts/gpu_check.sh prepare   # here, with the network and `make setup` done:
#                                  # wheels into .whl/, the tokenizer into .gpu_check/
#   scripts/gpu_check.sh           # there, with no network: install the carried
#                                  # wheels, run the check (extra arguments go to
#                                  # bench/gpu_check.py, e.g. --device cpu --tiny)
#
# Both folders are ignored (.git/info/exclude) and travel as carried paths. The
# table goes to $OUT/gpu_check.txt, everything printed to $OUT/log.txt, the
# engine's own log to $OUT/engine.log (OUT defaults to var/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "[$(date -u +%H:%M:%S)] $*"; }

prepare() {
  local py=${ROUNDHOUSE_VENV:-.venv}/bin/python
  # What the engine imports that the GPU machine's image lacks or holds in
  # another version (its transformers predates the `cache=` argument that
  # engines/backends/hf.py passes), at the versions this venv was built with.
  local names=(pydantic pydantic-core annotated-types typing-inspection
    typing-extensions llguidance transformers)
  local pins=()
  for name in "${names[@]}"; do
    pins+=("$name==$($py -c 'import sys, importlib.metadata as m; print(m.version(sys.argv[1]))' "$name")")
  done
  say "downloading ${pins[*]} for CPython 3.12 x86-64 into .whl/"
  rm -rf .whl && mkdir -p .whl
  $py -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
  say "saving SmolLM2's tokenizer (from the bundled GGUF) into .gpu_check/tokenizer"
  $py - <<'EOF'
from transformers import AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(
    "var/models", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", local_files_only=True
)
tokenizer.save_pretrained(".gpu_check/tokenizer")
EOF
  du -sh .whl .gpu_check
}

check() {
  local py=${PYTHON:-python3}
  say "$(uname -srm); $($py -V)"
  nvidia-smi --query-gpu=name,uuid,memory.total,memory.used,driver_version \
    --format=csv || say "no nvidia-smi"
  # The carried wheels whose version this Python does not have already.
  local wanted
  wanted=$("$py" - <<'EOF'
import importlib.metadata as metadata
from pathlib import Path

for wheel in sorted(Path(".whl").glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        present = metadata.version(name)
    except metadata.PackageNotFoundError:
        present = None
    if present != version:
        print(wheel)
EOF
)
  if [[ -n $wanted ]]; then
    local site=/tmp/gpu_check_site
    say "installing into $site:" $wanted
    # shellcheck disable=SC2086 - one path per word
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$site" $wanted
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  fi
  say "GGUF on CUDA: skipped (a CUDA build of llama-cpp-python does not fit this run)"
  say "running bench/gpu_check.py $*"
  PYTHONUNBUFFERED=1 timeout -k 20 "${GPU_CHECK_TIMEOUT_S:-450}" \
    "$py" bench/gpu_check.py --out "$OUT" "$@"
}

if [[ ${1:-} == prepare ]]; then
  prepare
  exit
fi
OUT=${OUT:-var/gpu_check}
mkdir -p "$OUT"
check "$@" 2>&1 | tee "$OUT/log.txt"
