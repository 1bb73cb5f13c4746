//! The CPU backend: the host model runs each sequence's tokens; the sequences of a step run
//! one after another and sample on the host. With speculative decoding on, the model's MTP
//! layer drafts tokens that one verify pass checks (see [`Backend::speculate`]).

use std::collections::BTreeMap;

use deltamoe_model::layers::ExpertStats;
use deltamoe_model::{Logits, Qwen3Hybrid, SequenceState};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{wrong_backend, Backend, SavedState, StepRow};
use crate::error::{no_such_sequence, EngineError, Result};
use crate::sequence::SeqId;
use crate::speculative::{accept, Dist};

/// A sequence's model state and, with speculative decoding on, what its MTP cache still lacks.
#[derive(Clone)]
struct Seq {
    state: SequenceState,
    /// Final hidden states (`[k, H]`) of the last fed positions whose (next token, hidden
    /// state) pairs the MTP layer has not seen yet.
    pending_hidden: Vec<f32>,
    /// The tokens after all but the last of them (the last one's comes with the next step).
    pending_tokens: Vec<u32>,
}

/// The host model and the model states of the sequences on the CPU.
pub struct CpuBackend {
    model: Qwen3Hybrid,
    seqs: BTreeMap<SeqId, Seq>,
    /// Drafts a speculative step makes at most (0: speculative decoding off).
    drafts: usize,
    /// Benchmarks: each draft kept with this probability instead of by the rule, drawn here.
    forced: Option<(f64, StdRng)>,
}

impl CpuBackend {
    pub fn new(model: Qwen3Hybrid) -> CpuBackend {
        CpuBackend {
            model,
            seqs: BTreeMap::new(),
            drafts: 0,
            forced: None,
        }
    }

    /// Feeds `tokens` in one pass; with speculative decoding on, keeps their hidden states for
    /// the MTP layer.
    fn feed(&mut self, id: SeqId, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let spec = self.drafts > 0;
        let model = &self.model;
        let seq = self.seqs.get_mut(&id).ok_or_else(|| no_such_sequence(id))?;
        if !spec {
            return Ok(model.forward(tokens, &mut seq.state, which)?);
        }
        let (logits, hidden) = model.forward_hidden(tokens, &mut seq.state, which)?;
        // Each earlier pending hidden state now has its next token.
        let skip = usize::from(seq.pending_hidden.is_empty());
        seq.pending_tokens.extend(tokens.iter().skip(skip));
        seq.pending_hidden.extend_from_slice(&hidden);
        Ok(logits)
    }

    /// One speculative step of `row`'s sequence: the MTP layer drafts up to `row.drafts` tokens
    /// after `row.token`, one verify pass runs the token and the drafts, the acceptance rule
    /// keeps a prefix of the drafts and picks the token after it, and the state keeps exactly
    /// the fed tokens. Returns the kept drafts and the next token.
    fn speculate_row(&mut self, row: &mut StepRow) -> Result<Vec<u32>> {
        let has_pairs = self
            .seqs
            .get(&row.id)
            .is_some_and(|s| !s.pending_hidden.is_empty());
        if row.drafts == 0 || !has_pairs {
            let logits = self.feed(row.id, &[row.token], Logits::Last)?;
            return Ok(vec![row.sampler.sample(&logits, row.history)]);
        }
        let h = self.model.config().hidden_size;
        let model = &self.model;
        let seq = self
            .seqs
            .get_mut(&row.id)
            .ok_or_else(|| no_such_sequence(row.id))?;
        let (drafts, q) = draft(model, seq, row)?;
        // Verify the token and the drafts in one pass, keep what the rule accepts.
        let fed: Vec<u32> = std::iter::once(row.token)
            .chain(drafts.iter().copied())
            .collect();
        let v = model.verify(&fed, &mut seq.state)?;
        let vocab = v.logits.len() / fed.len();
        let p: Vec<Dist> = (0..fed.len())
            .map(|j| {
                let hist = [row.history, &drafts[..j]].concat();
                row.sampler
                    .probs(&v.logits[j * vocab..(j + 1) * vocab], &hist)
            })
            .collect();
        let (kept, next) = match &mut self.forced {
            None => accept(&drafts, &q, &p, row.sampler),
            Some((prob, rng)) => {
                let kept = (0..drafts.len())
                    .find(|_| rng.random::<f64>() >= *prob)
                    .unwrap_or(drafts.len());
                (kept, row.sampler.pick(&p[kept]))
            }
        };
        model.commit(&mut seq.state, &v, kept + 1)?;
        seq.pending_hidden = v.hidden[..(kept + 1) * h].to_vec();
        seq.pending_tokens = drafts[..kept].to_vec();
        Ok(drafts[..kept].iter().copied().chain([next]).collect())
    }
}

