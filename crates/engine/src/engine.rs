//! The engine: a model plus the sequences it serves. Prefill runs a prompt in one pass per layer
//! (optionally in chunks of at most N tokens); decode runs one token per sequence. On the CPU,
//! sequences of a decode step run one after another. On CUDA every token runs the captured
//! decode graph of its sequence (prompts too, token by token, until GPU prefill lands).

use std::collections::BTreeMap;
use std::sync::Arc;

use deltamoe_compute::cuda::ops::SampleParams;
use deltamoe_compute::cuda::Gpu;
use deltamoe_model::gpu::{GpuModel, GpuSeq};
use deltamoe_model::{Logits, Qwen3Hybrid, SequenceState};

use crate::error::{EngineError, Result};
use crate::sampler::{argmax, SamplingParams};
use crate::sequence::{SeqId, Sequence};

/// Per-sequence state on the engine's backend.
pub enum SeqState {
    Cpu(SequenceState),
    Cuda(Box<GpuSeq>),
}

pub struct Engine {
    model: Qwen3Hybrid,
    gpu: Option<GpuModel>,
    /// Context per sequence on CUDA (KV caches are allocated for it up front).
    max_ctx: usize,
    sequences: BTreeMap<SeqId, Sequence>,
    next_id: u64,
}

fn no_such_sequence(id: SeqId) -> EngineError {
    EngineError::Input(format!("sequence {} does not exist", id.0))
}

fn cuda_err(e: deltamoe_compute::cuda::CudaError) -> EngineError {
    EngineError::Input(format!("cuda: {e}"))
}

impl Engine {
    /// An engine on the CPU.
    pub fn new(model: Qwen3Hybrid) -> Engine {
        let max_ctx = model.config().max_position_embeddings;
        Engine {
            model,
            gpu: None,
            max_ctx,
            sequences: BTreeMap::new(),
            next_id: 0,
        }
    }

    /// An engine on a GPU: uploads the weights; each sequence gets room for `max_ctx` tokens
    /// (capped by the model's max_position_embeddings).
    pub fn new_cuda(model: Qwen3Hybrid, gpu: Arc<Gpu>, max_ctx: usize) -> Result<Engine> {
        let max_ctx = max_ctx.min(model.config().max_position_embeddings);
        let gm = GpuModel::upload(&model, gpu).map_err(cuda_err)?;
        Ok(Engine {
            model,
            gpu: Some(gm),
            max_ctx,
            sequences: BTreeMap::new(),
            next_id: 0,
        })
    }

    pub fn model(&self) -> &Qwen3Hybrid {
        &self.model
    }

    /// `"cpu"` or the GPU's name.
    pub fn backend_name(&self) -> String {
        match &self.gpu {
            Some(g) => format!("cuda ({})", g.gpu().name()),
            None => "cpu".to_string(),
        }
    }

