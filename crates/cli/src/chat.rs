//! `chat`: an interactive terminal conversation on one engine sequence.
//!
//! Each turn the whole conversation is rendered with the chat template and tokenized; when the
//! ids already fed to the sequence are a prefix of it only the new suffix is prefilled, else
//! (the template rendered the history differently) the sequence is dropped and everything is
//! prefilled on a fresh one, since the recurrent state cannot be rolled back.

use std::io::{IsTerminal, Write};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use deltamoe_engine::chat::ChatTemplate;
use deltamoe_engine::model_text::ModelText;
use deltamoe_engine::sampler::SamplingParams;
use deltamoe_engine::tokenizer::TextTokenizer;
use deltamoe_engine::{Engine, SeqId};
use deltamoe_model::Logits;
use rustyline::error::ReadlineError;

use crate::commands::{engine_for, load_model, sampling, SamplingArgs, SpeculativeArgs};
use crate::ModelArgs;

mod conversation;
mod interrupt;

pub use conversation::{prompt_ids, Conversation, TurnPlan, TurnStats};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// System message that opens the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    #[command(flatten)]
    speculative: SpeculativeArgs,
}

/// A conversation bound to an engine sequence, a template, a tokenizer and a sampler.
struct Session<'t> {
    engine: Engine,
    seq: Option<SeqId>,
    conv: Conversation,
    tpl: ChatTemplate,
    tok: &'t TextTokenizer,
    sampling: SamplingParams,
    eos: Vec<u32>,
    max_tokens: usize,
}

impl Session<'_> {
    fn reset(&mut self) {
        if let Some(s) = self.seq.take() {
            self.engine.remove_sequence(s);
        }
        self.conv.reset();
    }

    /// One user turn: prefill, then stream the reply to `out`. On error the turn is undone.
    fn turn(&mut self, user: &str, out: &mut impl Write) -> Result<TurnStats> {
        self.conv.push_user(user);
        let result = self.reply(out);
        if result.is_err() {
            if let Some(s) = self.seq.take() {
                self.engine.remove_sequence(s);
            }
            self.conv.abort_turn();
        }
        result
    }

    /// Records the drafts a step kept (all its tokens but the last) as fed.
    fn push_kept(&mut self, got: &[u32]) {
        for &d in &got[..got.len().saturating_sub(1)] {
            self.conv.push_fed(d);
        }
    }

    fn reply(&mut self, out: &mut impl Write) -> Result<TurnStats> {
        let prompt = prompt_ids(&self.tpl, self.tok, &self.conv)?;
        let mut plan = self.conv.plan(&prompt);
        if self.seq.is_none() {
            plan = TurnPlan::Restart {
                tokens: prompt,
                diverged: false,
            };
        }
        let mut stats = TurnStats {
            prefilled: plan.tokens().len(),
            ..Default::default()
        };
        let seq = match (&plan, self.seq) {
            (TurnPlan::Extend { reused, .. }, Some(s)) => {
                stats.reused = *reused;
                s
            }
            (_, old) => {
                if let Some(s) = old {
                    self.engine.remove_sequence(s);
                }
                stats.diverged = matches!(plan, TurnPlan::Restart { diverged: true, .. });
                let s = self.engine.add_sequence()?;
                self.engine.set_sampling(s, &self.sampling)?;
                self.seq = Some(s);
                s
            }
        };
        let t0 = Instant::now();
        let Some((&last, head)) = plan.tokens().split_last() else {
            bail!("chat: the turn added no tokens to the prompt");
        };
        if !head.is_empty() {
            self.engine.prefill(seq, head, None, Logits::Last)?;
        }
        // Each step returns the drafts it kept (speculative decoding; fed already) and the
        // next token.
        let mut got = self.engine.speculate(&[(seq, last)])?.swap_remove(0);
        stats.prefill_secs = t0.elapsed().as_secs_f64();
        self.conv.apply(&plan);
        self.push_kept(&got);
        let max_pos = self.engine.config().max_position_embeddings;
        let mut stream = self.tok.stream();
        let mut reply = Vec::new();
        let t1 = Instant::now();
        'steps: while reply.len() < self.max_tokens {
            for &id in &got {
                if interrupt::requested() {
                    stats.interrupted = true;
                    break 'steps;
                }
                if self.eos.contains(&id) {
                    stats.hit_eos = true;
                    break 'steps;
                }
                reply.push(id);
                if let Some(text) = stream.push(id)? {
                    write!(out, "{text}").ok();
                    out.flush().ok();
                }
                // The last id is fed with the next turn's prompt, if the history keeps it.
                if reply.len() == self.max_tokens || self.conv.fed().len() >= max_pos {
                    break 'steps;
                }
            }
            let id = got.last().copied().unwrap_or_default();
            got = self.engine.speculate(&[(seq, id)])?.swap_remove(0);
            self.conv.push_fed(id);
            self.push_kept(&got);
        }
        stats.decode_secs = t1.elapsed().as_secs_f64();
        stats.generated = reply.len();
        if let Some(text) = stream.flush()? {
            write!(out, "{text}").ok();
        }
        writeln!(out).ok();
        out.flush().ok();
        self.conv.push_assistant(&self.tok.decode(&reply, false)?);
        Ok(stats)
    }
}

