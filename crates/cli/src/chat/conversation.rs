//! The turn logic of `chat`, free of terminal I/O: the conversation's messages, the ids fed to
//! its sequence, and which ids the next turn must prefill.

use anyhow::Result;
use deltamoe_engine::chat::{ChatMessage, ChatTemplate};
use deltamoe_engine::tokenizer::TextTokenizer;

/// What to feed the sequence before the next reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TurnPlan {
    /// The sequence already holds the first `reused` prompt ids: feed only `tokens`, the rest.
    Extend { reused: usize, tokens: Vec<u32> },
    /// Drop the sequence and feed the whole prompt to a fresh one; `diverged` when the template
    /// rendered the history differently from the ids the sequence holds.
    Restart { tokens: Vec<u32>, diverged: bool },
}

impl TurnPlan {
    /// The ids to prefill.
    pub fn tokens(&self) -> &[u32] {
        match self {
            TurnPlan::Extend { tokens, .. } | TurnPlan::Restart { tokens, .. } => tokens,
        }
    }
}

/// The messages of a conversation and the token ids fed to its sequence so far.
#[derive(Clone, Debug, Default)]
pub struct Conversation {
    system: Option<String>,
    messages: Vec<ChatMessage>,
    fed: Vec<u32>,
}

fn message(role: &str, content: &str) -> ChatMessage {
    ChatMessage {
        role: role.into(),
        content: content.into(),
    }
}

impl Conversation {
    /// An empty conversation, opened by `system` when given.
    pub fn new(system: Option<String>) -> Conversation {
        let mut c = Conversation {
            system,
            ..Default::default()
        };
        c.reset();
        c
    }

    /// Forgets every message but the system one, and the fed ids.
    pub fn reset(&mut self) {
        self.messages.clear();
        self.messages
            .extend(self.system.as_deref().map(|s| message("system", s)));
        self.fed.clear();
    }

    pub fn messages(&self) -> &[ChatMessage] {
        &self.messages
    }

    /// The ids the sequence holds.
    pub fn fed(&self) -> &[u32] {
        &self.fed
    }

    pub fn push_user(&mut self, text: &str) {
        self.messages.push(message("user", text));
    }

    pub fn push_assistant(&mut self, text: &str) {
        self.messages.push(message("assistant", text));
    }

    /// Undoes a failed turn: drops the messages from the last user one on, and the fed ids
    /// (the sequence's state is unknown after an error).
    pub fn abort_turn(&mut self) {
        if let Some(i) = self.messages.iter().rposition(|m| m.role == "user") {
            self.messages.truncate(i);
        }
        self.fed.clear();
    }

    /// Which ids to prefill for the tokenized rendering `prompt` of the whole conversation.
    pub fn plan(&self, prompt: &[u32]) -> TurnPlan {
        if !self.fed.is_empty() && prompt.len() > self.fed.len() && prompt.starts_with(&self.fed) {
            return TurnPlan::Extend {
                reused: self.fed.len(),
                tokens: prompt[self.fed.len()..].to_vec(),
            };
        }
        TurnPlan::Restart {
            tokens: prompt.to_vec(),
            diverged: !self.fed.is_empty() && !prompt.starts_with(&self.fed),
        }
    }

    /// Records that `plan` was prefilled.
    pub fn apply(&mut self, plan: &TurnPlan) {
        if let TurnPlan::Restart { .. } = plan {
            self.fed.clear();
        }
        self.fed.extend_from_slice(plan.tokens());
    }

    /// Records one generated id fed during decoding.
    pub fn push_fed(&mut self, id: u32) {
        self.fed.push(id);
    }
}

/// Renders the conversation with the generation prompt and tokenizes it (no special tokens
/// added: the template writes them).
pub fn prompt_ids(
    tpl: &ChatTemplate,
    tok: &TextTokenizer,
    conv: &Conversation,
) -> Result<Vec<u32>> {
    Ok(tok.encode(&tpl.render(conv.messages(), true)?, false)?)
}

/// Speed and caching figures of one reply.
#[derive(Clone, Debug, Default)]
pub struct TurnStats {
    pub prefilled: usize,
    /// Prompt ids already held by the sequence (0 on a fresh one).
    pub reused: usize,
    /// A fresh sequence was needed because the history rendered differently.
    pub diverged: bool,
    pub prefill_secs: f64,
    pub generated: usize,
    pub decode_secs: f64,
    pub hit_eos: bool,
    /// Ctrl-C ended the reply.
    pub interrupted: bool,
}