    /// Start an empty sequence.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let state = match &self.gpu {
            Some(g) => SeqState::Cuda(Box::new(g.new_seq(self.max_ctx).map_err(cuda_err)?)),
            None => SeqState::Cpu(self.model.new_state()),
        };
        self.sequences.insert(
            id,
            Sequence {
                id,
                tokens: Vec::new(),
                state,
            },
        );
        Ok(id)
    }

    /// Drop a sequence and its state.
    pub fn remove_sequence(&mut self, id: SeqId) -> Option<Sequence> {
        self.sequences.remove(&id)
    }

    pub fn sequence(&self, id: SeqId) -> Option<&Sequence> {
        self.sequences.get(&id)
    }

    fn check(&self, id: SeqId, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(EngineError::Input(
                "the prompt is empty: give at least one token".into(),
            ));
        }
        let seq = self
            .sequences
            .get(&id)
            .ok_or_else(|| no_such_sequence(id))?;
        let vocab = self.model.config().vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Input(format!(
                "token id {bad} is out of range: the model's vocab_size is {vocab}"
            )));
        }
        if seq.tokens.len() + tokens.len() > self.max_ctx {
            return Err(EngineError::Input(format!(
                "{} tokens do not fit the context: {} already used of {}",
                tokens.len(),
                seq.tokens.len(),
                self.max_ctx
            )));
        }
        Ok(())
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
        self.check(id, tokens)?;
        let chunk = chunk.unwrap_or(tokens.len());
        if chunk == 0 {
            return Err(EngineError::Input(
                "--prefill-chunk must be at least 1".into(),
            ));
        }
        let (model, gpu) = (&self.model, &mut self.gpu);
        let seq = self
            .sequences
            .get_mut(&id)
            .ok_or_else(|| no_such_sequence(id))?;
        let mut out = Vec::new();
        match (&mut seq.state, gpu) {
            (SeqState::Cpu(st), _) => {
                for part in tokens.chunks(chunk) {
                    let logits = model.forward(part, st, which)?;
                    match which {
                        Logits::All => out.extend_from_slice(&logits),
                        Logits::Last => out = logits,
                    }
                }
            }
            (SeqState::Cuda(st), Some(g)) => {
                for (i, &t) in tokens.iter().enumerate() {
                    g.step(st, t).map_err(cuda_err)?;
                    if which == Logits::All || i + 1 == tokens.len() {
                        out.extend_from_slice(&g.logits().map_err(cuda_err)?);
                    }
                }
            }
            (SeqState::Cuda(_), None) => {
                return Err(EngineError::Input("a CUDA sequence on a CPU engine".into()))
            }
        }
        seq.tokens.extend_from_slice(tokens);
        Ok(out)
    }

    /// One decode step: feed one token to each listed sequence; returns each one's logits.
    pub fn decode(&mut self, batch: &[(SeqId, u32)]) -> Result<Vec<Vec<f32>>> {
        batch
            .iter()
            .map(|&(id, tok)| self.prefill(id, &[tok], None, Logits::Last))
            .collect()
    }

    /// Use `p` to pick this sequence's tokens on the device, when the backend can (CUDA: greedy,
    /// temperature, top-k, top-p, min-p; returns true). The CPU picks only greedily itself
    /// (returns false; the caller samples from the logits).
    pub fn set_device_sampling(&mut self, id: SeqId, p: &SamplingParams) -> Result<bool> {
        let seq = self
            .sequences
            .get_mut(&id)
            .ok_or_else(|| no_such_sequence(id))?;
        match (&mut seq.state, &self.gpu) {
            (SeqState::Cuda(st), Some(g)) => {
                let dp = SampleParams {
                    temperature: if p.is_greedy() { 0.0 } else { p.temperature },
                    top_k: p.top_k as u32,
                    top_p: p.top_p,
                    min_p: p.min_p,
                    seed: p.seed,
                };
                g.set_sampling(st, dp).map_err(cuda_err)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Feed one token and return the next one as the backend picks it: on CUDA with the
    /// sequence's device sampling parameters (greedy unless [`Self::set_device_sampling`] set
    /// others) so only the two token ids cross between host and device; on the CPU greedily.
    pub fn decode_next(&mut self, id: SeqId, tok: u32) -> Result<u32> {
        self.check(id, &[tok])?;
        let seq = self
            .sequences
            .get_mut(&id)
            .ok_or_else(|| no_such_sequence(id))?;
        let next = match (&mut seq.state, &mut self.gpu) {
            (SeqState::Cuda(st), Some(g)) => g.step(st, tok).map_err(cuda_err)?,
            (SeqState::Cpu(st), _) => argmax(&self.model.forward(&[tok], st, Logits::Last)?) as u32,
            (SeqState::Cuda(_), None) => {
                return Err(EngineError::Input("a CUDA sequence on a CPU engine".into()))
            }
        };
        seq.tokens.push(tok);
        Ok(next)
    }
}
