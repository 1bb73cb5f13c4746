//! Golden tests: every committed fixture (tiny random-weight models made with HF transformers,
//! see scripts/make_fixtures.py) against transformers' own f32 logits and greedy
//! continuations. Tolerance 5e-3·max|ref| with ≥ 98% argmax agreement, for one prefill, for pure
//! decode (chunks of 1) and for a split of 37; greedy continuations must be identical.

mod common;

use common::{check_logits, fixtures, gguf_prompts, greedy, prompts};

use deltamoe_engine::chat::{ChatMessage, ChatTemplate};
use deltamoe_engine::tokenizer::TextTokenizer;
use deltamoe_engine::Engine;
use deltamoe_model::{Logits, Qwen3Hybrid};

#[test]
fn logits_match_transformers_for_every_prefill_split() {
    for dir in fixtures() {
        let model = Qwen3Hybrid::load(&dir).unwrap();
        let vocab = model.config().vocab_size;
        let mut engine = Engine::new(model);
        for (i, p) in prompts(&dir).iter().enumerate() {
            for chunk in [None, Some(1), Some(37)] {
                let id = engine.add_sequence().unwrap();
                let got = engine.prefill(id, &p.tokens, chunk, Logits::All).unwrap();
                engine.remove_sequence(id);
                let name = format!(
                    "{} prompt{i} chunk {chunk:?}",
                    dir.file_name().unwrap().to_string_lossy()
                );
                check_logits(&name, &got, &p.logits, vocab);
            }
        }
    }
}

/// The GGUF files of `fixtures/gguf_quant` (llama-quantize's block types) through the engine in
/// one pass, in decode steps and in passes of 37, against transformers on their dequantization.
#[test]
fn gguf_files_match_transformers_for_every_prefill_split() {
    for (file, ps) in gguf_prompts() {
        let mut engine = Engine::new(Qwen3Hybrid::load(&file).unwrap());
        let vocab = engine.config().vocab_size;
        for (i, p) in ps.iter().enumerate() {
            for chunk in [None, Some(1), Some(37)] {
                let id = engine.add_sequence().unwrap();
                let got = engine.prefill(id, &p.tokens, chunk, Logits::All).unwrap();
                engine.remove_sequence(id);
                let name = format!("{} prompt{i} chunk {chunk:?}", file.display());
                check_logits(&name, &got, &p.logits, vocab);
            }
        }
    }
}

#[test]
fn greedy_continuations_equal_transformers_generate() {
    for dir in fixtures() {
        let mut engine = Engine::new(Qwen3Hybrid::load(&dir).unwrap());
        for (i, p) in prompts(&dir).iter().enumerate() {
            let out = greedy(&mut engine, p);
            assert_eq!(out, p.greedy, "{} prompt{i}", dir.display());
        }
    }
}

#[test]
fn batched_steps_equal_single_sequence_greedy() {
    for dir in fixtures() {
        let mut e = Engine::new(Qwen3Hybrid::load(&dir).unwrap());
        let ps = prompts(&dir);
        let rows: Vec<&common::Prompt> = ps.iter().chain(ps.iter()).collect();
        for (i, out) in common::greedy_batched(&mut e, &rows, 3).iter().enumerate() {
            assert_eq!(out, &rows[i].greedy, "{} row {i}", dir.display());
        }
    }
}

#[test]
fn snapshot_restore_resumes_identically() {
    for dir in fixtures() {
        let mut e = Engine::new(Qwen3Hybrid::load(&dir).unwrap());
        common::check_snapshot_resume(&mut e, &prompts(&dir)[0]);
    }
}

#[test]
fn sequences_are_independent() {
    // Interleaving two sequences' decode steps gives each the logits it gets alone.
    let dir = fixtures()
        .into_iter()
        .find(|d| d.ends_with("qwen3_next"))
        .unwrap();
    let ps = prompts(&dir);
    let vocab = 512;
    let mut engine = Engine::new(Qwen3Hybrid::load(&dir).unwrap());
    let (a, b) = (
        engine.add_sequence().unwrap(),
        engine.add_sequence().unwrap(),
    );
    let n = 20;
    let mut got_a = Vec::new();
    let mut got_b = Vec::new();
    for t in 0..n {
        let out = engine
            .decode(&[
                (a, ps[0].tokens[t]),
                (b, ps[1].tokens[t % ps[1].tokens.len()]),
            ])
            .unwrap();
        got_a.extend_from_slice(&out[0]);
        got_b.push(out[1].clone());
    }
    check_logits(
        "interleaved seq a",
        &got_a,
        &ps[0].logits[..n * vocab],
        vocab,
    );
    let t1 = ps[1].tokens.len();
    let want_b: Vec<f32> = got_b[..t1].concat();
    check_logits("interleaved seq b", &want_b, &ps[1].logits, vocab);
}

#[test]
fn chat_prompt_tokenizes_as_transformers() {
    let dir = fixtures()
        .into_iter()
        .find(|d| d.ends_with("qwen3_5_moe"))
        .unwrap();
    let tok = TextTokenizer::from_dir(&dir).unwrap().unwrap();
    let tpl = ChatTemplate::from_dir(&dir).unwrap().unwrap();
    let msgs = [
        ChatMessage {
            role: "system".into(),
            content: "You are a helpful assistant.".into(),
        },
        ChatMessage {
            role: "user".into(),
            content: "What is the capital of France? Answer in one word.".into(),
        },
    ];
    let text = tpl.render(&msgs, true).unwrap();
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!(ids, prompts(&dir)[1].tokens);
}
