//! The MTP layer (`mtp.*`) on the CPU against `scripts/make_mtp_fixtures.py`'s reference
//! (transformers' decoder layer, vLLM's MTP semantics): the main model's final hidden states,
//! the MTP layer over the prompt's (token t + 1, hidden t) pairs, and two chained draft steps,
//! each in one pass, in single steps and in passes of 7, at the foundation tolerance. And the
//! verify pass and commit of speculative decoding: greedy output token for token that of plain
//! decoding, and the state after a rejected draft bitwise plain decoding's.

mod common;

use common::{
    check_close, check_logits, copy_fixture, edit_quantization, f32s, fixture, ids, load_err,
};
use deltamoe_model::state::LayerState;
use deltamoe_model::{Logits, Qwen3Hybrid, SequenceState};
use safetensors::SafeTensors;

fn argmax(r: &[f32]) -> u32 {
    common::argmax(r) as u32
}

/// Max |got − want| within 5e-3·max|want|.
/// Checks `logits` and `hidden` against the reference's `{key}logits` and `{key}hidden`.
fn check_rows(
    tag: &str,
    st: &SafeTensors,
    key: &str,
    (logits, hidden): (&[f32], &[f32]),
    v: usize,
) {
    let want = |what: &str| f32s(st, &format!("{key}{what}"));
    check_logits(&format!("{tag}: {key}logits"), logits, &want("logits"), v);
    let name = format!("{tag}: {key}hidden");
    let (err, max_ref) = check_close(&name, hidden, &want("hidden"));
    eprintln!("{name}: max err {err:.2e} of max|ref| {max_ref:.3}");
}

