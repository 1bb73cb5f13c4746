//! Prefill on the GPU: the T tokens of one sequence run through each layer together, in passes
//! of at most [`PREFILL_MAX_ROWS`] tokens (scratch for one pass, allocated on first use, so
//! memory stays bounded), continuing from the sequence's state and leaving it as T decode steps
//! would: conv and recurrent states, KV caches and position.
//!
//! Per pass: embedding rows; per layer add+RMSNorm over rows, the fused projection as a batch of
//! rows; GDN layers: causal conv over the rows from the carried conv state, q/k/v packed to bf16
//! with the gates, the chunked gated delta rule on tensor cores (`cuda::gdn_chunk`, q/k
//! normalised in the kernel) updating the slot's recurrent state, gated RMSNorm, out projection;
//! attention layers: q/k norm + RoPE + KV append at positions pos0 + t, causal attention of the
//! rows on tensor cores (`attn_prefill`), out projection; MoE: router rows and top-k, then the
//! (token, expert) pairs sorted by expert on the device so each expert's weights serve all its
//! rows (grouped products), shared expert, combine. Final norm and lm_head only for the rows whose logits are
//! wanted.

use deltamoe_compute::cuda::DevBuf;

use super::layers::{needs, Pass, PrefillGemm, PrefillScratch, Stager};
use super::{unsupported, GpuModel, GpuSeq, Result};
use crate::Logits;

/// Most tokens one pass runs (the scratch is sized for this many rows at most).
pub const PREFILL_MAX_ROWS: usize = 4096;

impl GpuModel {
    /// Feed `tokens` to `seq` in passes of at most `chunk` tokens (capped at
    /// [`PREFILL_MAX_ROWS`]), each layer running a pass's tokens together. Returns the logits of
    /// every token (`Logits::All`, `[T, vocab]`) or of the last one (`Logits::Last`, `[vocab]`);
    /// the sequence's state and position end as after T decode steps of these tokens.
    pub fn prefill(
        &mut self,
        seq: &mut GpuSeq,
        tokens: &[u32],
        which: Logits,
        chunk: usize,
    ) -> Result<Vec<f32>> {
        let ctx = self.pool()?.ctx;
        if seq.pos + tokens.len() > ctx {
            return Err(unsupported(format!(
                "{} tokens do not fit the sequence: {} of {ctx} used",
                tokens.len(),
                seq.pos
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(unsupported(format!(
                "token id {bad} is out of range: vocab_size is {}",
                self.vocab
            )));
        }
        let c = chunk.clamp(1, PREFILL_MAX_ROWS);
        let need = c.min(tokens.len()).max(1);
        if self.prefill.as_ref().is_none_or(|p| p.rows < need) {
            self.prefill = None;
            let mut needs = needs(&self.layers, need);
            if let Some(m) = &self.mtp {
                needs = needs.max(m.needs(self.hidden));
            }
            self.prefill = Some(PrefillScratch::new(&self.gpu, &self.cfg, needs, need)?);
        }
        let Some(mut ps) = self.prefill.take() else {
            return Err(unsupported("prefill scratch missing".into()));
        };
        let mut out = Vec::new();
        let mut r = Ok(());
        for part in tokens.chunks(c) {
            r = self.prefill_pass(&mut ps, seq, part, which, &mut out);
            if r.is_err() {
                break;
            }
        }
        self.prefill = Some(ps);
        r.map(|_| out)
    }

    fn prefill_pass(
        &mut self,
        ps: &mut PrefillScratch,
        seq: &mut GpuSeq,
        part: &[u32],
        which: Logits,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let t = part.len();
        let g = self.gpu.clone();
        // bf16 K and V rows of the sequence so far for the attention layers' flash attention.
        let kv = 2 * (seq.pos + t) * self.cfg.num_kv_heads * self.cfg.head_dim;
        if self.prefill_gemm == PrefillGemm::Bf16 && ps.kvb.len() < kv {
            ps.kvb = g.zeros(kv.max(ps.kvb.len() * 3 / 2))?;
        }
        let toks: Vec<i32> = part.iter().map(|&v| v as i32).collect();
        g.write(&mut ps.tok, &toks)?;
        g.write(&mut ps.slots, &vec![seq.slot as i32; t])?;
        let ps = &*ps;
        self.head.embed(&g, ps.tok.ptr(), ps.x.ptr(), t)?;
        let pool = self.pool()?;
        let p = Pass {
            g: &g,
            ps,
            t,
            slot: seq.slot,
            pos0: seq.pos,
            eps: self.eps,
            hidden: self.hidden,
            pos: pool.pos.ptr(),
            ctx: pool.ctx,
            gdn: self.prefill_gdn,
            gemm: self.prefill_gemm,
            shard: self.shard.as_ref(),
        };
        for (i, l) in self.layers.iter().enumerate() {
            let delta = if i == 0 { 0 } else { ps.delta.ptr() };
            self.rows_norm(ps, delta, l.input_norm.ptr(), t)?;
            l.mixer.prefill(&p, pool.state(i))?;
            p.sum_parts()?;
            self.rows_norm(ps, ps.delta.ptr(), l.post_norm.ptr(), t)?;
            let stage: &Stager = &|ids: &DevBuf<i32>, pairs| self.stage_experts(i, ids, pairs);
            l.ffn.prefill(&p, stage)?;
        }
        // Final norm + lm_head for the wanted rows only; with speculative decoding every row's
        // final hidden state, which the MTP layer takes with the next token.
        let mtp = self.drafts > 0 && self.mtp.is_some();
        if mtp {
            self.rows_norm(ps, ps.delta.ptr(), self.head.final_norm(), t)?;
        }
        self.head
            .prefill_logits(&g, ps, (t, self.eps, mtp), which, out)?;
        if mtp {
            self.mtp_prefill(ps, seq, t)?;
        }
        seq.pos += t;
        let pos = seq.pos as i32;
        let pool = self
            .pool
            .as_mut()
            .ok_or_else(|| unsupported("no sequence state reserved".into()))?;
        g.write_at(&mut pool.pos, seq.slot, &[pos])?;
        g.sync()
    }

    /// `x += delta` (when delta ≠ 0), `normed = rmsnorm(x)·scale` over `t` rows.
    pub(super) fn rows_norm(
        &self,
        ps: &PrefillScratch,
        delta: u64,
        scale: u64,
        t: usize,
    ) -> Result<()> {
        deltamoe_compute::cuda::ops::add_rmsnorm(
            &self.gpu,
            ps.x.ptr(),
            delta,
            scale,
            ps.normed.ptr(),
            t,
            self.hidden,
            self.eps,
        )
    }
}

impl GpuModel {
    /// How later prefills run the GDN layers' delta rule.
    pub fn set_prefill_gdn(&mut self, mode: super::GdnPrefill) {
        self.prefill_gdn = mode;
    }

    /// How later prefills run their matrix products.
    pub fn set_prefill_gemm(&mut self, mode: PrefillGemm) {
        self.prefill_gemm = mode;
    }
}
