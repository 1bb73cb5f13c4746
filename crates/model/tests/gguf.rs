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
    // Dims whose byte count overflows (2^62 f32 values: 2^64 bytes, 0 when wrapped).
    assert!(open_err(&tiny(3, 0, &[1 << 62], 0)).contains("bytes"));
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

/// `fixtures/gguf_quant` (scripts/make_gguf_quant_fixtures.py, make_gguf_qwen3next_fixture.py):
/// files quantized by llama.cpp's own llama-quantize, holding every block type deltamoe reads,
/// and a `qwen3next` Q8_0 file from its converter, against transformers run in f32 on gguf-py's
/// dequantization of the same file mapped back to the HF layout. The CPU
/// engine's logits are within 5e-3 of max |ref| at every position, with the same argmax.
#[test]
fn quantized_files_match_transformers_on_their_dequantized_weights() {
    use deltamoe_model::{Logits, Qwen3Hybrid};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf_quant");
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let refs = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = |name: &str| -> Vec<u32> {
        let t = refs.tensor(name).unwrap();
        t.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    };
    let f32s = |name: &str| -> Vec<f32> {
        let t = refs.tensor(name).unwrap();
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    let files = [
        ("qwen3_5_moe_q.q4_k_m", "q4_k_m.", ""),
        ("qwen3_5_moe_q.iq4_xs", "iq4_xs.", ""),
        ("qwen3_5_moe_q.q6_k_mix", "q6_k_mix.", ""),
        ("qwen3_next_q.q8_0", "qwen3_next.", "qwen3_next."),
    ];
    for (file, kind, tok) in files {
        let model = Qwen3Hybrid::load(&dir.join(format!("{file}.gguf"))).unwrap();
        let vocab = model.config().vocab_size;
        for (p, key) in [("tokens", "logits"), ("chat.tokens", "chat.logits")] {
            let prompt = format!("{tok}{p}");
            let prompt = prompt.as_str();
            let tokens = ids(prompt);
            let want = f32s(&format!("{kind}{key}"));
            let mut state = model.new_state();
            let got = model.forward(&tokens, &mut state, Logits::All).unwrap();
            assert_eq!(got.len(), want.len());
            let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let max_diff = got
                .iter()
                .zip(&want)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            let argmax = |r: &[f32]| (0..r.len()).max_by(|&i, &j| r[i].total_cmp(&r[j])).unwrap();
            let agree = got
                .chunks_exact(vocab)
                .zip(want.chunks_exact(vocab))
                .filter(|(a, b)| argmax(a) == argmax(b))
                .count();
            let rows = tokens.len();
            assert!(
                max_diff <= 5e-3 * max_ref && agree == rows,
                "{kind} {prompt}: max |diff| {max_diff} (max |ref| {max_ref}), argmax {agree}/{rows}"
            );
            eprintln!(
                "{kind} {prompt}: max |diff| / max |ref| = {:.2e}",
                max_diff / max_ref
            );
        }
    }
}

/// A GGUF value's type id and bytes (an array's elements all of its first element's type).
fn value_bytes(v: &Value) -> (u32, Vec<u8>) {
    let s = |b: &[u8]| b.to_vec();
    match v {
        Value::U8(x) => (0, s(&[*x])),
        Value::I8(x) => (1, s(&x.to_le_bytes())),
        Value::U16(x) => (2, s(&x.to_le_bytes())),
        Value::I16(x) => (3, s(&x.to_le_bytes())),
        Value::U32(x) => (4, s(&x.to_le_bytes())),
        Value::I32(x) => (5, s(&x.to_le_bytes())),
        Value::F32(x) => (6, s(&x.to_le_bytes())),
        Value::Bool(x) => (7, s(&[*x as u8])),
        Value::String(x) => (
            8,
            [&(x.len() as u64).to_le_bytes()[..], x.as_bytes()].concat(),
        ),
        Value::Array(items) => {
            let kind = items.first().map_or(4, |i| value_bytes(i).0);
            let mut b = kind.to_le_bytes().to_vec();
            b.extend((items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| b.extend(value_bytes(i).1));
            (9, b)
        }
        Value::U64(x) => (10, s(&x.to_le_bytes())),
        Value::I64(x) => (11, s(&x.to_le_bytes())),
        Value::F64(x) => (12, s(&x.to_le_bytes())),
    }
}

/// A GGUF file of `meta` and the tensors `names` of `src` (their type ids as in `ids`).
fn write_gguf(meta: &[(String, Value)], src: &GgufFile, names: &[&String], ids: &[u32]) -> Vec<u8> {
    let dims = |n: &str| {
        src.info(n)
            .unwrap()
            .dims
            .iter()
            .map(|&d| d as u64)
            .collect()
    };
    write_gguf_dims(meta, src, names, ids, &dims)
}

/// [`write_gguf`] with each tensor's dims as `dims` gives them.
fn write_gguf_dims(
    meta: &[(String, Value)],
    src: &GgufFile,
    names: &[&String],
    ids: &[u32],
    dims: &dyn Fn(&str) -> Vec<u64>,
) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((names.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        b.extend((k.len() as u64).to_le_bytes());
        b.extend(k.as_bytes());
        let (kind, bytes) = value_bytes(v);
        b.extend(kind.to_le_bytes());
        b.extend(bytes);
    }
    let mut offset = 0u64;
    for (n, id) in names.iter().zip(ids) {
        let d = dims(n);
        b.extend((n.len() as u64).to_le_bytes());
        b.extend(n.as_bytes());
        b.extend((d.len() as u32).to_le_bytes());
        d.iter().for_each(|d| b.extend(d.to_le_bytes()));
        b.extend(id.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (src.bytes(n).unwrap().len() as u64).div_ceil(32) * 32;
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    for n in names {
        b.extend(src.bytes(n).unwrap());
        b.resize(b.len().div_ceil(32) * 32, 0);
    }
    b
}

/// A model split by gguf-split's convention (`-0000k-of-0000n.gguf`; the first part holds the
/// metadata, `split.*` keys in each) loads as the whole file does, bit for bit; a missing part
/// is named.
#[test]
fn split_files_load_as_the_whole() {
    use deltamoe_model::{Logits, Qwen3Hybrid};
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf");
    let whole = root.join("qwen3_5_dense.f32.gguf");
    let f = GgufFile::open(&whole).unwrap();
    let names: Vec<&String> = f.tensors.keys().collect();
    let id = |n: &String| {
        if f.info(n).unwrap().kind == deltamoe_model::gguf::BlockType::F16 {
            1
        } else {
            0
        }
    };
    let (first, second) = names.split_at(names.len() / 2);
    let split = |no: u16, count: usize| {
        vec![
            ("split.no".to_string(), Value::U16(no)),
            ("split.count".to_string(), Value::U16(2)),
            ("split.tensors.count".to_string(), Value::I32(count as i32)),
        ]
    };
    let mut meta: Vec<(String, Value)> = f
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    meta.extend(split(0, names.len()));
    let dir = tempfile::tempdir().unwrap();
    let p1 = dir.path().join("m-00001-of-00002.gguf");
    let ids = |ns: &[&String]| ns.iter().map(|n| id(n)).collect::<Vec<_>>();
    std::fs::write(&p1, write_gguf(&meta, &f, first, &ids(first))).unwrap();
    let err = Qwen3Hybrid::load(&p1).err().unwrap().to_string();
    assert!(
        err.contains("m-00002-of-00002.gguf") && err.contains("missing"),
        "{err}"
    );
    let p2 = dir.path().join("m-00002-of-00002.gguf");
    std::fs::write(
        &p2,
        write_gguf(&split(1, names.len()), &f, second, &ids(second)),
    )
    .unwrap();
    let tokens: Vec<u32> = (0..11).map(|i| (i * 53 + 2) % 512).collect();
    let run = |p: &Path| {
        let m = Qwen3Hybrid::load(p).unwrap();
        m.forward(&tokens, &mut m.new_state(), Logits::All).unwrap()
    };
    let (a, b) = (run(&whole), run(dir.path()));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
}

/// `convert` of each `fixtures/gguf_quant` file: the mlx-lm checkpoint it writes (quantized
/// matrices in the affine form, f32 parameters) loads as the same config and gives bitwise the
/// GGUF's logits, also with its experts read from its files (CPU `--expert-cache`); with `GgufOutput::Bf16` (in shards of 1 MiB) each quantized matrix holds its
/// values rounded once to bf16.
/// `info`'s listing of a GGUF file, from its tensor table alone, is what loading it lists:
/// every tensor's name, shape, dtype and bytes, for each block type of the fixtures.
#[test]
fn summaries_from_the_tensor_table_are_what_loading_lists() {
    use deltamoe_model::ModelSource;
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let files = [
        "gguf_quant/qwen3_5_moe_q.q4_k_m",
        "gguf_quant/qwen3_5_moe_q.iq4_xs",
        "gguf_quant/qwen3_5_moe_q.q6_k_mix",
        "gguf_quant/qwen3_next_q.q8_0",
        "gguf/qwen3_5_moe.q8_0",
        "gguf/qwen3_5_dense.f32",
        "gguf/mtp_qwen3_5_moe.f32",
    ];
    for file in files {
        let path = root.join(format!("{file}.gguf"));
        let (c, listed) = deltamoe_model::gguf::summary(&GgufFile::open(&path).unwrap()).unwrap();
        let (c2, store) = ModelSource::Gguf(path).open().unwrap();
        assert_eq!(format!("{c:?}"), format!("{c2:?}"), "{file}");
        let loaded = store.summary();
        assert_eq!(listed.len(), loaded.len(), "{file}: tensor count");
        for (a, b) in listed.iter().zip(&loaded) {
            let what = |t: &deltamoe_model::TensorInfo| {
                (
                    t.name.clone(),
                    t.shape.clone(),
                    t.dtype.clone(),
                    t.bytes,
                    t.params,
                )
            };
            assert_eq!(what(a), what(b), "{file}");
        }
    }
}

#[test]
fn converted_gguf_files_give_the_same_logits() {
    use deltamoe_model::convert::{convert_gguf, GgufOutput};
    use deltamoe_model::{Logits, Qwen3Hybrid, WeightStore};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf_quant");
    let tokens: Vec<u32> = (0..29).map(|i| (i * 37 + 5) % 500).collect();
    let out = tempfile::tempdir().unwrap();
    for file in [
        "qwen3_5_moe_q.q4_k_m",
        "qwen3_5_moe_q.iq4_xs",
        "qwen3_5_moe_q.q6_k_mix",
        "qwen3_next_q.q8_0",
    ] {
        let src = dir.join(format!("{file}.gguf"));
        let to = out.path().join(file);
        convert_gguf(&src, &to, GgufOutput::Affine, 1 << 30, &mut |_| {}).unwrap();
        let (a, b) = (
            Qwen3Hybrid::load(&src).unwrap(),
            Qwen3Hybrid::load(&to).unwrap(),
        );
        assert_eq!(
            format!("{:?}", a.config()),
            format!("{:?}", b.config()),
            "{file}"
        );
        let run = |m: &Qwen3Hybrid| m.forward(&tokens, &mut m.new_state(), Logits::All).unwrap();
        assert!(run(&a) == run(&b), "{file}: logits differ");
        let mut c = Qwen3Hybrid::load(&to).unwrap();
        c.offload_experts(&to, 1).unwrap();
        assert!(
            run(&a) == run(&c),
            "{file}: logits differ with the experts read from files"
        );

        let bf = out.path().join(format!("{file}.bf16"));
        convert_gguf(&src, &bf, GgufOutput::Bf16, 1 << 20, &mut |_| {}).unwrap();
        let (_, store) = deltamoe_model::gguf::load(&src).unwrap();
        let name = "model.layers.0.mlp.switch_mlp.gate_proj.weight";
        let name = if file.starts_with("qwen3_next") {
            "model.layers.0.linear_attn.in_proj_qkv.weight"
        } else {
            name
        };
        let (w, shape) = store.affine(name).unwrap();
        let want: Vec<f32> = w
            .dequantize()
            .into_iter()
            .map(deltamoe_compute::dtype::round_bf16)
            .collect();
        let got = WeightStore::open(&bf).unwrap().get(name, shape).unwrap();
        assert!(got.to_f32_vec() == want, "{file}: bf16 values of {name}");
        Qwen3Hybrid::load(&bf).unwrap();
    }
}

/// The CPU twin of the GPU's upload (`gpu::held_checkpoint`) of every GGUF fixture: affine stacks
/// keep their codes and exact parameters (K-quants' and mixed stacks' as f32; Q6_K's 6-bit codes
/// as 8-bit ones in their groups of 16), the embedding its blocks; dense f32 matrices such as the
/// router become bf16 values. The logits stay within the exact oracle's bound (5e-3·max|logit|)
/// of the exact weights'.
#[test]
fn held_models_round_like_the_gpu() {
    use deltamoe_model::gpu::held_checkpoint;
    use deltamoe_model::{Logits, Qwen3Hybrid};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gguf_quant");
    let tokens: Vec<u32> = (0..17).map(|i| (i * 31 + 3) % 500).collect();
    for file in [
        "qwen3_5_moe_q.q4_k_m",
        "qwen3_5_moe_q.iq4_xs",
        "qwen3_5_moe_q.q6_k_mix",
        "qwen3_next_q.q8_0",
    ] {
        let model = Qwen3Hybrid::load(&dir.join(format!("{file}.gguf"))).unwrap();
        let held = Qwen3Hybrid::new(held_checkpoint(model.checkpoint()).unwrap());
        let router = |m: &Qwen3Hybrid| match &m.checkpoint().layers[0].ffn {
            deltamoe_model::checkpoint::Ffn::Moe(x) => x.router.weight.to_dense().to_f32_vec(),
            _ => unreachable!(),
        };
        let bf: Vec<f32> = router(&model)
            .into_iter()
            .map(deltamoe_compute::dtype::round_bf16)
            .collect();
        assert!(router(&held) == bf, "{file}: the router as bf16");
        let a = model
            .forward(&tokens, &mut model.new_state(), Logits::All)
            .unwrap();
        let b = held
            .forward(&tokens, &mut held.new_state(), Logits::All)
            .unwrap();
        let max = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        eprintln!("{file}: {:.2e} of max|logit|", diff / max);
        assert!(diff <= 5e-3 * max, "{file}: {diff} of {max}");
    }
}

/// The id of block type `k` in a GGUF file's tensor table.
fn block_id(k: deltamoe_model::gguf::BlockType) -> u32 {
    use deltamoe_model::gguf::BlockType;
    (0..64).find(|&i| BlockType::from_id(i) == Some(k)).unwrap()
}

/// A GGUF fixture rewritten with its metadata, tensor types or tensor dims changed, then opened,
/// its tokenizer read, listed as `info` lists it and loaded: the load's error message, or `Err`
/// when any of it panicked.
struct Rewrite {
    src: GgufFile,
    meta: Vec<(String, Value)>,
    /// Each tensor's block type id, in the file's order.
    ids: Vec<u32>,
    dir: tempfile::TempDir,
}

impl Rewrite {
    /// `fixtures/{file}.gguf`.
    fn of(file: &str) -> Rewrite {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
        let src = GgufFile::open(&root.join(format!("{file}.gguf"))).unwrap();
        let meta = src
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let ids = src.tensors.values().map(|t| block_id(t.kind)).collect();
        Rewrite {
            src,
            meta,
            ids,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn new() -> Rewrite {
        Rewrite::of("gguf/qwen3_5_moe.q8_0")
    }

    fn names(&self) -> Vec<&String> {
        self.src.tensors.keys().collect()
    }

    /// Tensor `n`'s dims as the file stores them.
    fn dims(&self, n: &str) -> Vec<u64> {
        let d = &self.src.info(n).unwrap().dims;
        d.iter().map(|&x| x as u64).collect()
    }

    fn load_with(&self, i: usize, v: Value) -> std::thread::Result<Option<String>> {
        let mut m = self.meta.clone();
        m[i].1 = v;
        self.load(&m, &self.ids, &|n| self.dims(n))
    }

    /// The file written with metadata `meta`, tensor types `ids` and dims `dims`, then read.
    fn load(
        &self,
        meta: &[(String, Value)],
        ids: &[u32],
        dims: &dyn Fn(&str) -> Vec<u64>,
    ) -> std::thread::Result<Option<String>> {
        use deltamoe_model::gguf::vocab;
        use deltamoe_model::Qwen3Hybrid;
        let path = self.dir.path().join("m.gguf");
        let bytes = write_gguf_dims(meta, &self.src, &self.names(), ids, dims);
        std::fs::write(&path, bytes).unwrap();
        std::panic::catch_unwind(|| {
            if let Ok(f) = GgufFile::open(&path) {
                let _ = vocab::vocab(&f);
                let _ = deltamoe_model::gguf::summary(&f);
            }
            Qwen3Hybrid::load(&path).err().map(|e| e.to_string())
        })
    }
}

/// Every tensor of `qwen35moe` (Q8_0, Q4_K_M) and `qwen3next` GGUF fixtures given in turn
/// another shape of the same size (flattened, its dims reversed, one more outer dim of 1) or
/// another block type: listing it as `info` does and loading it end in `Ok` or an `Err`, never a
/// panic.
#[test]
fn reshaped_and_retyped_tensors_never_panic() {
    use deltamoe_model::gguf::BlockType;
    let kinds = [
        BlockType::F32,
        BlockType::BF16,
        BlockType::Q8_0,
        BlockType::Q4K,
        BlockType::Q6K,
    ];
    let mut tried = 0;
    let files = [
        "gguf/qwen3_5_moe.q8_0",
        "gguf_quant/qwen3_next_q.q8_0",
        "gguf_quant/qwen3_5_moe_q.q4_k_m",
    ];
    for file in files {
        let r = Rewrite::of(file);
        for (i, name) in r.names().into_iter().enumerate() {
            let d = r.dims(name);
            let shapes = [
                vec![d.iter().product()],
                d.iter().rev().copied().collect(),
                d.iter().copied().chain([1]).collect(),
            ];
            for shape in shapes.into_iter().filter(|s| *s != d) {
                let dims = |n: &str| match n == name.as_str() {
                    true => shape.clone(),
                    false => r.dims(n),
                };
                let out = r.load(&r.meta, &r.ids, &dims);
                assert!(out.is_ok(), "{file}: `{name}` as {shape:?}: panicked");
                tried += 1;
            }
            for k in kinds.iter().filter(|k| block_id(**k) != r.ids[i]) {
                let mut retyped = r.ids.clone();
                retyped[i] = block_id(*k);
                let out = r.load(&r.meta, &retyped, &|n| r.dims(n));
                assert!(out.is_ok(), "{file}: `{name}` as {k:?}: panicked");
                tried += 1;
            }
        }
    }
    assert!(tried >= 200, "{tried} cases");
}

/// Every integer metadata value of a GGUF fixture set in turn to an extreme (0, 1, odd, 2^31,
/// 2^40, 2^64 − 1): opening, loading and reading the tokenizer end in `Ok` or a one-line `Err`,
/// never a panic (nor an abort on an allocation sized by the value).
#[test]
fn extreme_metadata_values_never_panic() {
    let r = Rewrite::new();
    let mut tried = 0;
    for (i, (key, v)) in r.meta.iter().enumerate() {
        if v.as_u64().is_none() {
            continue;
        }
        for x in [0u64, 1, 3, 1 << 31, 1 << 40, u64::MAX] {
            let Ok(err) = r.load_with(i, Value::U64(x)) else {
                panic!("{key} = {x}: panicked");
            };
            if key.ends_with("rope.dimension_count") && x == 1 << 40 {
                let err = err.unwrap_or_default();
                assert!(
                    err.contains("metadata `qwen35moe.rope.dimension_count`"),
                    "{err}"
                );
            }
            tried += 1;
        }
    }
    assert!(tried >= 60, "{tried} cases");
}

/// Every array and string in a GGUF fixture's metadata cut short, emptied or replaced in turn
/// (a token list shorter than its types, merges that name no token, an unknown pre-tokenizer):
/// opening, loading and reading the tokenizer end in `Ok` or an `Err`, never a panic.
#[test]
fn cut_metadata_arrays_and_strings_never_panic() {
    let r = Rewrite::new();
    let mut tried = 0;
    for (i, (key, v)) in r.meta.iter().enumerate() {
        let edits: Vec<Value> = match v {
            Value::Array(a) if !a.is_empty() => vec![
                Value::Array(a[..a.len() / 2].to_vec()),
                Value::Array(a[..1].to_vec()),
                Value::Array(a.iter().rev().cloned().collect()),
            ],
            Value::String(_) => vec![
                Value::String(String::new()),
                Value::String("{{ x.y(".into()),
            ],
            _ => continue,
        };
        for e in edits {
            assert!(r.load_with(i, e).is_ok(), "{key}: panicked");
            tried += 1;
        }
    }
    assert!(tried >= 15, "{tried} cases");
}
