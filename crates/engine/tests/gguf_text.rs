//! The text side of a GGUF file, from its metadata: the tokenizer gives llama.cpp's ids (and
//! the HF tokenizer's) on a test text, the chat template renders the HF prompt, and the end
//! ids and sampling defaults are the HF generation config's.

use std::path::{Path, PathBuf};

use deltamoe_engine::chat::ChatMessage;
use deltamoe_engine::model_text::ModelText;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// The i64 tensor `name` and the metadata of `fixtures/gguf_quant/reference.safetensors`.
fn reference(name: &str) -> (Vec<u32>, std::collections::HashMap<String, String>) {
    let bytes = std::fs::read(fixtures().join("gguf_quant/reference.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let refs = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = refs
        .tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    (ids, meta.metadata().clone().unwrap_or_default())
}

#[test]
fn gguf_tokenizer_and_template_give_llama_cpp_and_hf_ids() {
    let text = ModelText::load(&fixtures().join("gguf_quant/qwen3_5_moe_q.q4_k_m.gguf")).unwrap();
    let tok = text.tokenizer.as_ref().unwrap();
    let (want, meta) = reference("text.ids");
    assert_eq!(tok.encode(&meta["text"], false).unwrap(), want);
    assert_eq!(tok.decode(&want, false).unwrap(), meta["text"]);
    let (chat, _) = reference("chat.tokens");
    let msgs = [
        ("system", "You are a helpful assistant."),
        ("user", "What is the capital of France? Answer in one word."),
    ]
    .map(|(role, content)| ChatMessage {
        role: role.into(),
        content: content.into(),
    });
    let prompt = text.template.as_ref().unwrap().render(&msgs, true).unwrap();
    assert_eq!(prompt, meta["chat.text"]);
    assert_eq!(tok.encode(&prompt, false).unwrap(), chat);
}

#[test]
fn gguf_generation_defaults_are_the_hf_configs() {
    let gguf = ModelText::load(&fixtures().join("gguf/qwen3_5_moe.q8_0.gguf")).unwrap();
    let hf = ModelText::load(&fixtures().join("qwen3_5_moe")).unwrap();
    let (g, h) = (gguf.defaults(&[]), hf.defaults(&[]));
    let mut ids = g.eos_token_ids.clone();
    ids.sort();
    let mut want = h.eos_token_ids.clone();
    want.sort();
    assert_eq!(ids, want);
    assert_eq!(format!("{:?}", g.sampling), format!("{:?}", h.sampling));
    let t = gguf.template.as_ref().unwrap();
    assert_eq!(t.eos_token(), Some("<|im_end|>"));
    let sample = "Once upon a time, 3 robots said: \"héllo\"\n<|im_end|>";
    let (a, b) = (gguf.tokenizer.unwrap(), hf.tokenizer.unwrap());
    assert_eq!(
        a.encode(sample, true).unwrap(),
        b.encode(sample, true).unwrap()
    );
}

/// A GGUF converted to an mlx-lm directory (`deltamoe convert`) keeps its text side: the same
/// ids, chat prompt, end ids and sampling defaults.
#[test]
fn converted_gguf_keeps_its_tokenizer_template_and_defaults() {
    use deltamoe_model::convert::{convert_gguf, GgufOutput};
    let src = fixtures().join("gguf/qwen3_5_moe.q8_0.gguf");
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("m");
    convert_gguf(&src, &dir, GgufOutput::Affine, 1 << 30, &mut |_| {}).unwrap();
    let (a, b) = (
        ModelText::load(&src).unwrap(),
        ModelText::load(&dir).unwrap(),
    );
    let (meta, text) = (reference("text.ids").1, "Héllo <|im_end|> wörld 123");
    let (ta, tb) = (a.tokenizer.as_ref().unwrap(), b.tokenizer.as_ref().unwrap());
    for t in [meta["text"].as_str(), text] {
        assert_eq!(ta.encode(t, false).unwrap(), tb.encode(t, false).unwrap());
    }
    let msgs = [ChatMessage {
        role: "user".into(),
        content: "Hi".into(),
    }];
    let render = |m: &ModelText| m.template.as_ref().unwrap().render(&msgs, true).unwrap();
    assert_eq!(render(&a), render(&b));
    let (ga, gb) = (a.defaults(&[]), b.defaults(&[]));
    assert_eq!(ga.eos_token_ids, gb.eos_token_ids);
    assert_eq!(format!("{:?}", ga.sampling), format!("{:?}", gb.sampling));
}
