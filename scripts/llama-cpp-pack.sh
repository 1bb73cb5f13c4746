#!/usr/bin/env bash
# llama-cpp-pack.sh SDIST_DIR OUT.tar.xz: the part of llama-cpp-python's vendored llama.cpp
# (SDIST_DIR: the unpacked PyPI sdist) that builds llama-bench and llama-batched-bench with CUDA,
# plus its gguf-py (scripts/make_synthetic_gguf.py --gguf-py), xz-packed small enough to carry to
# the GPU machine beside the checkout and a deltamoe binary (docs/benchmarks.md, the same file in
# both). Left out: docs, models, tests, examples, the other tools and every ggml backend but the
# CPU and CUDA ones (the CPU build of the two tools from the pack was checked here). On the GPU
# machine:
#   tar -xJf OUT.tar.xz && cmake -S llama.cpp -B lb -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
#     -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
#     -DLLAMA_OPENSSL=OFF \
#     && cmake --build lb -j --target llama-bench llama-batched-bench
set -euo pipefail
src=$1/vendor/llama.cpp
out=$(realpath -m "$2")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
t=$tmp/llama.cpp
mkdir -p "$t/tools"
for d in CMakeLists.txt LICENSE cmake common ggml gguf-py include licenses src vendor; do
  cp -r "$src/$d" "$t/"
done
cp -r "$src/tools/llama-bench" "$src/tools/batched-bench" "$t/tools/"
printf 'llama_add_compile_flags()\nadd_subdirectory(batched-bench)\nadd_subdirectory(llama-bench)\n' \
  >"$t/tools/CMakeLists.txt"
for d in "$t"/ggml/src/ggml-*/; do
  case $(basename "$d") in ggml-cpu | ggml-cuda) ;; *) rm -rf "$d" ;; esac
done
tar -C "$tmp" -cf - llama.cpp | xz -T0 -9 >"$out"
ls -la "$out"
