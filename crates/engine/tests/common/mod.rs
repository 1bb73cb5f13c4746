//! Shared by the golden tests: the committed fixtures and their transformers references.

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;

/// The fixtures directory: beside the sources when built here, or `./fixtures` when the test
/// binary runs from a copy of the repository (the GPU machine).
fn root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    if here.is_dir() {
        here
    } else {
        PathBuf::from("fixtures")
    }
}

pub fn fixtures() -> Vec<PathBuf> {
    let root = root();
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.safetensors").exists() && p.join("config.json").exists())
        .collect();
    v.sort();
    assert!(
        v.len() >= 4,
        "expected the committed fixtures in {}",
        root.display()
    );
    v
}

pub struct Prompt {
    pub tokens: Vec<u32>,
    pub logits: Vec<f32>,
    pub greedy: Vec<u32>,
}

fn i64s(st: &SafeTensors, name: &str) -> Vec<u32> {
    let t = st.tensor(name).unwrap();
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap();
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn prompts(dir: &Path) -> Vec<Prompt> {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    (0..2)
        .map(|i| Prompt {
            tokens: i64s(&st, &format!("prompt{i}.tokens")),
            logits: f32s(&st, &format!("prompt{i}.logits")),
            greedy: i64s(&st, &format!("prompt{i}.greedy")),
        })
        .collect()
}

/// `fixtures/gguf_quant`: each GGUF file with its prompts (tokens and transformers' f32 logits on
/// gguf-py's dequantization of that file; no greedy continuation is recorded).
pub fn gguf_prompts() -> Vec<(PathBuf, Vec<Prompt>)> {
    let dir = root().join("gguf_quant");
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let files = [
        ("qwen3_5_moe_q.q4_k_m", "q4_k_m.", ""),
        ("qwen3_5_moe_q.iq4_xs", "iq4_xs.", ""),
        ("qwen3_5_moe_q.q6_k_mix", "q6_k_mix.", ""),
        ("qwen3_next_q.q8_0", "qwen3_next.", "qwen3_next."),
    ];
    files
        .iter()
        .map(|(file, kind, tok)| {
            let prompts = [("tokens", "logits"), ("chat.tokens", "chat.logits")]
                .iter()
                .map(|(t, l)| Prompt {
                    tokens: i64s(&st, &format!("{tok}{t}")),
                    logits: f32s(&st, &format!("{kind}{l}")),
                    greedy: Vec::new(),
                })
                .collect();
            (dir.join(format!("{file}.gguf")), prompts)
        })
        .collect()
}

pub fn check_logits(name: &str, got: &[f32], want: &[f32], vocab: usize) {
    assert_eq!(got.len(), want.len(), "{name}: logits length");
    let max_ref = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    let rows = want.len() / vocab;
    let argmax = |r: &[f32]| {
        r.iter()
            .enumerate()
            .fold(0, |bi, (i, v)| if *v > r[bi] { i } else { bi })
    };
    let agree = got
        .chunks_exact(vocab)
        .zip(want.chunks_exact(vocab))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    eprintln!(
        "{name}: max err {:.2e} of max|ref| {max_ref:.3} ({:.2e}), argmax {agree}/{rows}",
        max_err,
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
}

/// Greedy continuation of `p.tokens` for as many tokens as the reference has, no EOS stop.
pub fn greedy(engine: &mut deltamoe_engine::Engine, p: &Prompt) -> Vec<u32> {
    let req = deltamoe_engine::GenerateRequest {
        prompt: &p.tokens,
        max_tokens: p.greedy.len(),
        sampling: deltamoe_engine::sampler::SamplingParams::default(),
        eos: &[],
        prefill_chunk: None,
    };
    deltamoe_engine::generate(engine, &req, |_| Ok(true))
        .unwrap()
        .0
}

/// Greedy continuations of several prompts decoded together: sequence i joins the batched
/// steps `i * stagger` steps after the first, so rows sit at different positions. Returns each
/// prompt's generated tokens (as many as its `greedy`).
pub fn greedy_batched(
    engine: &mut deltamoe_engine::Engine,
    ps: &[&Prompt],
    stagger: usize,
) -> Vec<Vec<u32>> {
    use deltamoe_model::Logits;
    let ids: Vec<_> = ps.iter().map(|_| engine.add_sequence().unwrap()).collect();
    let mut next: Vec<u32> = Vec::new();
    for (p, &id) in ps.iter().zip(&ids) {
        let (&last, head) = p.tokens.split_last().unwrap();
        if !head.is_empty() {
            engine.prefill(id, head, None, Logits::Last).unwrap();
        }
        next.push(last);
    }
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); ps.len()];
    for step in 0.. {
        if out.iter().zip(ps).all(|(o, p)| o.len() == p.greedy.len()) {
            break;
        }
        let rows: Vec<usize> = (0..ps.len())
            .filter(|&i| step >= i * stagger && out[i].len() < ps[i].greedy.len())
            .collect();
        let batch: Vec<_> = rows.iter().map(|&i| (ids[i], next[i])).collect();
        if batch.is_empty() {
            continue;
        }
        let picked = engine.step(&batch).unwrap();
        for (&i, t) in rows.iter().zip(picked) {
            out[i].push(t);
            next[i] = t;
        }
    }
    for id in ids {
        engine.remove_sequence(id);
    }
    out
}

/// Prefill the first half of a prompt, snapshot, decode greedily; then restore the snapshot
/// into a new sequence and decode again: both runs must give the same tokens and logits.
pub fn check_snapshot_resume(engine: &mut deltamoe_engine::Engine, p: &Prompt) {
    use deltamoe_model::Logits;
    let half = p.tokens.len() / 2;
    let id = engine.add_sequence().unwrap();
    engine
        .prefill(id, &p.tokens[..half], None, Logits::Last)
        .unwrap();
    let snap = engine.snapshot(id).unwrap();
    assert_eq!(snap.tokens(), &p.tokens[..half]);
    let run = |engine: &mut deltamoe_engine::Engine, id| {
        let logits = engine
            .prefill(id, &p.tokens[half..], None, Logits::Last)
            .unwrap();
        let mut toks = vec![engine.step(&[(id, 1)]).unwrap()[0]];
        for _ in 0..5 {
            toks.push(engine.step(&[(id, *toks.last().unwrap())]).unwrap()[0]);
        }
        (logits, toks)
    };
    let first = run(engine, id);
    engine.remove_sequence(id);
    let again = engine.restore(&snap).unwrap();
    assert_eq!(engine.sequence(again).unwrap().tokens, &p.tokens[..half]);
    let second = run(engine, again);
    engine.remove_sequence(again);
    assert_eq!(first.1, second.1, "tokens after restore");
    assert_eq!(first.0, second.0, "logits after restore");
}
