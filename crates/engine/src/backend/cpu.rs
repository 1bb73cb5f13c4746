//! The CPU backend: the host model runs each sequence's tokens; the sequences of a step run
//! one after another and sample on the host.

use std::collections::BTreeMap;

use deltamoe_model::layers::ExpertStats;
use deltamoe_model::{Logits, Qwen3Hybrid, SequenceState};

use super::{wrong_backend, Backend, SavedState, StepRow};
use crate::error::{no_such_sequence, Result};
use crate::sequence::SeqId;

/// The host model and the model states of the sequences on the CPU.
pub struct CpuBackend {
    model: Qwen3Hybrid,
    states: BTreeMap<SeqId, SequenceState>,
}

impl CpuBackend {
    pub fn new(model: Qwen3Hybrid) -> CpuBackend {
        CpuBackend {
            model,
            states: BTreeMap::new(),
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn free_sequences(&self) -> Option<usize> {
        None
    }

    fn sequence_bytes(&self, ctx: usize) -> usize {
        self.model.state_bytes(ctx)
    }

    fn add(&mut self, id: SeqId) -> Result<()> {
        self.states.insert(id, self.model.new_state());
        Ok(())
    }

    fn remove(&mut self, id: SeqId) {
        self.states.remove(&id);
    }

    fn snapshot(&self, id: SeqId) -> Result<SavedState> {
        let s = self.states.get(&id).ok_or_else(|| no_such_sequence(id))?;
        Ok(SavedState {
            bytes: s.bytes(),
            state: Box::new(s.clone()),
        })
    }

    fn restore(&mut self, id: SeqId, saved: &SavedState) -> Result<()> {
        let s = saved.state.downcast_ref::<SequenceState>();
        let s = s.ok_or_else(wrong_backend)?;
        self.states.insert(id, s.clone());
        Ok(())
    }

    fn prefill(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        chunk: usize,
        which: Logits,
    ) -> Result<Vec<f32>> {
        let st = self
            .states
            .get_mut(&id)
            .ok_or_else(|| no_such_sequence(id))?;
        let mut out = Vec::new();
        for part in tokens.chunks(chunk) {
            let logits = self.model.forward(part, st, which)?;
            match which {
                Logits::All => out.extend_from_slice(&logits),
                Logits::Last => out = logits,
            }
        }
        Ok(out)
    }

    fn step(&mut self, rows: &mut [StepRow]) -> Result<Vec<u32>> {
        rows.iter_mut()
            .map(|row| {
                let st = self
                    .states
                    .get_mut(&row.id)
                    .ok_or_else(|| no_such_sequence(row.id))?;
                let logits = self.model.forward(&[row.token], st, Logits::Last)?;
                Ok(row.sampler.sample(&logits, row.history))
            })
            .collect()
    }

    fn expert_stats(&self) -> Option<ExpertStats> {
        self.model.expert_stats()
    }
}
