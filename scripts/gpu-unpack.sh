#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu-pack/ copied from the machine that ran
# scripts/gpu-bundle.sh: rebuilds .gpu/ (every executable), writing the built-in model's bytes
# back into the binary from models/tiny.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu
tar -C .gpu -xJf .gpu-pack/gpu.tar.xz
python3 - <<'P'
at = int(open(".gpu-pack/model-offset").read())
model = open("models/tiny/model.safetensors", "rb").read()
with open(".gpu/deltamoe", "r+b") as f:
    f.seek(at)
    f.write(model)
P
chmod +x .gpu/*
ls -la .gpu
