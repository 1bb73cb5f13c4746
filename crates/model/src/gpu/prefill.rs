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

use deltamoe_compute::cuda::prefill as pf;
use deltamoe_compute::cuda::DevBuf;

use super::layers::head::LOGIT_ROWS;
use super::layers::FfnBufs;
use super::layers::{Pass, Stager};
use super::{unsupported, GpuModel, GpuSeq, Result};
use crate::Logits;

/// How prefill runs the gated delta rule of GDN layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GdnPrefill {
    /// [`GdnPrefill::Chunked`] for passes of at least [`CHUNKED_MIN_ROWS`] tokens,
    /// [`GdnPrefill::Recurrent`] for shorter ones (see [`gdn_path`]). The default.
    #[default]
    Auto,
    /// f32, token by token inside one launch per layer with the decode kernel's arithmetic: the
    /// state a prefill leaves is the one decode steps would leave.
    Recurrent,
    /// The chunked form on tensor cores (`cuda::gdn_chunk`: q, k, v rounded to bf16, bf16
    /// operands with f32 accumulation): 1.4–2.1× the end-to-end prefill speed at 4k tokens, at
    /// about 3e-3 relative per GDN output (as flash-linear-attention's kernel).
    Chunked,
}

/// Passes from this many tokens on take the chunked delta rule under [`GdnPrefill::Auto`]: one
/// full chunk of 64, below which the recurrence does the same work in fewer launches.
pub const CHUNKED_MIN_ROWS: usize = 64;

/// The delta-rule form a pass of `rows` tokens runs under `mode` (never `Auto`).
pub fn gdn_path(mode: GdnPrefill, rows: usize) -> GdnPrefill {
    match mode {
        GdnPrefill::Auto if rows >= CHUNKED_MIN_ROWS => GdnPrefill::Chunked,
        GdnPrefill::Auto => GdnPrefill::Recurrent,
        m => m,
    }
}

/// Most tokens one pass runs (the scratch is sized for this many rows at most).
pub const PREFILL_MAX_ROWS: usize = 4096;

/// Activations of one pass of up to `rows` tokens.
pub(crate) struct PrefillScratch {
    rows: usize,
    pub(crate) tok: DevBuf<i32>,
    pub(crate) slots: DevBuf<i32>,
    pub(crate) x: DevBuf<f32>,
    pub(crate) normed: DevBuf<f32>,
    pub(crate) delta: DevBuf<f32>,
    pub(crate) proj: DevBuf<f32>,
    pub(crate) mixed: DevBuf<f32>,
    pub(crate) core: DevBuf<f32>,
    pub(crate) mix_out: DevBuf<f32>,
    pub(crate) q: DevBuf<f32>,
    pub(crate) qb: DevBuf<u16>,
    pub(crate) kb: DevBuf<u16>,
    pub(crate) vb: DevBuf<u16>,
    pub(crate) gate: DevBuf<f32>,
    pub(crate) beta: DevBuf<f32>,
    pub(crate) ws: DevBuf<u8>,
    pub(crate) ffn: FfnBufs,
    pub(crate) order: DevBuf<i32>,
    pub(crate) tiles: DevBuf<i32>,
    pub(crate) n_tiles: DevBuf<i32>,
    pub(crate) logits: DevBuf<f32>,
}

impl PrefillScratch {
    fn new(m: &GpuModel, rows: usize) -> Result<PrefillScratch> {
        let (g, c, r) = (&*m.gpu, &m.cfg, rows);
        let h = c.hidden_size;
        let ks = c.experts_per_token + 1;
        let needs = super::scratch::needs(&m.layers, rows);
        let proj = needs.proj;
        let ws = needs.workspace.max(1);
        let (qd, vd, kd) = (
            c.num_heads * c.head_dim,
            c.linear_value_size(),
            c.linear_k_heads * c.linear_k_dim,
        );
        let pairs = r * ks;
        Ok(PrefillScratch {
            rows,
            tok: g.zeros(r)?,
            slots: g.zeros(r)?,
            x: g.zeros(r * h)?,
            normed: g.zeros(r * h)?,
            delta: g.zeros(r * h)?,
            proj: g.zeros(r * proj)?,
            mixed: g.zeros(r * c.conv_dim())?,
            core: g.zeros(r * vd)?,
            mix_out: g.zeros(r * qd.max(vd))?,
            q: g.zeros(r * qd)?,
            qb: g.zeros(r * kd)?,
            kb: g.zeros(r * kd)?,
            vb: g.zeros(r * vd)?,
            gate: g.zeros(r * c.linear_v_heads)?,
            beta: g.zeros(r * c.linear_v_heads)?,
            ws: g.zeros(ws)?,
            ffn: FfnBufs::new(g, c, needs, r)?,
            order: g.zeros(pairs)?,
            tiles: g.zeros(3 * pf::max_tiles(pairs, c.num_experts + 1, pf::TILE_CORES))?,
            n_tiles: g.zeros(1)?,
            logits: g.zeros(LOGIT_ROWS * c.vocab_size)?,
        })
    }
}

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
            self.prefill = Some(PrefillScratch::new(self, need)?);
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
        };
        for (i, l) in self.layers.iter().enumerate() {
            let delta = if i == 0 { 0 } else { ps.delta.ptr() };
            self.rows_norm(ps, delta, l.input_norm.ptr(), t)?;
            l.mixer.prefill(&p, pool.state(i))?;
            self.rows_norm(ps, ps.delta.ptr(), l.post_norm.ptr(), t)?;
            let stage: &Stager = &|ids: &DevBuf<i32>, pairs| self.stage_experts(i, ids, pairs);
            l.ffn.prefill(&p, stage)?;
        }
        // Final norm + lm_head for the wanted rows only.
        self.head
            .prefill_logits(&g, ps, (t, self.eps), which, out)?;
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
    fn rows_norm(&self, ps: &PrefillScratch, delta: u64, scale: u64, t: usize) -> Result<()> {
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
    pub fn set_prefill_gdn(&mut self, mode: GdnPrefill) {
        self.prefill_gdn = mode;
    }
}

#[cfg(test)]
mod tests {
    use super::{gdn_path, GdnPrefill, CHUNKED_MIN_ROWS};

    #[test]
    fn auto_takes_the_chunked_rule_from_one_full_chunk() {
        let auto = GdnPrefill::Auto;
        assert_eq!(gdn_path(auto, 1), GdnPrefill::Recurrent);
        assert_eq!(gdn_path(auto, CHUNKED_MIN_ROWS - 1), GdnPrefill::Recurrent);
        assert_eq!(gdn_path(auto, CHUNKED_MIN_ROWS), GdnPrefill::Chunked);
        assert_eq!(gdn_path(auto, 4096), GdnPrefill::Chunked);
        assert_eq!(gdn_path(GdnPrefill::Recurrent, 4096), GdnPrefill::Recurrent);
        assert_eq!(gdn_path(GdnPrefill::Chunked, 3), GdnPrefill::Chunked);
    }
}
