//! FP8 decoding parity with torch: `fixtures/quant/fp8_cases.safetensors` holds torch's
//! float8_e4m3fn → f32 value of every byte, and random matrices (partial 128-blocks, outliers,
//! an all-zero block, subnormals, bf16-rounded scales) quantized the way Qwen's FP8 checkpoints
//! are, with torch's f32 dequantization `fp8.f32 · scale` (scripts/make_fp8_fixtures.py). Our
//! table and `Fp8Weight::dequantize` must reproduce both bit for bit.

use std::path::Path;

use deltamoe_compute::fp8::{e4m3_table, quantize_blocks, Bytes};
use deltamoe_compute::{DType, Fp8Weight};
use safetensors::SafeTensors;

fn f32s(st: &SafeTensors, name: &str) -> (Vec<f32>, Vec<usize>) {
    let t = st.tensor(name).unwrap();
    let v = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (v, t.shape().to_vec())
}

/// The `scale` note of case `i` in the file's `cases` metadata.
fn case_scale(i: usize) -> String {
    let (_, meta) = SafeTensors::read_metadata(st_bytes()).unwrap();
    let cases: serde_json::Value =
        serde_json::from_str(&meta.metadata().as_ref().unwrap()["cases"]).unwrap();
    cases[i]["scale"].as_str().unwrap_or("").to_string()
}

fn st_bytes() -> &'static [u8] {
    static BYTES: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BYTES.get_or_init(|| {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/quant/fp8_cases.safetensors");
        std::fs::read(path).unwrap()
    })
}

#[test]
fn e4m3_table_and_dequantization_match_torch_bit_for_bit() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/quant/fp8_cases.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (table, _) = f32s(&st, "e4m3.table");
    for (b, (&want, &got)) in table.iter().zip(e4m3_table().iter()).enumerate() {
        assert!(
            want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()),
            "byte {b:#04x}: {got} vs torch {want}"
        );
    }
    let mut cases = 0;
    while st.tensor(&format!("{cases}.fp8")).is_ok() {
        let i = cases;
        let codes = st.tensor(&format!("{i}.fp8")).unwrap();
        let [out, inp] = codes.shape() else {
            panic!("{i}.fp8 is not 2-D")
        };
        let (scales, grid) = f32s(&st, &format!("{i}.scale_inv"));
        assert_eq!(grid, vec![out.div_ceil(128), inp.div_ceil(128)]);
        let w = Fp8Weight::new(
            *out,
            *inp,
            [128, 128],
            Bytes::from_vec(codes.data().to_vec()),
            scales,
            DType::F32,
        )
        .unwrap();
        // Our quantizer reproduces torch's codes and scales from the source weights (case 4
        // rounded its scales to bf16 first; its codes are checked through `deq`).
        let note = case_scale(i);
        if !note.contains("bf16") {
            let (w, _) = f32s(&st, &format!("{i}.w"));
            let (codes_q, scales_q) = quantize_blocks(&w, *inp, [128, 128]);
            let (scales_t, _) = f32s(&st, &format!("{i}.scale_inv"));
            assert_eq!(scales_q, scales_t, "case {i}: scales");
            assert!(codes_q == codes.data(), "case {i}: codes");
        }
        let (want, _) = f32s(&st, &format!("{i}.deq"));
        let got = w.dequantize();
        let bad = got
            .iter()
            .zip(&want)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(
            bad.is_none(),
            "case {i} [{out}, {inp}]: first difference at {bad:?}"
        );
        // A row view keeps its block rows: rows 1.. of the matrix, dequantized alone.
        let v = w.rows(1, out - 1).dequantize();
        assert!(
            v.iter()
                .zip(&want[*inp..])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "case {i} rows 1.."
        );
        cases += 1;
    }
    assert!(cases >= 5, "expected the committed FP8 cases");
}
