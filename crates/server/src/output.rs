//! Turns the engine thread's token events into text for a response: incremental
//! detokenization, then stop strings (text that may begin a stop string is held back until the
//! next token tells).

use deltamoe_engine::tokenizer::{StreamDecoder, TextTokenizer};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::ApiError;
use crate::parse::partial_tag_len;
use deltamoe_engine::scheduler::{Event, FinishReason};

/// Cuts generated text at the first stop string.
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> StopStrings {
        let stops = stops.into_iter().filter(|s| !s.is_empty()).collect();
        StopStrings {
            stops,
            held: String::new(),
        }
    }

    /// Adds text; returns what can be emitted and whether a stop string was reached (the stop
    /// string and everything after it are dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(i) = first {
            let out = self.held[..i].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = partial_tag_len(&self.held, self.stops.iter().map(String::as_str));
        let out: String = self.held.drain(..self.held.len() - keep).collect();
        (out, false)
    }

    /// The text still held back, at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// What one event amounted to.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// New text (possibly empty).
    Text(String),
    /// The end, with the last text.
    Done(String, FinishReason),
}

/// A request's generated text as it arrives.
pub struct TextStream<'t> {
    decoder: StreamDecoder<'t>,
    stops: StopStrings,
    /// Tokens received.
    pub tokens: usize,
    /// Prompt tokens served from the prompt cache.
    pub cached: usize,
    /// When the first token came (for the request log's time to first token).
    pub first: Option<Instant>,
}

impl<'t> TextStream<'t> {
    pub fn new(tok: &'t TextTokenizer, stops: Vec<String>) -> TextStream<'t> {
        TextStream {
            decoder: tok.stream(),
            stops: StopStrings::new(stops),
            tokens: 0,
            cached: 0,
            first: None,
        }
    }

    /// Waits for the next event that produces text or ends the request.
    pub async fn next(&mut self, rx: &mut UnboundedReceiver<Event>) -> Result<Step, ApiError> {
        loop {
            let Some(ev) = rx.recv().await else {
                return Err(ApiError::internal(
                    "the engine stopped before the reply was complete",
                ));
            };
            if let Some(step) = self.on_event(ev)? {
                return Ok(step);
            }
        }
    }

    /// Applies one event; `None` when it carries no text.
    pub fn on_event(&mut self, ev: Event) -> Result<Option<Step>, ApiError> {
        let decode_err = |e: deltamoe_engine::EngineError| ApiError::internal(e.to_string());
        match ev {
            Event::Started { cached } => {
                self.cached = cached;
                Ok(None)
            }
            Event::Token(id) => {
                self.tokens += 1;
                self.first.get_or_insert_with(Instant::now);
                let text = self.decoder.push(id).map_err(decode_err)?;
                let (out, stopped) = self.stops.push(&text.unwrap_or_default());
                Ok(Some(if stopped {
                    Step::Done(out, FinishReason::Stop)
                } else {
                    Step::Text(out)
                }))
            }
            Event::Finished(reason) => {
                let tail = self.decoder.flush().map_err(decode_err)?;
                let (mut out, stopped) = self.stops.push(&tail.unwrap_or_default());
                if stopped {
                    return Ok(Some(Step::Done(out, FinishReason::Stop)));
                }
                out.push_str(&self.stops.finish());
                Ok(Some(Step::Done(out, reason)))
            }
            Event::Failed(msg) => Err(ApiError::internal(format!("generation failed: {msg}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (t, stopped) = s.push(p);
            out.push_str(&t);
            if stopped {
                return (out, true);
            }
        }
        out.push_str(&s.finish());
        (out, false)
    }

    #[test]
    fn stop_strings_across_pieces() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D more"]),
            ("abc ".into(), true)
        );
        assert_eq!(run(&["END"], &["abc EN", "x"]), ("abc ENx".into(), false));
        assert_eq!(run(&["END"], &["abc EN"]), ("abc EN".into(), false));
        assert_eq!(run(&["b", "xyz"], &["axy", "zb"]), ("a".into(), true));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn held_text_is_not_emitted_early() {
        let mut s = StopStrings::new(vec!["</s>".into()]);
        assert_eq!(s.push("hi <"), ("hi ".into(), false));
        assert_eq!(s.push("/"), (String::new(), false));
        assert_eq!(s.push("b>"), ("</b>".into(), false));
    }
}