/// `text` in dim style when stderr is a terminal.
fn dim(text: &str) -> String {
    if std::io::stderr().is_terminal() {
        format!("\x1b[2m{text}\x1b[0m")
    } else {
        text.to_string()
    }
}

pub fn run(a: ChatArgs) -> Result<()> {
    let text_side = ModelText::load(&a.model.dir()?)?;
    let origin = text_side.origin.display().to_string();
    let ModelText {
        tokenizer,
        template,
        ..
    } = &text_side;
    let Some(tok) = tokenizer.as_ref() else {
        bail!("--model {origin}: no tokenizer.json; chat needs the model's tokenizer");
    };
    let Some(tpl) = template.clone() else {
        bail!("--model {origin}: no chat template (tokenizer_config.json `chat_template` or chat_template.jinja); chat needs one, use generate instead");
    };
    let model = load_model(&a.model)?;
    let defaults = text_side.defaults(&model.config().eos_token_ids);
    let mut eos = defaults.eos_token_ids.clone();
    eos.extend(tpl.eos_token().and_then(|t| tok.token_id(t)));
    let mut session = Session {
        engine: {
            let mut engine = engine_for(model, &a.model, 1)?;
            a.speculative.apply(&mut engine)?;
            engine
        },
        seq: None,
        conv: Conversation::new(a.system.clone()),
        tpl,
        tok,
        sampling: sampling(&a.sampling, &defaults)?,
        eos,
        max_tokens: a.max_tokens,
    };
    let mut editor =
        rustyline::DefaultEditor::new().context("chat: cannot set up the terminal line editor")?;
    eprintln!(
        "{}",
        dim("/reset forgets the conversation, /quit (or Ctrl-D) exits, Ctrl-C ends a reply")
    );
    let mut stdout = std::io::stdout();
    loop {
        let line = match editor.readline(">>> ") {
            Ok(line) => line,
            Err(ReadlineError::Eof | ReadlineError::Interrupted) => break,
            Err(e) => return Err(e).context("chat: cannot read the terminal input"),
        };
        let input = line.trim();
        if input.is_empty() {
            continue;
        }
        editor.add_history_entry(input).ok();
        match input {
            "/quit" | "/exit" => break,
            "/reset" => {
                session.reset();
                eprintln!("{}", dim("(conversation reset)"));
            }
            cmd if cmd.starts_with('/') => {
                eprintln!("unknown command {cmd}: use /reset or /quit");
            }
            text => {
                // Ctrl-C during the reply ends it and returns here (see interrupt.rs).
                let ctrl_c = interrupt::ReplyGuard::install();
                let result = session.turn(text, &mut stdout);
                drop(ctrl_c);
                match result {
                    Ok(stats) => eprintln!("{}", dim(&stats.line())),
                    Err(e) => {
                        let msg: Vec<String> = e.chain().map(|c| c.to_string()).collect();
                        eprintln!(
                            "error: {}; the turn was dropped, /reset starts over",
                            msg.join(": ")
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
