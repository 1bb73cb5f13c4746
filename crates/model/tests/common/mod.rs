//! Shared by the model crate's integration tests: fixture paths, reference tensors and the
//! golden tolerance (5e-3·max|ref| with ≥ 98% argmax agreement).

#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};

use deltamoe_model::{Logits, Qwen3Hybrid};
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

/// Index of the largest value (the first of equals).
pub fn argmax(r: &[f32]) -> usize {
    r.iter()
        .enumerate()
        .fold(0, |bi, (i, v)| if *v > r[bi] { i } else { bi })
}

/// Max |got − want| and max |want|, the first asserted within 5e-3 of the second.
pub fn check_close(name: &str, got: &[f32], want: &[f32]) -> (f32, f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        max_err <= 5e-3 * max_ref,
        "{name}: max err {max_err} > 5e-3 * {max_ref}"
    );
    (max_err, max_ref)
}

/// Asserts the tolerance; returns the relative max error.
pub fn check_logits(name: &str, got: &[f32], want: &[f32], vocab: usize) -> f32 {
    let (max_err, max_ref) = check_close(name, got, want);
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
        agree * 100 >= rows * 98,
        "{name}: argmax agreement {agree}/{rows}"
    );
    max_err / max_ref
}

/// A writable copy of a fixture.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, d.path().join(p.file_name().unwrap())).unwrap();
    }
    d
}

pub fn edit_quantization(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

/// Rewrite `model.safetensors` without the tensors for which `drop` is true.
pub fn drop_tensors(dir: &Path, drop: impl Fn(&str) -> bool) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| !drop(n)).collect();
    let out = safetensors::serialize(kept, None).unwrap();
    std::fs::write(&p, out).unwrap();
    let _ = std::fs::remove_file(dir.join("model.safetensors.index.json"));
}

pub fn load_err(dir: &Path) -> String {
    let e = Qwen3Hybrid::load(dir)
        .err()
        .expect("load should fail")
        .to_string();
    assert!(!e.contains('\n'), "not one line: {e}");
    e
}

/// All-position logits of `tokens` fed to a fresh sequence in passes of `chunk`.
pub fn run_chunks(model: &Qwen3Hybrid, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut st = model.new_state();
    tokens
        .chunks(chunk)
        .flat_map(|c| model.forward(c, &mut st, Logits::All).unwrap())
        .collect()
}

/// Fixture `name` loaded, against its transformers reference: each prompt in one prefill, in
/// pure decode and in passes of 37, at the foundation tolerance ([`check_logits`]).
pub fn check_fixture(name: &str) {
    let dir = fixture(name);
    let model = Qwen3Hybrid::load(&dir).unwrap();
    let vocab = model.config().vocab_size;
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for i in 0..2 {
        let tokens = ids(&st, &format!("prompt{i}.tokens"));
        let logits = f32s(&st, &format!("prompt{i}.logits"));
        for chunk in [tokens.len(), 1, 37] {
            let got = run_chunks(&model, &tokens, chunk);
            check_logits(
                &format!("{name} prompt{i} chunk {chunk}"),
                &got,
                &logits,
                vocab,
            );
        }
    }
}