fn check(name: &str) {
    let dir = fixture(name);
    let model = Qwen3Hybrid::load(&dir).unwrap();
    assert!(
        model.checkpoint().mtp.is_some(),
        "{name}: MTP layer not loaded"
    );
    let (v, h) = (model.config().vocab_size, model.config().hidden_size);
    let bytes = std::fs::read(dir.join("mtp_reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let tokens = ids(&st, "mtp_prompt.tokens");
    let n = tokens.len();
    let draft = ids(&st, "draft.tokens");
    for chunk in [n, 1, 7] {
        let tag = format!("{name} passes of {chunk}");
        let mut s = model.new_state();
        let (mut logits, mut hidden) = (vec![], vec![]);
        for c in tokens.chunks(chunk) {
            let (l, hd) = model.forward_hidden(c, &mut s, Logits::All).unwrap();
            logits.extend(l);
            hidden.extend(hd);
        }
        check_rows(&tag, &st, "mtp_prompt.", (&logits, &hidden), v);
        let (mut mlogits, mut mhidden) = (vec![], vec![]);
        for (i, c) in tokens[1..].chunks(chunk).enumerate() {
            let at = i * chunk * h;
            let hd = &hidden[at..at + c.len() * h];
            let (l, o) = model.mtp_forward(c, hd, &mut s, Logits::All).unwrap();
            mlogits.extend(l);
            mhidden.extend(o);
        }
        check_rows(&tag, &st, "mtp_prompt.mtp_", (&mlogits, &mhidden), v);
        // Two chained drafts after the prompt: the main model's next token with its last hidden
        // state, then the first draft with the MTP layer's own output.
        let g = argmax(&logits[(n - 1) * v..]);
        assert_eq!(g, draft[0], "{tag}: greedy next token");
        let (d1, o1) = model
            .mtp_forward(&[g], &hidden[(n - 1) * h..], &mut s, Logits::Last)
            .unwrap();
        assert_eq!(argmax(&d1), draft[1], "{tag}: first draft");
        let (d2, o2) = model
            .mtp_forward(&[draft[1]], &o1, &mut s, Logits::Last)
            .unwrap();
        let (dl, dh) = ([d1, d2].concat(), [o1, o2].concat());
        check_rows(&tag, &st, "draft.", (&dl, &dh), v);
        assert_eq!(s.pos, n, "{tag}: the MTP layer moved the main state");
    }
}

#[test]
fn mtp_layer_matches_reference_qwen3_5_moe() {
    check("mtp_qwen3_5_moe");
}

#[test]
fn mtp_layer_matches_reference_qwen3_next() {
    check("mtp_qwen3_next");
}

#[test]
fn a_config_naming_an_mtp_layer_the_files_lack_loads_without_it() {
    let d = copy_fixture("qwen3_next");
    edit_quantization(d.path(), |v| v["mtp_num_hidden_layers"] = 1.into());
    let model = Qwen3Hybrid::load(d.path()).unwrap();
    assert!(model.checkpoint().mtp.is_none());
    let mut s = model.new_state();
    let e = model.mtp_forward(
        &[1],
        &vec![0.0; model.config().hidden_size],
        &mut s,
        Logits::Last,
    );
    let e = e.unwrap_err().to_string();
    assert!(e.contains("no MTP layer") && !e.contains('\n'), "{e}");
}

#[test]
fn an_incomplete_mtp_layer_is_refused_by_name() {
    // qwen3_5_moe carries a stray `mtp.fc.weight` and nothing else of the layer.
    let d = copy_fixture("qwen3_5_moe");
    edit_quantization(d.path(), |v| {
        v["text_config"]["mtp_num_hidden_layers"] = 1.into()
    });
    let e = load_err(d.path());
    assert!(e.contains("mtp.pre_fc_norm_embedding.weight"), "{e}");
}

/// Greedy decoding of `n` tokens after `prompt`, one token a step; the state after the last
/// token but one has run (the last is sampled, not run).
fn plain(model: &Qwen3Hybrid, prompt: &[u32], n: usize) -> (Vec<u32>, SequenceState) {
    let v = model.config().vocab_size;
    let mut s = model.new_state();
    let mut out = vec![argmax(
        &model.forward(prompt, &mut s, Logits::Last).unwrap(),
    )];
    while out.len() < n {
        let l = model
            .forward(&out[out.len() - 1..], &mut s, Logits::Last)
            .unwrap();
        out.push(argmax(&l[..v]));
    }
    (out, s)
}

/// Greedy speculative decoding with drafts from `draft` (given the tokens so far): a verify pass
/// over the last token and the drafts, the longest agreeing prefix kept, then the pass's own
/// next token. Returns at least `n` tokens and the state, as [`plain`]'s.
fn speculative(
    model: &Qwen3Hybrid,
    prompt: &[u32],
    n: usize,
    mut draft: impl FnMut(&[u32]) -> Vec<u32>,
) -> (Vec<u32>, SequenceState) {
    let v = model.config().vocab_size;
    let mut s = model.new_state();
    let mut out = vec![argmax(
        &model.forward(prompt, &mut s, Logits::Last).unwrap(),
    )];
    while out.len() < n {
        let d = draft(&out);
        let pass: Vec<u32> = std::iter::once(out[out.len() - 1])
            .chain(d.iter().copied())
            .collect();
        let ver = model.verify(&pass, &mut s).unwrap();
        let mut i = 0;
        while i < d.len() && argmax(&ver.logits[i * v..(i + 1) * v]) == d[i] {
            i += 1;
        }
        model.commit(&mut s, &ver, i + 1).unwrap();
        out.extend(&d[..i]);
        out.push(argmax(&ver.logits[i * v..(i + 1) * v]));
    }
    (out, s)
}

#[test]
fn speculative_greedy_equals_plain_greedy_and_rolls_back_exactly() {
    for name in [
        "qwen3_next",
        "qwen3_5_moe",
        "mlx_qwen3_next_q4",
        "fp8_qwen3_5_moe",
        "gptq_qwen3_next",
    ] {
        let model = Qwen3Hybrid::load(&fixture(name)).unwrap();
        let vocab = model.config().vocab_size as u32;
        let prompt: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % vocab).collect();
        let (gold, _) = plain(&model, &prompt, 40);
        for n_draft in 1..=3 {
            // Drafts from the true continuation with one wrong token at a place that cycles
            // through every accept length 0..=n_draft.
            let mut calls = 0;
            let (out, s) = speculative(&model, &prompt, 30, |so_far| {
                let wrong = calls % (n_draft + 1);
                calls += 1;
                (0..n_draft)
                    .map(|j| {
                        let g = gold[(so_far.len() + j).min(gold.len() - 1)];
                        if j == wrong {
                            (g + 1) % vocab
                        } else {
                            g
                        }
                    })
                    .collect()
            });
            let tag = format!("{name}, {n_draft} drafts");
            assert_eq!(out[..], gold[..out.len()], "{tag}: tokens");
            let (_, want) = plain(&model, &prompt, out.len());
            assert_eq!(s.pos, want.pos, "{tag}: position");
            for (i, (a, b)) in s.layers.iter().zip(&want.layers).enumerate() {
                let same = match (a, b) {
                    (
                        LayerState::Linear { conv, recurrent },
                        LayerState::Linear {
                            conv: c2,
                            recurrent: r2,
                        },
                    ) => conv == c2 && recurrent == r2,
                    (LayerState::Full(x), LayerState::Full(y)) => x.k == y.k && x.v == y.v,
                    _ => false,
                };
                assert!(same, "{tag}: layer {i} state differs from plain decoding");
            }
        }
    }
}