/// Drafts `row.drafts` tokens after `row.token` with the MTP layer: one pass over the pairs its
/// cache lacks (the last with `row.token`), then each draft with the layer's own output. Each
/// draft is drawn from the row's sampling distribution over the layer's logits, returned with
/// it. The MTP cache keeps only the pairs of fed tokens.
fn draft(model: &Qwen3Hybrid, seq: &mut Seq, row: &mut StepRow) -> Result<(Vec<u32>, Vec<Dist>)> {
    let pos = seq.state.pos;
    seq.pending_tokens.push(row.token);
    let tokens = std::mem::take(&mut seq.pending_tokens);
    let hidden = std::mem::take(&mut seq.pending_hidden);
    let (mut logits, mut out) =
        model.mtp_forward(&tokens, &hidden, &mut seq.state, Logits::Last)?;
    let mut history = row.history.to_vec();
    let (mut drafts, mut q) = (Vec::new(), Vec::new());
    loop {
        let qj = row.sampler.probs(&logits, &history);
        let d = row.sampler.pick(&qj);
        drafts.push(d);
        q.push(qj);
        if drafts.len() == row.drafts {
            break;
        }
        history.push(d);
        (logits, out) = model.mtp_forward(&[d], &out, &mut seq.state, Logits::Last)?;
    }
    model.truncate_mtp(&mut seq.state, pos);
    Ok((drafts, q))
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
        let seq = Seq {
            state: self.model.new_state(),
            pending_hidden: Vec::new(),
            pending_tokens: Vec::new(),
        };
        self.seqs.insert(id, seq);
        Ok(())
    }

    fn remove(&mut self, id: SeqId) {
        self.seqs.remove(&id);
    }

    fn snapshot(&self, id: SeqId) -> Result<SavedState> {
        let s = self.seqs.get(&id).ok_or_else(|| no_such_sequence(id))?;
        Ok(SavedState {
            bytes: s.state.bytes() + 4 * s.pending_hidden.len(),
            state: Box::new(s.clone()),
        })
    }

    fn restore(&mut self, id: SeqId, saved: &SavedState) -> Result<()> {
        let s = saved.state.downcast_ref::<Seq>();
        let s = s.ok_or_else(wrong_backend)?;
        self.seqs.insert(id, s.clone());
        Ok(())
    }

    fn prefill(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        chunk: usize,
        which: Logits,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        for part in tokens.chunks(chunk) {
            let logits = self.feed(id, part, which)?;
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
                let logits = self.feed(row.id, &[row.token], Logits::Last)?;
                Ok(row.sampler.sample(&logits, row.history))
            })
            .collect()
    }

    fn set_speculative(&mut self, drafts: usize) -> Result<()> {
        if drafts > 0 && self.model.checkpoint().mtp.is_none() {
            return Err(no_mtp_layer());
        }
        if !self.seqs.is_empty() {
            return Err(EngineError::Input(
                "speculative decoding is set before any sequence starts".into(),
            ));
        }
        self.drafts = drafts;
        Ok(())
    }

    fn force_acceptance(&mut self, p: f64) -> Result<()> {
        self.forced = Some((p, StdRng::seed_from_u64(0)));
        Ok(())
    }

    fn speculate(&mut self, rows: &mut [StepRow]) -> Result<Vec<Vec<u32>>> {
        rows.iter_mut()
            .map(|row| {
                row.drafts = row.drafts.min(self.drafts);
                self.speculate_row(row)
            })
            .collect()
    }

    fn expert_stats(&self) -> Option<ExpertStats> {
        self.model.expert_stats()
    }
}

/// The lock step's tests run CPU members in place of GPUs.
#[cfg(test)]
impl super::sharded::Member for CpuBackend {
    fn feed_tokens(&mut self, rows: &[(SeqId, u32)]) -> Result<()> {
        rows.iter()
            .try_for_each(|&(id, t)| self.feed(id, &[t], Logits::Last).map(|_| ()))
    }
}

/// The error for speculative decoding on a model without an MTP layer.
pub(crate) fn no_mtp_layer() -> EngineError {
    EngineError::Input(
        "--speculative-tokens needs the model's MTP layer, and this checkpoint has none (no mtp.* \
         tensors; mlx-lm conversions drop them): leave --speculative-tokens out"
            .into(),
    )
}
