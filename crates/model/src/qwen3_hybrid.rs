//! The Qwen3 hybrid family (Qwen3-Next, Qwen3.5/3.6 MoE, Qwen3.5 dense): embedding; per layer
//! `h = x + mixer(norm(x))`, `out = h + ffn(norm(h))` with the mixer Gated DeltaNet or gated
//! full attention and the ffn a dense MLP or a sparse MoE; final norm; lm_head (tied to the
//! embedding when configured). Norms here are zero-centred: `x / rms(x) · (1 + w)` (mlx-lm
//! checkpoints store `1 + w`, see [`crate::quant::Layout`]). Any linear, the embedding and the
//! lm_head may be MLX affine-quantized; an embedding lookup dequantizes its row.

use std::path::Path;
use std::sync::Arc;

use deltamoe_compute::cpu::norm::rms_norm;
use deltamoe_compute::cpu::rope::Rope;

use crate::checkpoint::{Checkpoint, Ffn, Layer, Mixer, Moe};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::expert_store::{ExpertStore, MoeLayer};
use crate::layers::attention::KvCache;
use crate::layers::Products;
use crate::layers::{ExpertStats, OffloadedExperts};
use crate::source::ModelSource;
use crate::state::{LayerState, SequenceState};
use crate::weights::WeightStore;
use crate::Logits;

/// A GDN layer's (conv, recurrent) states after one position of a verify pass.
type GdnStates = (Vec<f32>, Vec<f32>);

/// A verify pass's results ([`Qwen3Hybrid::verify`]).
pub struct Verified {
    /// Logits of every position, `[T, V]`.
    pub logits: Vec<f32>,
    /// Final hidden states (after the final norm) of every position, `[T, H]`.
    pub hidden: Vec<f32>,
    /// Per layer, per position: the GDN states after it (empty for attention).
    states: Vec<Vec<GdnStates>>,
    /// The sequence's position before the pass.
    pos0: usize,
}

/// A loaded model on the CPU: its checkpoint's weights and how the CPU runs them.
pub struct Qwen3Hybrid {
    ckpt: Checkpoint,
    rope: Rope,
    /// Multi-token GDN passes with the GPU's chunked-rule roundings (see
    /// [`Self::set_gdn_gpu_roundings`]).
    gdn_gpu_roundings: bool,
    /// Multi-token passes with the GPU prefill's bf16 products (see
    /// [`Self::set_bf16_products`]).
    bf16_products: bool,
    /// Per layer: where an MoE layer's routed experts are read from when offloaded (see
    /// [`Self::offload_experts`]).
    expert_offload: Vec<Option<Arc<OffloadedExperts>>>,
}

impl AsRef<Checkpoint> for Qwen3Hybrid {
    fn as_ref(&self) -> &Checkpoint {
        &self.ckpt
    }
}

impl Qwen3Hybrid {
    /// Load the model at `path`: a directory's `config.json` and safetensors weights, or a
    /// GGUF file (see [`ModelSource`]).
    pub fn load(path: &Path) -> Result<Qwen3Hybrid> {
        Qwen3Hybrid::load_with_progress(path, &mut |_| {})
    }

    /// [`Self::load`], reporting a GGUF file's tensors as they are unpacked.
    pub fn load_with_progress(
        path: &Path,
        progress: &mut dyn FnMut(crate::Progress),
    ) -> Result<Qwen3Hybrid> {
        let (config, store) = ModelSource::resolve(path)?.open_with_progress(progress)?;
        Qwen3Hybrid::from_store(config, &store)
    }

    /// Build from a parsed config and an opened store; every tensor's shape is checked here.
    pub fn from_store(config: ModelConfig, store: &WeightStore) -> Result<Qwen3Hybrid> {
        Ok(Qwen3Hybrid::new(Checkpoint::from_store(config, store)?))
    }

