//! The engine: a model plus the sequences it serves. Prefill runs a prompt in one pass per layer
//! (optionally in chunks of at most N tokens); decode runs one token per sequence. On the CPU,
//! sequences of a decode step run one after another.

use std::collections::BTreeMap;

use deltamoe_model::{Logits, Qwen3Hybrid};

use crate::error::{EngineError, Result};
use crate::sequence::{SeqId, Sequence};

pub struct Engine {
    model: Qwen3Hybrid,
    sequences: BTreeMap<SeqId, Sequence>,
    next_id: u64,
}

impl Engine {
    pub fn new(model: Qwen3Hybrid) -> Engine {
        Engine {
            model,
            sequences: BTreeMap::new(),
            next_id: 0,
        }
    }

    pub fn model(&self) -> &Qwen3Hybrid {
        &self.model
    }

    /// Start an empty sequence.
    pub fn add_sequence(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let seq = Sequence {
            id,
            tokens: Vec::new(),
            state: self.model.new_state(),
        };
        self.sequences.insert(id, seq);
        id
    }

    /// Drop a sequence and its state.
    pub fn remove_sequence(&mut self, id: SeqId) -> Option<Sequence> {
        self.sequences.remove(&id)
    }

    pub fn sequence(&self, id: SeqId) -> Option<&Sequence> {
        self.sequences.get(&id)
    }

    fn seq_mut(&mut self, id: SeqId) -> Result<&mut Sequence> {
        self.sequences
            .get_mut(&id)
            .ok_or_else(|| EngineError::Input(format!("sequence {} does not exist", id.0)))
    }

    /// Feed `tokens` to sequence `id` in passes of at most `chunk` tokens (all at once when
    /// `None`). Returns logits `[T, vocab]` for `Logits::All` or the last row for `Logits::Last`.
    pub fn prefill(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        chunk: Option<usize>,
        which: Logits,
    ) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::Input(
                "the prompt is empty: give at least one token".into(),
            ));
        }
        let max_ctx = self.model.config().max_position_embeddings;
        let chunk = chunk.unwrap_or(tokens.len());
        if chunk == 0 {
            return Err(EngineError::Input(
                "--prefill-chunk must be at least 1".into(),
            ));
        }
        let model = &self.model;
        let seq = self
            .sequences
            .get_mut(&id)
            .ok_or_else(|| EngineError::Input(format!("sequence {} does not exist", id.0)))?;
        if seq.state.pos + tokens.len() > max_ctx {
            return Err(EngineError::Input(format!(
                "{} tokens do not fit the context: {} already used of max_position_embeddings {}",
                tokens.len(),
                seq.state.pos,
                max_ctx
            )));
        }
        let mut out = Vec::new();
        for part in tokens.chunks(chunk) {
            let logits = model.forward(part, &mut seq.state, which)?;
            seq.tokens.extend_from_slice(part);
            match which {
                Logits::All => out.extend_from_slice(&logits),
                Logits::Last => out = logits,
            }
        }
        Ok(out)
    }

    /// One decode step: feed one token to each listed sequence; returns each one's logits.
    pub fn decode(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<Vec<f32>>> {
        batch
            .iter()
            .map(|&(id, tok)| {
                self.seq_mut(id)?;
                self.prefill(id, &[tok], None, Logits::Last)
            })
            .collect()
    }
}
