//! `convert` (HF checkpoint → MLX affine-quantized, mlx-lm layout).
//!
//! 1. For the settings of the committed mlx-lm fixtures, our output is the same checkpoint
//!    mlx-lm's converter wrote (every tensor's name, dtype, shape and bytes, and the config's
//!    quantization block), so the transformers reference of that fixture applies to it.
//! 2. For mixed settings no fixture covers (2/3/6/8 bits, group 32/64, a module kept dense, many
//!    small shards) the reference is computed here: the source checkpoint with every weight that
//!    convert quantizes replaced by its dequantized values (and norms by the bf16-rounded `1 + w`
//!    minus 1), written in the *HF* layout as f32 and run by deltamoe's f32 engine, which the
//!    golden tests validate against transformers at ~1e-5. The reference thus shares none of
//!    convert's renaming, stacking, norm shifting or conv reshaping, only the quantization
//!    (itself checked bit for bit against mlx in deltamoe-compute's tests).

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use deltamoe_compute::cpu::quant::quantize;
use deltamoe_compute::dtype::{bf16_to_f32, f32_to_bf16};
use deltamoe_model::convert::{convert, BitsRule, ConvertOptions};
use deltamoe_model::{Logits, ModelConfig, Qwen3Hybrid, WeightStore};
use safetensors::SafeTensors;

use common::{check_logits, f32s, fixture, ids};

/// Every tensor of a checkpoint directory: name → (dtype, shape, bytes).
fn tensors(dir: &Path) -> BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if !(name.starts_with("model") && name.ends_with(".safetensors")) {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (n, t) in st.tensors() {
            out.insert(
                n,
                (
                    format!("{:?}", t.dtype()),
                    t.shape().to_vec(),
                    t.data().to_vec(),
                ),
            );
        }
    }
    out
}

fn quant_block(dir: &Path) -> serde_json::Value {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(v["quantization"], v["quantization_config"]);
    v["quantization"].clone()
}

fn logits(model: &Qwen3Hybrid, tokens: &[u32]) -> Vec<f32> {
    let mut st = model.new_state();
    model.forward(tokens, &mut st, Logits::All).unwrap()
}

#[test]
fn output_is_identical_to_mlx_lm_convert() {
    for (src, bits, gs, mlx) in [
        ("qwen3_5_moe", 4, 32, "mlx_qwen3_5_moe_q4"),
        ("qwen3_next", 4, 32, "mlx_qwen3_next_q4"),
        ("qwen3_5_moe", 8, 64, "mlx_qwen3_5_moe_q8"),
    ] {
        let out = tempfile::tempdir().unwrap();
        let dst = out.path().join("m");
        let mut calls = 0;
        let report = convert(
            &fixture(src),
            &dst,
            &ConvertOptions::new(bits, gs),
            &mut |p| {
                assert!(p.done <= p.total && !p.tensor.is_empty());
                calls += 1;
            },
        )
        .unwrap();
        assert!(calls > 0 && report.shards == 1, "{report:?}");
        // mlx-lm drops the MTP tensors (here the fixture's stray `mtp.fc.weight`); convert keeps them.
        let mut ours = tensors(&dst);
        ours.retain(|k, _| !k.starts_with("language_model.mtp."));
        let theirs = tensors(&fixture(mlx));
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "{mlx}: tensor names"
        );
        for (k, v) in &ours {
            assert!(
                v == &theirs[k],
                "{mlx}: tensor {k} differs (dtype/shape/bytes)"
            );
        }
        assert_eq!(quant_block(&dst), quant_block(&fixture(mlx)), "{mlx}");
        // Hence the fixture's transformers reference applies.
        let model = Qwen3Hybrid::load(&dst).unwrap();
        let bytes = std::fs::read(fixture(mlx).join("reference.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let want = f32s(&st, "prompt0.logits");
        let got = logits(&model, &ids(&st, "prompt0.tokens"));
        check_logits(&format!("convert {src} {bits}/{gs}"), &got, &want, 512);
        assert!(dst.join("config.json").exists());
        if fixture(src).join("tokenizer.json").exists() {
            assert!(report.copied.contains(&"tokenizer.json".to_string()));
        }
    }
}

/// The module path convert quantizes an HF tensor as (per-expert weights are stacked).
fn module_of(name: &str) -> Option<String> {
    let m = name.strip_suffix(".weight")?;
    if let Some((mlp, rest)) = m.split_once(".experts.") {
        let proj = rest.split('.').nth(1)?;
        return Some(format!("{mlp}.switch_mlp.{proj}"));
    }
    Some(m.to_string())
}

/// Tensor `name` as f32: as stored, or an FP8 weight dequantized and rounded to bf16 (what
/// convert writes when it keeps one dense; the quantizer sees the same bf16 values' f32
/// originals, see [`fake_quantized_copy`]).
fn source_f32(store: &WeightStore, name: &str, shape: &[usize]) -> Vec<f32> {
    match store.fp8_codes(name) {
        None => store.get(name, shape).unwrap().to_f32_vec(),
        Some((codes, _)) => fp8_dequantized(store, name, shape, codes),
    }
}

fn fp8_dequantized(
    store: &WeightStore,
    name: &str,
    shape: &[usize],
    codes: deltamoe_compute::fp8::Bytes,
) -> Vec<f32> {
    let block = store.fp8().unwrap().block;
    let grid = [shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1])];
    let scales = store.get(&format!("{name}_scale_inv"), &grid).unwrap();
    let w = deltamoe_compute::Fp8Weight::new(
        shape[0],
        shape[1],
        block,
        codes,
        scales.to_f32_vec(),
        scales.dtype(),
    )
    .unwrap();
    w.dequantize()
}

