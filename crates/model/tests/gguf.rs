//! The GGUF reader against gguf-py: `fixtures/gguf_blocks` (scripts/make_gguf_fixture.py) holds a
//! tensor of random blocks per type deltamoe reads and gguf-py's dequantization of each; every
//! value must be bit for bit gguf-py's. Malformed files fail with a message naming the file and
//! the fault.

use std::path::{Path, PathBuf};

use deltamoe_model::gguf::{GgufFile, Value};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf_blocks")
}

#[test]
fn every_block_type_dequantizes_bit_for_bit_as_gguf_py() {
    let dir = fixture();
    let f = GgufFile::open(&dir.join("blocks.gguf")).unwrap();
    let reference = std::fs::read(dir.join("reference.bin")).unwrap();
    let mut at = 0;
    assert_eq!(f.tensors.len(), 13);
    for (name, info) in &f.tensors {
        let got = f.f32(name).unwrap();
        let want: Vec<f32> = reference[at..at + 4 * info.len()]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        at += 4 * info.len();
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits());
        assert_eq!(differ.count(), 0, "{name} ({:?})", info.kind);
    }
    assert_eq!(at, reference.len());
    let q4k = f.info("blk.q4_k").unwrap();
    assert_eq!(
        (q4k.dims.clone(), q4k.shape()),
        (vec![512, 2], vec![2, 512])
    );
}

#[test]
fn metadata_of_every_value_type_reads_back() {
    let f = GgufFile::open(&fixture().join("blocks.gguf")).unwrap();
    let m = &f.metadata;
    assert_eq!(m["general.architecture"].as_str(), Some("qwen35moe"));
    assert_eq!(m["test.u32"], Value::U32(7));
    assert_eq!(m["test.i32"], Value::I32(-5));
    assert_eq!(m["test.f32"].as_f64(), Some(0.25));
    assert_eq!(m["test.bool"], Value::Bool(true));
    assert_eq!(m["test.string"].as_str(), Some("héllo"));
    assert_eq!(m["test.u64"].as_u64(), Some(1 << 40));
    assert_eq!(m["test.f64"], Value::F64(-1.5));
    let strings = Value::Array(["a", "bc", ""].map(|s| Value::String(s.into())).to_vec());
    assert_eq!(m["test.strings"], strings);
    let Value::Array(ints) = &m["test.ints"] else {
        panic!("test.ints is not an array");
    };
    let ints: Vec<u64> = ints.iter().filter_map(Value::as_u64).collect();
    assert_eq!(ints, vec![1, 2, 3]);
}

/// A GGUF file of `version` with no metadata and one tensor `t` of type `kind` and dims `dims`,
/// `data` bytes after the table (aligned to 32).
fn tiny(version: u32, kind: u32, dims: &[u64], data: usize) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(version.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.push(b't');
    b.extend((dims.len() as u32).to_le_bytes());
    dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
    b.extend(kind.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.resize(b.len().div_ceil(32) * 32 + data, 0);
    b
}

fn open_err(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, bytes).unwrap();
    match GgufFile::open(&p) {
        Ok(_) => panic!("opened a malformed file"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("m.gguf"), "{msg}");
            msg
        }
    }
}

#[test]
fn malformed_files_are_refused_by_name() {
    // A well-formed F32 tensor of 4 values opens.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("ok.gguf");
    std::fs::write(&p, tiny(3, 0, &[4], 16)).unwrap();
    assert_eq!(GgufFile::open(&p).unwrap().f32("t").unwrap(), vec![0.0; 4]);
    assert!(open_err(b"GGML....").contains("not a GGUF file"));
    assert!(open_err(&tiny(2, 0, &[4], 16)).contains("version 2"));
    // Q2_K is not read; its name is in the message.
    assert!(open_err(&tiny(3, 10, &[256], 84)).contains("Q2_K"));
    // Data cut short, a table cut short, a row that is not whole blocks.
    assert!(open_err(&tiny(3, 0, &[4], 8)).contains("runs past the end"));
    assert!(open_err(&tiny(3, 0, &[4], 16)[..30]).contains("truncated"));
    assert!(open_err(&tiny(3, 8, &[48], 64)).contains("blocks"));
}

/// llama.cpp's converter output (`scripts/make_gguf_fixtures.py`) gives the config of the HF
/// fixture it was made from.
#[test]
fn configs_of_converted_fixtures_are_their_hf_configs() {
    use deltamoe_model::config::ModelConfig;
    use deltamoe_model::gguf::config::config;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    for file in [
        "qwen3_5_moe.q8_0",
        "qwen3_5_dense.f32",
        "mtp_qwen3_5_moe.f32",
    ] {
        let name = file.split('.').next().unwrap();
        let f = GgufFile::open(&root.join(format!("gguf/{file}.gguf"))).unwrap();
        let got = config(&f).unwrap();
        let want = ModelConfig::from_dir(&root.join(name)).unwrap();
        // The GGUF keeps one end-of-sequence id (the tokenizer's), the HF files list more.
        assert!(
            want.eos_token_ids.is_empty() || want.eos_token_ids.contains(&got.eos_token_ids[0]),
            "{name}: {:?} {:?}",
            got.eos_token_ids,
            want.eos_token_ids
        );
        let got = ModelConfig {
            eos_token_ids: want.eos_token_ids.clone(),
            model_type: want.model_type.clone(),
            ..got
        };
        assert_eq!(format!("{got:?}"), format!("{want:?}"), "{name}");
    }
}

/// An F32 GGUF from llama.cpp's converter, mapped back (names, layout, value-head order, `A_log`),
/// is the HF fixture it was made from: the CPU engine's logits, and the MTP layer's, bit for bit.
/// The Q8_0 file loads (its logits are the quantized weights', which only an oracle run on them
/// can check).
#[test]
fn converted_models_load_back_bit_for_bit() {
    use deltamoe_model::{Logits, Qwen3Hybrid};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let tokens: Vec<u32> = (0..19).map(|i| (i * 37 + 5) % 512).collect();
    for file in [
        "qwen3_5_dense.f32",
        "mtp_qwen3_5_moe.f32",
        "qwen3_5_moe.q8_0",
    ] {
        let name = file.split('.').next().unwrap();
        let hf = Qwen3Hybrid::load(&root.join(name)).unwrap();
        let (c, store) =
            deltamoe_model::gguf::load(&root.join(format!("gguf/{file}.gguf"))).unwrap();
        let g = Qwen3Hybrid::from_store(c, &store).unwrap();
        let (mut sa, mut sb) = (hf.new_state(), g.new_state());
        let (la, ha) = hf.forward_hidden(&tokens, &mut sa, Logits::All).unwrap();
        let (lb, hb) = g.forward_hidden(&tokens, &mut sb, Logits::All).unwrap();
        assert_eq!(la.len(), lb.len());
        if file.ends_with("q8_0") {
            continue;
        }
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same(&la, &lb) && same(&ha, &hb), "{file}: logits");
        assert_eq!(
            hf.checkpoint().mtp.is_some(),
            g.checkpoint().mtp.is_some(),
            "{file}"
        );
        if hf.checkpoint().mtp.is_some() {
            let next: Vec<u32> = tokens[1..].iter().copied().chain([7]).collect();
            let a = hf.mtp_forward(&next, &ha, &mut sa, Logits::All).unwrap();
            let b = g.mtp_forward(&next, &hb, &mut sb, Logits::All).unwrap();
            assert!(same(&a.0, &b.0) && same(&a.1, &b.1), "{file}: MTP layer");
        }
    }
}
