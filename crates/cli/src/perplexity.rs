//! `perplexity`: the perplexity of a text file under a model.
//!
//! Definition (what a Hugging Face transformers script computes the same way): the whole file is
//! tokenized with the model's tokenizer.json, adding no special tokens; the ids are split into
//! consecutive non-overlapping windows of `--ctx` tokens (a last partial window is kept when it
//! has at least 2 tokens); each window runs on a fresh sequence in one forward pass, and every
//! token but the window's first is scored by the negative log-likelihood of its log-softmax (f64
//! over the f32 logits) given the tokens before it in the window.
//! `ppl = exp(sum of NLL / number of scored tokens)`, with all windows pooled.

use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltamoe_engine::model_text::ModelText;
use deltamoe_model::Logits;
use indicatif::{ProgressBar, ProgressStyle};

use crate::commands::{engine_for, load_model};
use crate::ModelArgs;

#[derive(Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// UTF-8 text file to score.
    #[arg(long)]
    text: PathBuf,
    /// Tokens per window; each window is scored on its own, from a fresh sequence.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
}

/// Summed negative log-likelihood over scored tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NllSum {
    /// Sum of `-ln p(token | preceding tokens of its window)`.
    pub nll: f64,
    /// Number of tokens scored.
    pub count: usize,
}

impl NllSum {
    pub fn add(&mut self, other: NllSum) {
        self.nll += other.nll;
        self.count += other.count;
    }

    /// `exp(mean NLL)`; NaN when nothing was scored.
    pub fn perplexity(&self) -> f64 {
        if self.count == 0 {
            return f64::NAN;
        }
        (self.nll / self.count as f64).exp()
    }
}

/// Consecutive non-overlapping windows of `ctx` tokens over `n` tokens; the last partial window
/// is kept when it has at least 2 tokens (one to condition on, one to score).
pub fn windows(n: usize, ctx: usize) -> Vec<Range<usize>> {
    let ctx = ctx.max(1);
    (0..n)
        .step_by(ctx)
        .map(|s| s..(s + ctx).min(n))
        .filter(|r| r.len() >= 2)
        .collect()
}

/// NLL of `tokens[1..]` given the logits `[tokens.len(), vocab]` of one window: row `i` predicts
/// `tokens[i + 1]`; log-softmax is taken in f64.
pub fn window_nll(logits: &[f32], vocab: usize, tokens: &[u32]) -> Result<NllSum> {
    if vocab == 0 || logits.len() != tokens.len() * vocab {
        bail!(
            "perplexity: got {} logits for {} tokens of vocabulary {}; expected [tokens, vocab]",
            logits.len(),
            tokens.len(),
            vocab
        );
    }
    let mut sum = NllSum::default();
    for (row, &target) in logits.chunks_exact(vocab).zip(tokens.iter().skip(1)) {
        let t = target as usize;
        if t >= vocab {
            bail!("token id {t} is outside the model's vocabulary of {vocab}; the model's tokenizer.json does not match its config.json");
        }
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let sum_exp: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
        let log_z = max + sum_exp.ln();
        sum.nll += log_z - row[t] as f64;
        sum.count += 1;
    }
    Ok(sum)
}