    /// The CPU model of a loaded checkpoint.
    pub fn new(ckpt: Checkpoint) -> Qwen3Hybrid {
        let c = &ckpt.config;
        Qwen3Hybrid {
            rope: Rope::new(c.rotary_dim, c.rope_theta),
            gdn_gpu_roundings: false,
            bf16_products: false,
            expert_offload: vec![None; ckpt.layers.len()],
            ckpt,
        }
    }

    /// The weights as loaded (what the GPU model uploads).
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.ckpt
    }

    pub fn config(&self) -> &ModelConfig {
        &self.ckpt.config
    }

    /// Run the Gated DeltaNet layers' multi-token passes through the CPU twin of the GPU's
    /// chunked delta rule (`cpu::gdn_bf16`: q, k, v and the kernel's intermediates rounded to
    /// bf16 where it rounds them): the CPU reference with the same roundings that the chunked
    /// GPU prefill is checked against.
    pub fn set_gdn_gpu_roundings(&mut self, on: bool) {
        self.gdn_gpu_roundings = on;
    }

    /// Run the multi-token passes' linear products with the roundings of the GPU prefill's bf16
    /// products (`gpu::PrefillGemm::Bf16`, see [`crate::layers::Products`]; the lm_head stays
    /// exact on both): with [`Self::set_gdn_gpu_roundings`], the CPU reference the default GPU
    /// prefill is checked against.
    pub fn set_bf16_products(&mut self, on: bool) {
        self.bf16_products = on;
    }

    /// The MoE layers.
    fn moes(&self) -> impl Iterator<Item = (usize, &Moe)> {
        self.ckpt
            .layers
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match &l.ffn {
                Ffn::Moe(m) => Some((i, m)),
                Ffn::Dense(_) => None,
            })
    }

    /// Run the routed experts from the checkpoint files in `dir` (the model's own directory)
    /// instead of the memory mapping: each MoE layer keeps `slots` experts in memory and reads
    /// the others with positioned reads when a pass uses them (see
    /// [`crate::layers::offloaded`]). The logits stay bitwise the same.
    pub fn offload_experts(&mut self, dir: &Path, slots: usize) -> Result<()> {
        if let ModelSource::Gguf(f) = ModelSource::resolve(dir)? {
            return Err(ModelError::Input(format!(
                "{}: expert offload reads the experts from safetensors files, not GGUF; convert the file once (`deltamoe convert --model {} --out DIR`, the same values) and run --model DIR --expert-cache, or run without --expert-cache",
                f.display(),
                f.display()
            )));
        }
        let store = WeightStore::open(dir)?;
        let layers: Vec<MoeLayer> = self
            .moes()
            .map(|(i, m)| MoeLayer {
                prefix: format!("model.layers.{i}.mlp"),
                experts: &m.experts,
            })
            .collect();
        if layers.is_empty() {
            return Err(ModelError::Input(format!(
                "{}: the model has no MoE layers, so it has no routed experts to offload",
                dir.display()
            )));
        }
        let es = Arc::new(ExpertStore::open(&store, &layers)?);
        let moes: Vec<usize> = self.moes().map(|(i, _)| i).collect();
        for (k, i) in moes.into_iter().enumerate() {
            let o = OffloadedExperts::new(es.clone(), k, slots)?;
            self.expert_offload[i] = Some(Arc::new(o));
        }
        Ok(())
    }

    /// Cache slots per MoE layer that `bytes` hold over all MoE layers together (at most every
    /// expert).
    pub fn expert_slots_for_bytes(&self, bytes: usize) -> usize {
        let layers: Vec<&Moe> = self.moes().map(|(_, m)| m).collect();
        let Some(x) = layers.first().and_then(|m| m.experts.first()) else {
            return 0;
        };
        let per_expert = x.nbytes();
        crate::residency::slots_for_bytes(bytes, layers.len(), per_expert, layers[0].experts.len())
    }

    /// Offload statistics summed over the MoE layers, when the experts are offloaded.
    pub fn expert_stats(&self) -> Option<ExpertStats> {
        self.expert_offload
            .iter()
            .flatten()
            .map(|o| o.stats())
            .reduce(|a, b| a.add(&b))
    }

    /// Cache slots per MoE layer, when the experts are offloaded.
    pub fn expert_cache_slots(&self) -> Option<usize> {
        self.expert_offload
            .iter()
            .flatten()
            .map(|o| o.slots())
            .next()
    }

    /// Fresh per-sequence state: empty KV caches, zero conv and recurrent states.
    /// Bytes of state (f32) one sequence holds after `ctx` tokens.
    pub fn state_bytes(&self, ctx: usize) -> usize {
        let c = self.config();
        let kv = 2 * ctx * c.num_kv_heads * c.head_dim;
        self.ckpt
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Linear(g) => g.conv_state_len() + g.recurrent_state_len(),
                Mixer::Full(_) => kv,
            })
            .sum::<usize>()
            * 4
    }

    pub fn new_state(&self) -> SequenceState {
        let layers = self
            .ckpt
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Linear(g) => LayerState::Linear {
                    conv: vec![0.0; g.conv_state_len()],
                    recurrent: vec![0.0; g.recurrent_state_len()],
                },
                Mixer::Full(_) => LayerState::Full(KvCache::default()),
            })
            .collect();
        SequenceState {
            pos: 0,
            layers,
            mtp: KvCache::default(),
        }
    }

    /// Run `tokens` (appended after the state's position) through the model in one pass per
    /// layer, updating `state`, and return logits as asked.
    pub fn forward(
        &self,
        tokens: &[u32],
        state: &mut SequenceState,
        which: Logits,
    ) -> Result<Vec<f32>> {
        Ok(self.forward_rows(tokens, state, which, which)?.0)
    }

    /// [`Self::forward`], also returning the final hidden states (after the final norm, what
    /// the lm_head reads) of every row, `[T, H]`: what the MTP layer takes.
    pub fn forward_hidden(
        &self,
        tokens: &[u32],
        state: &mut SequenceState,
        which: Logits,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        self.forward_rows(tokens, state, which, Logits::All)
    }

    /// The layers over `tokens`, then the final norm over the rows `hidden` asks for (which
    /// holds those `which` asks for) and the lm_head over `which`'s: (logits, normed rows).
    fn forward_rows(
        &self,
        tokens: &[u32],
        state: &mut SequenceState,
        which: Logits,
        hidden: Logits,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (c, w) = (&self.ckpt.config, &self.ckpt);
        let mut x = self.embed(tokens)?;
        self.run_layers(&mut x, state, self.products(tokens.len()), None)?;
        let h = c.hidden_size;
        let mut rows = match hidden {
            Logits::All => x,
            Logits::Last => x.split_off(x.len().saturating_sub(h)),
        };
        rms_norm(&mut rows, &w.final_norm, c.rms_norm_eps);
        let logits = self.lm_head(last_rows(&rows, h, which));
        Ok((logits, rows))
    }

    /// Run the MTP layer over `tokens.len()` pairs (token t + 1, final hidden state at t) from
    /// the MTP cache's next position on, appending to `state.mtp`: the logits predicting each
    /// pair's next token and the layer's normed outputs, which a further draft step takes as
    /// its hidden state, of every row (`[T, V]`, `[T, H]`) or of the last as `which` says. The
    /// positions are the hidden states' (t), as in vLLM; the main model's state is not touched.
    pub fn mtp_forward(
        &self,
        tokens: &[u32],
        hidden: &[f32],
        state: &mut SequenceState,
        which: Logits,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (c, w) = (&self.ckpt.config, &self.ckpt);
        let Some(m) = &w.mtp else {
            return Err(ModelError::Input(
                "this checkpoint has no MTP layer (no mtp.* tensors)".into(),
            ));
        };
        let e = self.embed(tokens)?;
        let (t, h) = (tokens.len(), c.hidden_size);
        if hidden.len() != t * h {
            return Err(ModelError::Input(format!(
                "MTP: {} hidden values for {t} tokens of hidden size {h}",
                hidden.len()
            )));
        }
        let mut cat = vec![0.0f32; t * 2 * h];
        for ((row, e), hd) in cat
            .chunks_exact_mut(2 * h)
            .zip(e.chunks_exact(h))
            .zip(hidden.chunks_exact(h))
        {
            let (a, b) = row.split_at_mut(h);
            a.copy_from_slice(e);
            rms_norm(a, &m.embed_norm, c.rms_norm_eps);
            b.copy_from_slice(hd);
            rms_norm(b, &m.hidden_norm, c.rms_norm_eps);
        }
        let products = self.products(t);
        let mut x = m.fc.forward(&cat, t, products);
        let pos0 = state.mtp.k.len() / self.kv_row();
        let mut st = LayerState::Full(std::mem::take(&mut state.mtp));
        let ran = self.block(&m.layer, None, &mut st, &mut x, (t, pos0), products, None);
        if let LayerState::Full(cache) = st {
            state.mtp = cache;
        }
        ran?;
        let mut rows = last_rows(&x, h, which).to_vec();
        rms_norm(&mut rows, &m.norm, c.rms_norm_eps);
        Ok((self.lm_head(&rows), rows))
    }

    /// The verify pass of speculative decoding: `tokens` (the last sampled token, then the
    /// drafts) from the state's position on, in one pass whose every row is bitwise what decode
    /// would give it (products over all rows, each GDN layer's conv and delta rule one token at a
    /// time), keeping each position's GDN states so that [`Self::commit`] can leave the state
    /// of any prefix without running anything again.
    pub fn verify(&self, tokens: &[u32], state: &mut SequenceState) -> Result<Verified> {
        let (c, w) = (&self.ckpt.config, &self.ckpt);
        let mut x = self.embed(tokens)?;
        let pos0 = state.pos;
        let mut states = Vec::with_capacity(w.layers.len());
        self.run_layers(&mut x, state, Products::Exact, Some(&mut states))?;
        rms_norm(&mut x, &w.final_norm, c.rms_norm_eps);
        Ok(Verified {
            logits: self.lm_head(&x),
            hidden: x,
            states,
            pos0,
        })
    }

    /// Keep the first `n` positions of a verify pass (1 ≤ n ≤ its length): the state becomes
    /// exactly what decoding those `n` tokens one by one leaves (GDN states as kept, KV caches
    /// cut back), the rejected positions gone.
    pub fn commit(&self, state: &mut SequenceState, v: &Verified, n: usize) -> Result<()> {
        let t = state.pos - v.pos0;
        if n == 0 || n > t {
            return Err(ModelError::Input(format!(
                "commit of {n} positions of a verify pass of {t}"
            )));
        }
        let row = self.kv_row();
        for (st, keep) in state.layers.iter_mut().zip(&v.states) {
            match st {
                LayerState::Linear { conv, recurrent } => {
                    let (kc, kr) = &keep[n - 1];
                    conv.copy_from_slice(kc);
                    recurrent.copy_from_slice(kr);
                }
                LayerState::Full(cache) => cache.truncate((v.pos0 + n) * row),
            }
        }
        state.pos = v.pos0 + n;
        Ok(())
    }

    /// Cut the MTP layer's KV cache back to its first `rows` pairs (drafts whose tokens were
    /// rejected).
    pub fn truncate_mtp(&self, state: &mut SequenceState, rows: usize) {
        state.mtp.truncate(rows * self.kv_row());
    }

    /// Every decoder layer over `x` ([T, H]) from the state's position on, advancing the state.
    /// With `steps` (a verify pass), each layer's GDN states after every position are pushed
    /// there, one list per layer (empty for attention layers).
    fn run_layers(
        &self,
        x: &mut [f32],
        state: &mut SequenceState,
        products: Products,
        mut steps: Option<&mut Vec<Vec<GdnStates>>>,
    ) -> Result<()> {
        let (t, pos0) = (x.len() / self.ckpt.config.hidden_size, state.pos);
        let layers = self.ckpt.layers.iter().zip(&self.expert_offload);
        for ((layer, offload), st) in layers.zip(state.layers.iter_mut()) {
            let mut keep = Vec::new();
            let k = steps.is_some().then_some(&mut keep);
            self.block(layer, offload.as_deref(), st, x, (t, pos0), products, k)?;
            if let Some(steps) = steps.as_deref_mut() {
                steps.push(keep);
            }
        }
        state.pos += t;
        Ok(())
    }

    /// Floats of one position in a full-attention layer's K (or V) cache.
    fn kv_row(&self) -> usize {
        let c = &self.ckpt.config;
        c.num_kv_heads * c.head_dim
    }

    /// Embedding rows of `tokens` ([T, H]), checked against the vocabulary.
    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        let (c, w) = (&self.ckpt.config, &self.ckpt);
        if tokens.is_empty() {
            return Err(ModelError::Input(
                "no tokens to run: the prompt is empty".into(),
            ));
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(ModelError::Input(format!(
                "token id {bad} is out of range: the model's vocab_size is {}",
                c.vocab_size
            )));
        }
        let h = c.hidden_size;
        let mut x = vec![0.0f32; tokens.len() * h];
        for (row, &id) in x.chunks_exact_mut(h).zip(tokens) {
            w.embed.row_f32(id as usize, row);
        }
        Ok(x)
    }

    /// Multi-token passes take the GPU prefill's bf16 products when asked to.
    fn products(&self, t: usize) -> Products {
        match self.bf16_products && t > 1 {
            true => Products::Bf16,
            false => Products::Exact,
        }
    }

    /// One decoder block over `x` ([t, H], positions `pos0..`), in place:
    /// `h = x + mixer(norm(x))`, `out = h + ffn(norm(h))`. With `keep`, a GDN mixer runs its
    /// steps one token at a time and keeps each position's state there (a verify pass).
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        layer: &Layer,
        offload: Option<&OffloadedExperts>,
        st: &mut LayerState,
        x: &mut [f32],
        (t, pos0): (usize, usize),
        products: Products,
        keep: Option<&mut Vec<GdnStates>>,
    ) -> Result<()> {
        let c = &self.ckpt.config;
        let mut n = x.to_vec();
        rms_norm(&mut n, &layer.input_norm, c.rms_norm_eps);
        let mixed = match (&layer.mixer, st) {
            (Mixer::Linear(g), LayerState::Linear { conv, recurrent }) => match keep {
                Some(keep) => g.forward_steps(&n, t, (conv, recurrent), products, keep),
                None => g.forward(&n, t, (conv, recurrent), (self.gdn_gpu_roundings, products)),
            },
            (Mixer::Full(a), LayerState::Full(cache)) => {
                a.forward(&n, t, pos0, &self.rope, cache, products)
            }
            _ => {
                return Err(ModelError::Input(
                    "sequence state does not belong to this model".into(),
                ))
            }
        };
        x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
        let mut n = x.to_vec();
        rms_norm(&mut n, &layer.post_norm, c.rms_norm_eps);
        let f = match &layer.ffn {
            Ffn::Dense(m) => m.forward(&n, t, products),
            Ffn::Moe(m) => m.forward(&n, t, offload, products)?,
        };
        x.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
        Ok(())
    }

    /// Logits of normed rows `[n, H]`.
    fn lm_head(&self, rows: &[f32]) -> Vec<f32> {
        let c = &self.ckpt.config;
        let n = rows.len() / c.hidden_size;
        let mut logits = vec![0.0; n * c.vocab_size];
        self.ckpt.lm_head.matmul(rows, n, &mut logits);
        logits
    }
}

/// The rows of `x` ([T, h]) that `which` asks for: all, or the last.
fn last_rows(x: &[f32], h: usize, which: Logits) -> &[f32] {
    match which {
        Logits::All => x,
        Logits::Last => &x[x.len().saturating_sub(h)..],
    }
}