/// `data` (name, shape, f32 little-endian bytes) as `dir/model.safetensors`.
fn write_f32(dir: &Path, data: &[(String, Vec<usize>, Vec<u8>)]) {
    std::fs::create_dir_all(dir).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView)> = data
        .iter()
        .map(|(n, s, b)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
            (n.clone(), v.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// The converted model at `dst` against the f32 engine on `reference`, on `src`'s prompts.
fn check_converted(name: &str, src: &Path, dst: &Path, reference: &Path) {
    let vocab = ModelConfig::from_dir(src).unwrap().vocab_size;
    let (reference, model) = (
        Qwen3Hybrid::load(reference).unwrap(),
        Qwen3Hybrid::load(dst).unwrap(),
    );
    let bytes = std::fs::read(src.join("reference.safetensors")).unwrap();
    let refst = SafeTensors::deserialize(&bytes).unwrap();
    for p in ["prompt0", "prompt1"] {
        let toks = ids(&refst, &format!("{p}.tokens"));
        check_logits(
            &format!("{name} {p}"),
            &logits(&model, &toks),
            &logits(&reference, &toks),
            vocab,
        );
    }
}

/// The HF checkpoint with what convert would store, dequantized, as f32 in HF layout.
fn fake_quantized_copy(src: &Path, opts: &ConvertOptions, dst: &Path) {
    let store = WeightStore::open(src).unwrap();
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = vec![];
    let mut quantized = 0;
    for name in store.names() {
        if name.ends_with(".weight_scale_inv") {
            continue;
        }
        let shape = store.shape_of(name).unwrap();
        let mut v = source_f32(&store, name, &shape);
        let cols = *shape.last().unwrap();
        let is_linear = shape.len() == 2 && !name.contains("conv1d");
        let spec = if is_linear {
            opts.spec_for(&module_of(name).unwrap())
                .filter(|s| cols.is_multiple_of(s.group_size))
        } else {
            None
        };
        if let Some(s) = spec {
            quantized += 1;
            let q = quantize(&v, cols, s.group_size, s.bits).unwrap();
            let round = |x: f32| bf16_to_f32(f32_to_bf16(x));
            let mut row = vec![0.0f32; cols];
            for (r, out) in v.chunks_exact_mut(cols).enumerate() {
                let wpr = cols * s.bits as usize / 32;
                deltamoe_compute::quant::unpack_row(
                    &q.words[r * wpr..(r + 1) * wpr],
                    s.bits,
                    &mut row,
                );
                for (k, o) in out.iter_mut().enumerate() {
                    let g = r * (cols / s.group_size) + k / s.group_size;
                    *o = row[k] * round(q.scales[g]) + round(q.biases[g]);
                }
            }
        } else if store.fp8_codes(name).is_some() {
            // An FP8 weight kept dense: written as bf16.
            v.iter_mut().for_each(|x| *x = bf16_to_f32(f32_to_bf16(*x)));
        } else if shape.len() == 1 && name.contains("norm.weight") && !name.contains("linear_attn")
        {
            // Stored as bf16(1 + w) by convert; the HF engine adds 1 again.
            v.iter_mut()
                .for_each(|x| *x = bf16_to_f32(f32_to_bf16(*x + 1.0)) - 1.0);
        }
        data.push((
            name.to_string(),
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    }
    assert!(quantized > 20);
    write_f32(dst, &data);
    // The reference is a plain f32 checkpoint: no FP8 block in its config.
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("quantization_config");
    std::fs::write(dst.join("config.json"), cfg.to_string()).unwrap();
}

/// An FP8 checkpoint converts as its f32 dequantization does: the converted model against the
/// f32 engine on the fake-quantized dequantized weights (some modules kept dense, written as
/// bf16), tightly.
#[test]
fn fp8_source_converts_like_its_dequantized_weights() {
    let mut opts = ConvertOptions::new(8, 32);
    for r in ["shared_expert.*=4", "layers.3.*=none"] {
        opts.rules.push(BitsRule::parse(r, 32).unwrap());
    }
    let src = fixture("fp8_qwen3_next");
    let tmp = tempfile::tempdir().unwrap();
    let (dst, fake) = (tmp.path().join("q"), tmp.path().join("f"));
    let report = convert(&src, &dst, &opts, &mut |p| assert!(p.done <= p.total)).unwrap();
    assert!(
        report.dense_modules > 0 && report.quantized_modules > 20,
        "{report:?}"
    );
    let st = WeightStore::open(&dst).unwrap();
    assert!(st.fp8().is_none() && st.names().all(|n| !n.ends_with("_scale_inv")));
    fake_quantized_copy(&src, &opts, &fake);
    check_converted("fp8 qwen3_next converted", &src, &dst, &fake);
}

#[test]
fn mixed_bits_sharded_output_matches_the_f32_engine_on_fake_quantized_weights() {
    let mut opts = ConvertOptions::new(2, 32);
    for r in [
        "switch_mlp.*=3",
        "shared_expert.*=6:64",
        "lm_head=8:64",
        "model.embed_tokens=4",
        "layers.5.*=none",
    ] {
        opts.rules.push(BitsRule::parse(r, 32).unwrap());
    }
    opts.max_shard_bytes = 100 << 10;
    let src = fixture("qwen3_next");
    let tmp = tempfile::tempdir().unwrap();
    let (dst, fake) = (tmp.path().join("q"), tmp.path().join("f"));
    let report = convert(&src, &dst, &opts, &mut |_| {}).unwrap();
    assert!(report.shards > 3, "{report:?}");
    assert!(report.dense_modules > 0 && report.quantized_modules > 0);
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dst.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert!(
        index["weight_map"]["model.layers.0.mlp.switch_mlp.down_proj.scales"]
            .as_str()
            .unwrap()
            .starts_with("model-0000")
    );
    let q = quant_block(&dst);
    assert_eq!(q["bits"], 2);
    assert_eq!(q["lm_head"]["bits"], 8);
    assert_eq!(q["model.layers.0.mlp.switch_mlp.gate_proj"]["bits"], 3);
    assert!(q.get("model.layers.5.self_attn.q_proj").is_none());
    let st = WeightStore::open(&dst).unwrap();
    assert!(st
        .words("model.layers.5.linear_attn.in_proj_qkvz.weight")
        .is_none());
    assert!(st
        .words("model.layers.4.linear_attn.in_proj_qkvz.weight")
        .is_some());

    fake_quantized_copy(&src, &opts, &fake);
    check_converted("mixed-bit qwen3_next", &src, &dst, &fake);
}

#[test]
fn bad_inputs_are_one_line_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |src: &Path, dst: &Path, o: ConvertOptions| {
        convert(src, dst, &o, &mut |_| {}).unwrap_err().to_string()
    };
    let e = run(
        &fixture("mlx_qwen3_next_q4"),
        &tmp.path().join("a"),
        ConvertOptions::new(4, 64),
    );
    assert!(e.contains("already an mlx-lm"), "{e}");
    let e = run(
        &fixture("qwen3_next"),
        &tmp.path().join("b"),
        ConvertOptions::new(7, 64),
    );
    assert!(
        e.contains("--bits 7") && e.contains("bits 7 is not supported"),
        "{e}"
    );
    std::fs::write(tmp.path().join("x"), b"").unwrap();
    let e = run(
        &fixture("qwen3_next"),
        tmp.path(),
        ConvertOptions::new(4, 64),
    );
    assert!(e.contains("--out") && e.contains("not empty"), "{e}");
}

/// `w` (rows of `cols`) through FP8 and back: what an FP8 conversion's weight means.
fn fp8_round_trip(w: &[f32], cols: usize) -> Vec<f32> {
    let (codes, scales) = deltamoe_compute::fp8::quantize_blocks(w, cols, [128, 128]);
    let rows = w.len() / cols;
    let f = deltamoe_compute::Fp8Weight::new(
        rows,
        cols,
        [128, 128],
        deltamoe_compute::fp8::Bytes::from_vec(codes),
        scales,
        deltamoe_compute::DType::F32,
    )
    .unwrap();
    f.dequantize()
}

/// `convert --fp8` of a Qwen3.5-MoE fixture (fused experts, nested config): the layout of Qwen's
/// FP8 checkpoints (per-expert FP8 weights with their block scales, routers and GDN a/b kept
/// bf16, the quantization block) and logits equal to the f32 engine's on the source with every
/// quantized matrix (each expert's gate, up and down on its own) replaced by its FP8 round trip.
#[test]
fn fp8_output_is_qwen_fp8_layout_and_matches_its_round_trip() {
    let src = fixture("qwen3_5_moe");
    let tmp = tempfile::tempdir().unwrap();
    let (dst, fake) = (tmp.path().join("q"), tmp.path().join("f"));
    convert(&src, &dst, &ConvertOptions::fp8(), &mut |_| {}).unwrap();
    let st = WeightStore::open(&dst).unwrap();
    assert_eq!(st.fp8().map(|c| c.block), Some([128, 128]));
    let q = &quant_block_fp8(&dst);
    assert_eq!(q["quant_method"], "fp8");
    let kept = q["modules_to_not_convert"].as_array().unwrap();
    assert!(kept
        .iter()
        .any(|m| m == "model.language_model.layers.0.mlp.gate"));
    for n in [
        "model.layers.0.mlp.experts.3.up_proj.weight",
        "model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.layers.3.self_attn.o_proj.weight",
    ] {
        assert!(st.fp8_codes(n).is_some(), "{n}");
        assert!(st.contains(&format!("{n}_scale_inv")), "{n}");
    }
    assert!(st
        .fp8_codes("model.layers.0.linear_attn.in_proj_a.weight")
        .is_none());

    let kept: Vec<String> = kept
        .iter()
        .map(|k| format!("{}.weight", k.as_str().unwrap()))
        .collect();
    round_trip_copy(
        &src,
        &fake,
        |stored| !kept.iter().any(|k| k == stored),
        fp8_round_trip,
    );
    check_converted("fp8 qwen3_5_moe", &src, &dst, &fake);
}

/// The source in f32 with each matrix `quantized` says (by its stored name) replaced by `rt` of
/// it (each expert's gate, up and down of fused experts on its own), written to `fake` with the
/// source's config: the reference of a per-expert conversion.
fn round_trip_copy(
    src: &Path,
    fake: &Path,
    quantized: impl Fn(&str) -> bool,
    rt: impl Fn(&[f32], usize) -> Vec<f32>,
) {
    let store = WeightStore::open(src).unwrap();
    let c = ModelConfig::from_dir(src).unwrap();
    let (i, h) = (c.moe_intermediate_size, c.hidden_size);
    let mut data: Vec<(String, Vec<usize>, Vec<u8>)> = vec![];
    for name in store.names() {
        let shape = store.shape_of(name).unwrap();
        let mut v = store.get(name, &shape).unwrap().to_f32_vec();
        if name.ends_with("experts.gate_up_proj") || name.ends_with("experts.down_proj") {
            let rows = if name.ends_with("down_proj") { h } else { i };
            let cols = *shape.last().unwrap();
            for m in v.chunks_mut(rows * cols) {
                let r = rt(m, cols);
                m.copy_from_slice(&r);
            }
        } else if shape.len() == 2
            && name.ends_with(".weight")
            && quantized(&store.stored_name(name))
        {
            v = rt(&v, shape[1]);
        }
        data.push((
            name.to_string(),
            shape,
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    }
    write_f32(fake, &data);
    std::fs::copy(src.join("config.json"), fake.join("config.json")).unwrap();
}

/// `w` (rows of `cols`) through GPTQ's symmetric 4-bit quantizer with groups of `g` and back:
/// `s = f16(2·max|w|/15)`, `q = clamp(round_half_even(w/s) + 8, 0, 15)`, `w = (q − 8)·s`.
fn gptq_round_trip(w: &[f32], cols: usize, g: usize) -> Vec<f32> {
    assert_eq!(cols % g, 0);
    w.chunks(g)
        .flat_map(|grp| {
            let amax = grp.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let s = half::f16::from_f32(2.0 * amax / 15.0).to_f32();
            grp.iter().map(move |&v| match s > 0.0 {
                true => (((v / s).round_ties_even() + 8.0).clamp(0.0, 15.0) - 8.0) * s,
                false => 0.0,
            })
        })
        .collect()
}

/// `convert --gptq` of a Qwen3.5-MoE fixture (fused experts): GPTQ v1 tensors (per-expert
/// `qweight`, `qzeros`, f16 `scales`, `g_idx`), routers and GDN a/b kept, the quantization block,
/// and logits equal to the f32 engine's on the source with every quantized matrix replaced by
/// its round trip through GPTQ's symmetric quantizer.
#[test]
fn gptq_output_is_gptq_v1_layout_and_matches_its_round_trip() {
    let src = fixture("qwen3_5_moe");
    let tmp = tempfile::tempdir().unwrap();
    let (dst, fake) = (tmp.path().join("q"), tmp.path().join("f"));
    convert(&src, &dst, &ConvertOptions::gptq(32), &mut |_| {}).unwrap();
    let st = WeightStore::open(&dst).unwrap();
    let g = st.gptq().unwrap();
    assert_eq!((g.bits, g.group_size), (4, Some(32)));
    let q = quant_block_fp8(&dst);
    assert_eq!(
        (q["quant_method"].as_str(), q["checkpoint_format"].as_str()),
        (Some("gptq"), Some("gptq"))
    );
    for m in [
        "model.layers.0.mlp.experts.3.up_proj",
        "model.layers.0.linear_attn.in_proj_qkv",
        "model.layers.3.self_attn.o_proj",
    ] {
        for t in ["qweight", "qzeros", "g_idx"] {
            assert!(st.ints(&format!("{m}.{t}")).is_some(), "{m}.{t}");
        }
    }
    assert!(st.contains("model.layers.0.linear_attn.in_proj_a.weight"));
    assert!(st.contains("model.layers.0.mlp.gate.weight"));
    let packed = |stored: &str| {
        let m = stored.strip_suffix(".weight").unwrap();
        let n = m
            .strip_prefix("model.language_model.")
            .map_or(m.to_string(), |r| format!("model.{r}"));
        st.contains(&format!("{n}.qweight"))
            || n.ends_with("experts.gate_up_proj")
            || n.ends_with("experts.down_proj")
    };
    round_trip_copy(&src, &fake, packed, |w, cols| gptq_round_trip(w, cols, 32));
    check_converted("gptq qwen3_5_moe", &src, &dst, &fake);
}

fn quant_block_fp8(dir: &Path) -> serde_json::Value {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    v["quantization_config"].clone()
}

#[test]
fn convert_keeps_the_mtp_layer() {
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("m");
    convert(
        &fixture("mtp_qwen3_next"),
        &dst,
        &ConvertOptions::new(8, 64),
        &mut |_| {},
    )
    .unwrap();
    let names = tensors(&dst);
    for n in [
        "mtp.fc.scales",
        "mtp.layers.0.mlp.switch_mlp.down_proj.weight",
        "mtp.norm.weight",
    ] {
        assert!(names.contains_key(n), "{n} missing");
    }
    let model = Qwen3Hybrid::load(&dst).unwrap();
    let m = model
        .checkpoint()
        .mtp
        .as_ref()
        .expect("MTP layer after convert");
    assert_eq!(m.fc.weight.in_features(), 2 * model.config().hidden_size);
    // Its norms were stored as 1 + w (rounded to bf16), as mlx-lm stores the main ones, and
    // read back as such.
    let src = Qwen3Hybrid::load(&fixture("mtp_qwen3_next")).unwrap();
    let s = src.checkpoint().mtp.as_ref().unwrap();
    for (a, b) in [
        (&m.norm, &s.norm),
        (&m.embed_norm, &s.embed_norm),
        (&m.hidden_norm, &s.hidden_norm),
    ] {
        assert!(
            a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= y.abs() / 256.0),
            "{a:?} vs {b:?}"
        );
    }
    let mut st = model.new_state();
    let h = vec![0.5; model.config().hidden_size];
    let (logits, _) = model.mtp_forward(&[3], &h, &mut st, Logits::Last).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
}
