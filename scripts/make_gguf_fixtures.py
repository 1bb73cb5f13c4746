"""GGUF fixtures made by llama.cpp's own converter: each HF fixture of the Qwen3 hybrid family
through `convert_hf_to_gguf.py` as F32 (the exact oracle) and Q8_0, into fixtures/gguf/.

Needs torch and transformers (the GPU machine has them) and a llama.cpp tree: llama-cpp-python's
sdist vendors one (vendor/llama.cpp: convert_hf_to_gguf.py, conversion/, gguf-py/). The tiny
fixtures' tokenizers are not among the converter's known pre-tokenizers (it hashes a test
string's tokens): they are registered as `qwen35` here, the name Qwen3.5's own tokenizer gets.
Fixtures without tokenizer files get qwen3_5_moe's (the converter pads the vocabulary to the
config's). Models without MTP tensors are converted with --no-mtp.

    python3 scripts/make_gguf_fixtures.py LLAMA_CPP_DIR [OUT_DIR]
"""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FIXTURES = ["qwen3_5_moe", "qwen3_next", "qwen3_5_dense", "mtp_qwen3_5_moe", "mtp_qwen3_next"]
TOKENIZER = ["tokenizer.json", "tokenizer_config.json"]

# Run inside the converter's process: its module, then its main with the tokenizer registered.
SHIM = """
import sys, runpy
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[1] + "/gguf-py")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def has_mtp(d):
    import json

    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        names = json.load(open(idx))["weight_map"].keys()
    else:
        from safetensors import safe_open

        with safe_open(os.path.join(d, "model.safetensors"), "np") as f:
            names = list(f.keys())
    return any(n.startswith("mtp.") and n != "mtp.fc.weight" for n in names)


def main():
    llama = os.path.abspath(sys.argv[1])
    out = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "fixtures", "gguf"))
    os.makedirs(out, exist_ok=True)
    for name in FIXTURES:
        src = os.path.join(ROOT, "fixtures", name)
        with tempfile.TemporaryDirectory() as tmp:
            d = os.path.join(tmp, name)
            shutil.copytree(src, d)
            for t in TOKENIZER:
                if not os.path.exists(os.path.join(d, t)):
                    shutil.copy(os.path.join(ROOT, "fixtures", "qwen3_5_moe", t), d)
            extra = [] if has_mtp(d) else ["--no-mtp"]
            for outtype in ["f32", "q8_0"]:
                dst = os.path.join(out, f"{name}.{outtype}.gguf")
                cmd = [sys.executable, "-c", SHIM, llama, d, "--outtype", outtype, "--outfile", dst] + extra
                r = subprocess.run(cmd, capture_output=True, text=True)
                status = "ok" if r.returncode == 0 else "FAILED"
                print(f"{name} {outtype}: {status}")
                if r.returncode != 0:
                    print(r.stderr[-3000:])


if __name__ == "__main__":
    main()
