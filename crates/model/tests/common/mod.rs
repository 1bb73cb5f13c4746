//! Shared by the model crate's integration tests: fixture paths, reference tensors and the
//! golden tolerance (5e-3·max|ref| with ≥ 98% argmax agreement).

#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// An f32 tensor of a reference file.
pub fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// An i64 token-id tensor of a reference file.
pub fn ids(st: &SafeTensors, name: &str) -> Vec<u32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

/// Asserts the tolerance; returns the relative max error.
pub fn check_logits(name: &str, got: &[f32], want: &[f32], vocab: usize) -> f32 {
    assert_eq!(got.len(), want.len(), "{name}: logits length");
    let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let argmax = |r: &[f32]| {
        r.iter()
            .enumerate()
            .fold(0, |bi, (i, v)| if *v > r[bi] { i } else { bi })
    };
    let rows = want.len() / vocab;
    let agree = got
        .chunks_exact(vocab)
        .zip(want.chunks_exact(vocab))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    eprintln!(
        "{name}: max err {max_err:.2e} of max|ref| {max_ref:.3} ({:.2e}), argmax {agree}/{rows}",
        max_err / max_ref
    );
    assert!(
        max_err <= 5e-3 * max_ref,
        "{name}: max err {max_err} > 5e-3 * {max_ref}"
    );
    assert!(
        agree * 100 >= rows * 98,
        "{name}: argmax agreement {agree}/{rows}"
    );
    max_err / max_ref
}
