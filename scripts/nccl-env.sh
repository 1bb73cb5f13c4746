# Source before running deltamoe on several GPUs (`--gpus`) on the GPU machine.
# NVLink multicast stays off (the machines here require it).
export NCCL_NVLS_ENABLE=0
# deltamoe loads libnccl.so: the system's, or else pip's nvidia-nccl package's libnccl.so.2
# linked under that name.
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  so=$(python3 -c 'import glob, site; f = [g for p in site.getsitepackages() for g in glob.glob(p + "/nvidia/nccl/lib/libnccl.so.2")]; print(f[0] if f else "")' 2>/dev/null)
  if [ -n "$so" ]; then
    d=$(mktemp -d) && ln -s "$so" "$d/libnccl.so" && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
  fi
fi
