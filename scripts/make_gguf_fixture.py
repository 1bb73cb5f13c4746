"""Writes fixtures/gguf_blocks: a small GGUF v3 file (gguf-py's writer) holding one tensor of
random blocks per type deltamoe reads and metadata of every value type, and reference.bin, the
tensors dequantized by gguf-py's reference dequantizers (f32, little-endian, tensors in name
order). The blocks are random bytes with finite f16 fields, so every code of every field occurs.

    pip install numpy gguf==0.19.0 && python3 scripts/make_gguf_fixture.py
"""
import os

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFWriter
from gguf.quants import dequantize

OUT = os.path.join(os.path.dirname(__file__), "..", "fixtures", "gguf_blocks")

# (type, block values, block bytes, byte offsets of the block's f16 fields)
BLOCKS = [
    (T.Q4_0, 32, 18, [0]),
    (T.Q4_1, 32, 20, [0, 2]),
    (T.Q5_0, 32, 22, [0]),
    (T.Q5_1, 32, 24, [0, 2]),
    (T.Q8_0, 32, 34, [0]),
    (T.Q4_K, 256, 144, [0, 2]),
    (T.Q5_K, 256, 176, [0, 2]),
    (T.Q6_K, 256, 210, [208]),
    (T.IQ4_NL, 32, 18, [0]),
    (T.IQ4_XS, 256, 136, [0]),
]


def main():
    rng = np.random.default_rng(0)
    os.makedirs(OUT, exist_ok=True)
    w = GGUFWriter(os.path.join(OUT, "blocks.gguf"), "qwen35moe")
    w.add_uint32("test.u32", 7)
    w.add_int32("test.i32", -5)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo")
    w.add_array("test.strings", ["a", "bc", ""])
    w.add_array("test.ints", [1, 2, 3])
    w.add_uint64("test.u64", 1 << 40)
    w.add_float64("test.f64", -1.5)
    refs = {}
    # Two rows of 512 values each (three for the 32-value types: odd block counts).
    for qtype, block, nbytes, halves in BLOCKS:
        rows, cols = (3, 96) if block == 32 else (2, 512)
        nb = rows * cols // block
        raw = rng.integers(0, 256, size=(nb, nbytes), dtype=np.uint8)
        for at in halves:
            h = rng.uniform(-1.0, 1.0, size=nb).astype(np.float16)
            raw[:, at:at + 2] = h.view(np.uint8).reshape(nb, 2)
        raw = raw.reshape(rows, cols // block * nbytes)
        name = f"blk.{qtype.name.lower()}"
        w.add_tensor(name, raw, raw_dtype=qtype)
        refs[name] = dequantize(raw, qtype).astype(np.float32).reshape(-1)
    for name, dtype, qtype in [("dense.f32", np.float32, T.F32), ("dense.f16", np.float16, T.F16)]:
        x = rng.uniform(-2.0, 2.0, size=(5, 7)).astype(dtype)
        w.add_tensor(name, x, raw_dtype=qtype)
        refs[name] = x.astype(np.float32).reshape(-1)
    bits = rng.integers(0, 1 << 16, size=(3, 9), dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] &= 0xBFFF  # no inf or NaN
    w.add_tensor("dense.bf16", bits.view(np.uint8).reshape(3, 18), raw_dtype=T.BF16)
    refs["dense.bf16"] = dequantize(bits.view(np.uint8).reshape(3, 18), T.BF16).astype(np.float32).reshape(-1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(os.path.join(OUT, "reference.bin"), "wb") as f:
        for name in sorted(refs):
            f.write(refs[name].astype("<f4").tobytes())


if __name__ == "__main__":
    main()