/// Reads the text file, naming `--text` on every failure.
fn read_text(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "--text {}: cannot read it; give an existing UTF-8 text file",
            path.display()
        )
    })?;
    if text.trim().is_empty() {
        bail!(
            "--text {}: the file is empty; give a file with some text",
            path.display()
        );
    }
    Ok(text)
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    if a.ctx < 2 {
        bail!(
            "--ctx {}: a window needs at least 2 tokens; use --ctx 2 or more",
            a.ctx
        );
    }
    let dir = &a.model.dir()?;
    let text = read_text(&a.text)?;
    let Some(tok) = ModelText::load(dir)?.tokenizer else {
        bail!(
            "--model {}: no tokenizer.json; perplexity needs the model's tokenizer to read --text",
            dir.display()
        );
    };
    let ids = tok.encode(&text, false)?;
    let spans = windows(ids.len(), a.ctx);
    if spans.is_empty() {
        bail!(
            "--text {}: only {} token(s); perplexity needs at least 2",
            a.text.display(),
            ids.len()
        );
    }
    let model = load_model(&a.model)?;
    let vocab = model.config().vocab_size;
    let max_pos = model.config().max_position_embeddings;
    let longest = spans.iter().map(|r| r.len()).max().unwrap_or(0);
    if longest > max_pos {
        bail!("--ctx {}: longer than the model's max_position_embeddings {max_pos}; use --ctx {max_pos} or less", a.ctx);
    }
    let mut engine = engine_for(model, &a.model, 1)?;
    let bar = ProgressBar::new(spans.len() as u64);
    let style = ProgressStyle::with_template(
        "{elapsed_precise} [{bar:40}] {pos}/{len} windows ({eta} left) {msg}",
    )
    .context("perplexity: bad progress bar template")?;
    bar.set_style(style.progress_chars("=> "));
    let t0 = Instant::now();
    let mut total = NllSum::default();
    let mut fed = 0usize;
    for span in &spans {
        let window = &ids[span.clone()];
        let seq = engine.add_sequence()?;
        let logits = engine.prefill(seq, window, None, Logits::All);
        engine.remove_sequence(seq);
        total.add(window_nll(&logits?, vocab, window)?);
        fed += window.len();
        bar.inc(1);
        bar.set_message(format!("ppl {:.4}", total.perplexity()));
    }
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "ppl={:.4} tokens={} windows={}",
        total.perplexity(),
        total.count,
        spans.len()
    );
    eprintln!(
        "{} tokens in {} windows of at most {} in {:.3} s ({:.1} tok/s)",
        fed,
        spans.len(),
        a.ctx,
        secs,
        fed as f64 / secs.max(1e-9)
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_split_and_drop_a_single_token_tail() {
        assert_eq!(windows(5, 2), vec![0..2, 2..4]);
        assert_eq!(windows(5, 3), vec![0..3, 3..5]);
        assert_eq!(windows(6, 3), vec![0..3, 3..6]);
        assert_eq!(windows(3, 512), vec![0..3]);
        assert!(windows(1, 512).is_empty());
        assert!(windows(0, 4).is_empty());
    }

    #[test]
    fn nll_of_hand_made_logits() {
        let ln2 = 2f32.ln();
        // Vocab 3, window [1, 2, 0, 2]: rows 0..3 predict 2, 0, 2; the last row is unused.
        let logits = [
            0.0, 0.0, ln2, // p(2) = 2/4
            0.0, 0.0, ln2, // p(0) = 1/4
            5.0, 5.0, 5.0, // p(2) = 1/3
            9.0, -9.0, 0.0, // ignored
        ];
        let s = window_nll(&logits, 3, &[1, 2, 0, 2]).unwrap();
        let want = 2f64.ln() + 4f64.ln() + 3f64.ln();
        assert_eq!(s.count, 3);
        assert!((s.nll - want).abs() < 1e-6, "{} vs {want}", s.nll);
        let ppl = s.perplexity();
        assert!((ppl - 24f64.powf(1.0 / 3.0)).abs() < 1e-6, "{ppl}");
    }

    #[test]
    fn nll_is_stable_for_large_logits_and_pools_windows() {
        // Huge logits: a naive f32 exp would overflow.
        let a = window_nll(&[1000.0, 1000.0, 0.0, 0.0], 2, &[0, 1]).unwrap();
        assert!((a.nll - 2f64.ln()).abs() < 1e-9, "{}", a.nll);
        let b = window_nll(&[0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 2, &[1, 0, 1]).unwrap();
        let mut total = a;
        total.add(b);
        assert_eq!(total.count, 3);
        // Pooled over tokens, not averaged per window: every token has p = 1/2.
        assert!((total.perplexity() - 2.0).abs() < 1e-9);
        assert!(NllSum::default().perplexity().is_nan());
    }

    #[test]
    fn shape_and_vocab_errors_are_reported() {
        let e = window_nll(&[0.0; 5], 2, &[0, 1]).unwrap_err().to_string();
        assert!(e.contains("expected [tokens, vocab]"), "{e}");
        let e = window_nll(&[0.0; 4], 2, &[0, 7]).unwrap_err().to_string();
        assert!(
            e.contains("token id 7") && e.contains("vocabulary of 2"),
            "{e}"
        );
    }
}
