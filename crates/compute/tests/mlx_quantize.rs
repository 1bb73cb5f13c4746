//! Packing parity with mlx: `fixtures/quant/mlx_quantize.safetensors` holds random matrices
//! (odd row counts, plus constant, zero, outlier, tiny, all-negative and |min| = |max| rows) in
//! bf16/f16/f32 and the words, scales and biases `mlx.core.quantize` made of them for every
//! bits in {2, 3, 4, 5, 6, 8} and group size in {32, 64, 128} (scripts/make_quant_fixtures.py).
//! Our `quantize` must reproduce all three bit for bit, and dequantizing must give back what
//! mlx's words and scales mean.

use std::path::Path;

use deltamoe_compute::cpu::quant::quantize;
use deltamoe_compute::dtype::{bf16_to_f32, f32_to_bf16};
use deltamoe_compute::quant::{AffineWeight, PackedWords};
use deltamoe_compute::Tensor;
use safetensors::{Dtype, SafeTensors};

struct Case {
    bits: u32,
    group_size: usize,
}

fn as_f32(st: &SafeTensors, name: &str) -> (Vec<f32>, Vec<usize>, Dtype) {
    let t = st.tensor(name).unwrap();
    let d = t.data();
    let v = match t.dtype() {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        other => panic!("{name}: unexpected dtype {other:?}"),
    };
    (v, t.shape().to_vec(), t.dtype())
}

/// Bit patterns of an f32 rounded to the stored dtype, widened to u32 for comparison.
fn stored_bits(v: f32, dtype: Dtype) -> u32 {
    match dtype {
        Dtype::F32 => v.to_bits(),
        Dtype::BF16 => f32_to_bf16(v) as u32,
        _ => half::f16::from_f32(v).to_bits() as u32,
    }
}

fn raw_bits(st: &SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    match t.dtype() {
        Dtype::F32 | Dtype::U32 => t
            .data()
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        _ => t
            .data()
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
            .collect(),
    }
}

#[test]
fn quantize_reproduces_mlx_bit_for_bit() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/quant/mlx_quantize.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let cases: Vec<serde_json::Value> = serde_json::from_str(
        meta.metadata()
            .as_ref()
            .and_then(|m| m.get("cases"))
            .unwrap(),
    )
    .unwrap();
    let cases: Vec<Case> = cases
        .iter()
        .map(|c| Case {
            bits: c["bits"].as_u64().unwrap() as u32,
            group_size: c["group_size"].as_u64().unwrap() as usize,
        })
        .collect();
    assert_eq!(cases.len(), 54);
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut compared = [0usize; 3];
    for (i, c) in cases.iter().enumerate() {
        let (w, shape, dtype) = as_f32(&st, &format!("{i}.w"));
        let (rows, cols) = (shape[0], shape[1]);
        let q = quantize(&w, cols, c.group_size, c.bits).unwrap();
        let want_words = raw_bits(&st, &format!("{i}.words"));
        let want_s = raw_bits(&st, &format!("{i}.scales"));
        let want_b = raw_bits(&st, &format!("{i}.biases"));
        let what = format!("case {i}: {dtype:?} bits {} group {}", c.bits, c.group_size);
        assert_eq!(q.words, want_words, "{what}: words");
        let got_s: Vec<u32> = q.scales.iter().map(|&v| stored_bits(v, dtype)).collect();
        let got_b: Vec<u32> = q.biases.iter().map(|&v| stored_bits(v, dtype)).collect();
        assert_eq!(got_s, want_s, "{what}: scales");
        assert_eq!(got_b, want_b, "{what}: biases");
        compared[0] += want_words.len();
        compared[1] += want_s.len() * 2;
        compared[2] += 1;

        // mlx's own words/scales/biases, dequantized by us, stay within one step of the input.
        let (s, _, _) = as_f32(&st, &format!("{i}.scales"));
        let (b, _, _) = as_f32(&st, &format!("{i}.biases"));
        let gpr = cols / c.group_size;
        let aw = AffineWeight::new(
            c.bits,
            c.group_size,
            rows,
            cols,
            PackedWords::from_vec(want_words),
            Tensor::from_f32(vec![rows, gpr], s.clone()),
            Tensor::from_f32(vec![rows, gpr], b),
        )
        .unwrap();
        for (k, (x, y)) in w.iter().zip(aw.dequantize()).enumerate() {
            let step = s[k / c.group_size].abs();
            // Half a step, or one step where the far end is clipped, plus the scale's own rounding
            // to the stored dtype (up to 2^-9 relative in bf16, times q < 256).
            let tol = 1.6 * step + 1e-6;
            assert!((x - y).abs() <= tol, "{what}: element {k}: {x} vs {y}");
        }
    }
    eprintln!(
        "{} cases: {} words and {} scales/biases identical to mlx",
        compared[2], compared[0], compared[1]
    );
}
