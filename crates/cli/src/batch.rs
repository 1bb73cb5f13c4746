//! `generate --prompts-file`: many prompts run as one batch through the engine's scheduler, one
//! JSON line per completion on stdout, in input order.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use deltamoe_engine::model_text::ModelText;
use deltamoe_engine::scheduler::{Event, FinishReason, Request, Scheduler, SchedulerConfig};
use deltamoe_engine::tokenizer::TextTokenizer;
use serde_json::json;

use crate::commands::{encode_prompt, engine_for, load_model, sampling, GenerateArgs};

/// Sequences decoded together unless `--max-seqs` says otherwise.
const DEFAULT_MAX_SEQS: usize = 16;

/// What one prompt produced so far.
#[derive(Default)]
struct Completion {
    prompt_tokens: usize,
    tokens: Vec<u32>,
    /// Set when the request has ended.
    end: Option<std::result::Result<FinishReason, String>>,
}

/// The prompts of `file`: one JSON string per line, blank lines skipped.
fn read_prompts(file: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("--prompts-file {}", file.display()))?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let p: String = serde_json::from_str(line).with_context(|| {
            format!(
                "--prompts-file {} line {}: expected a JSON string such as \"Hello\"",
                file.display(),
                i + 1
            )
        })?;
        prompts.push(p);
    }
    if prompts.is_empty() {
        bail!("--prompts-file {}: no prompts in the file", file.display());
    }
    Ok(prompts)
}

pub fn run(a: &GenerateArgs, file: &Path) -> Result<()> {
    let texts = read_prompts(file)?;
    let text_side = ModelText::load(&a.model.dir()?)?;
    let Some(tok) = &text_side.tokenizer else {
        bail!(
            "--prompts-file: {} has no tokenizer.json to encode the prompts",
            text_side.origin.display()
        );
    };
    let model = load_model(&a.model)?;
    let defaults = text_side.defaults(&model.config().eos_token_ids);
    let prompts = texts
        .iter()
        .map(|t| encode_prompt(a, t, &text_side, tok))
        .collect::<Result<Vec<_>>>()?;
    let max_seqs = match a.max_seqs {
        Some(0) => bail!("--max-seqs must be at least 1"),
        Some(n) => n,
        None => DEFAULT_MAX_SEQS,
    };
    let max_seqs = max_seqs.min(prompts.len());
    let mut engine = engine_for(model, &a.model, max_seqs)?;
    a.speculative.apply(&mut engine)?;
    let cfg = SchedulerConfig {
        max_seqs,
        prefill_chunk: a.prefill_chunk.unwrap_or(usize::MAX),
        checkpoint_every: 0,
        cache_bytes: 0,
        max_context: engine.max_context(),
    };
    if cfg.prefill_chunk == 0 {
        bail!("--prefill-chunk must be at least 1");
    }
    let mut sched = Scheduler::new(engine, cfg);
    let sampling = sampling(&a.sampling, &defaults)?;
    let mut done = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        done.push(Completion {
            prompt_tokens: prompt.len(),
            ..Completion::default()
        });
        sched.submit(Request {
            prompt,
            sampling: sampling.clone(),
            max_tokens: a.max_tokens,
            stop_ids: defaults.eos_token_ids.clone(),
        });
    }
    complete(sched, tok, done)
}

/// Steps `sched` until every request has ended, printing each completion once it and all
/// before it are done; fails when some prompt failed.
fn complete(mut sched: Scheduler, tok: &TextTokenizer, mut done: Vec<Completion>) -> Result<()> {
    let t0 = Instant::now();
    let n = done.len();
    let (mut printed, mut failed) = (0, 0);
    let mut out = std::io::stdout().lock();
    while !sched.is_idle() {
        for (id, ev) in sched.step() {
            // Requests were submitted in input order, so a request's id is its index.
            let c = &mut done[id.0 as usize];
            match ev {
                Event::Started { .. } => {}
                Event::Token(t) => c.tokens.push(t),
                Event::Finished(r) => c.end = Some(Ok(r)),
                Event::Failed(e) => c.end = Some(Err(e)),
            }
        }
        while let Some(Completion { end: Some(end), .. }) = done.get(printed) {
            failed += print(&mut out, printed, &done[printed], end, tok)? as usize;
            printed += 1;
        }
    }
    report(&sched, t0.elapsed().as_secs_f64());
    if failed > 0 {
        bail!("{failed} of {n} prompts failed; their lines give the reason under \"error\"");
    }
    Ok(())
}

/// Prints completion `i`, ended by `end`, as one JSON line; returns whether it failed.
fn print(
    out: &mut impl Write,
    i: usize,
    c: &Completion,
    end: &std::result::Result<FinishReason, String>,
    tok: &TextTokenizer,
) -> Result<bool> {
    let line = match end {
        Ok(reason) => json!({"index": i, "text": tok.decode(&c.tokens, true)?,
            "finish_reason": reason.as_str(), "prompt_tokens": c.prompt_tokens,
            "completion_tokens": c.tokens.len()}),
        Err(e) => json!({"index": i, "error": e}),
    };
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(end.is_err())
}

/// One line on stderr: tokens, time and the mean decode batch.
fn report(sched: &Scheduler, secs: f64) {
    let s = sched.stats();
    eprintln!(
        "batch: {} prompt tokens and {} generated tokens in {secs:.3} s ({:.1} generated tok/s), {} decode steps of {:.1} sequences on average",
        s.prompt_tokens,
        s.generated_tokens,
        s.generated_tokens as f64 / secs.max(1e-9),
        s.decode_steps,
        s.decode_rows as f64 / s.decode_steps.max(1) as f64
    );
    let drafts = sched.engine().speculative_tokens();
    if drafts > 0 {
        eprintln!(
            "speculative: {} drafts kept in {} sequence steps of up to {drafts} ({:.2} tokens per sequence step)",
            s.accepted_drafts,
            s.decode_rows,
            (s.decode_rows + s.accepted_drafts) as f64 / s.decode_rows.max(1) as f64
        );
    }
}