impl TurnStats {
    /// One line, e.g. `prefill: 12 new tokens (reused 40) in 0.01 s (...) | decode: ...`.
    pub fn line(&self) -> String {
        let cache = match (self.reused, self.diverged) {
            (0, true) => "fresh sequence: the history rendered differently".to_string(),
            (0, false) => "fresh sequence".to_string(),
            (n, _) => format!("reused {n}"),
        };
        format!(
            "prefill: {} new tokens ({cache}) in {:.3} s ({:.1} tok/s) | decode: {} tokens in {:.3} s ({:.1} tok/s){}",
            self.prefilled,
            self.prefill_secs,
            self.prefilled as f64 / self.prefill_secs.max(1e-9),
            self.generated,
            self.decode_secs,
            self.generated.saturating_sub(1) as f64 / self.decode_secs.max(1e-9),
            match (self.hit_eos, self.interrupted) {
                (true, _) => "",
                (_, true) => " | interrupted (Ctrl-C)",
                _ => " | stopped at --max-tokens or the context limit",
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn plan_extends_a_prefix_and_restarts_otherwise() {
        let mut c = Conversation::new(None);
        let p1 = c.plan(&[1, 2, 3]);
        assert_eq!(
            p1,
            TurnPlan::Restart {
                tokens: vec![1, 2, 3],
                diverged: false
            }
        );
        c.apply(&p1);
        c.push_fed(4);
        assert_eq!(c.fed(), &[1, 2, 3, 4]);
        let p2 = c.plan(&[1, 2, 3, 4, 5, 6]);
        assert_eq!(
            p2,
            TurnPlan::Extend {
                reused: 4,
                tokens: vec![5, 6]
            }
        );
        c.apply(&p2);
        assert_eq!(c.fed(), &[1, 2, 3, 4, 5, 6]);
        // Re-rendered differently: a fresh sequence with everything.
        let p3 = c.plan(&[1, 2, 9, 4, 5, 6, 7]);
        assert_eq!(
            p3,
            TurnPlan::Restart {
                tokens: vec![1, 2, 9, 4, 5, 6, 7],
                diverged: true
            }
        );
        c.apply(&p3);
        assert_eq!(c.fed(), p3.tokens());
        // Nothing new to feed: restart (the last logits are gone).
        assert!(matches!(
            c.plan(c.fed()),
            TurnPlan::Restart {
                diverged: false,
                ..
            }
        ));
    }

    #[test]
    fn reset_and_abort_keep_the_system_message() {
        let mut c = Conversation::new(Some("be brief".into()));
        c.push_user("a");
        c.push_assistant("b");
        c.push_user("c");
        c.push_fed(7);
        c.abort_turn();
        let roles: Vec<&str> = c.messages().iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant"]);
        assert!(c.fed().is_empty());
        c.reset();
        assert_eq!(c.messages().len(), 1);
        assert_eq!(c.messages()[0].content, "be brief");
    }

    /// Two turns on the fixture's ChatML template and tokenizer: the reply's ids re-tokenize
    /// the same, so the second turn only feeds the new user message.
    #[test]
    fn second_turn_feeds_only_the_new_message() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3_5_moe");
        let tok = TextTokenizer::from_dir(&dir).unwrap().unwrap();
        let tpl = ChatTemplate::from_dir(&dir).unwrap().unwrap();
        let mut c = Conversation::new(Some("You are terse.".into()));
        c.push_user("Hello there!");
        let p1 = c.plan(&prompt_ids(&tpl, &tok, &c).unwrap());
        assert!(matches!(
            p1,
            TurnPlan::Restart {
                diverged: false,
                ..
            }
        ));
        c.apply(&p1);
        let reply = tok.encode("General Kenobi.", false).unwrap();
        for &id in &reply {
            c.push_fed(id);
        }
        c.push_assistant(&tok.decode(&reply, false).unwrap());
        c.push_user("How are you?");
        let full = prompt_ids(&tpl, &tok, &c).unwrap();
        let TurnPlan::Extend { reused, tokens } = c.plan(&full) else {
            panic!("expected an extension")
        };
        assert_eq!(reused, p1.tokens().len() + reply.len());
        let tail = tok.decode(&tokens, false).unwrap();
        assert_eq!(
            tail,
            "<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
        );
    }
}
