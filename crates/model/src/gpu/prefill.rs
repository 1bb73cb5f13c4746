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

use deltamoe_compute::cuda::gdn_chunk::{self, GdnChunkBufs, GdnChunkDims};
use deltamoe_compute::cuda::ops::{self, Batch, Slots};
use deltamoe_compute::cuda::prefill::{self as pf, GdnPacked, Grouped};
use deltamoe_compute::cuda::{DevBuf, Gpu};

use super::{unsupported, GpuFfn, GpuMixer, GpuModel, GpuSeq, Result};
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
/// Rows of logits computed per lm_head launch for `Logits::All`.
const LOGIT_ROWS: usize = 64;

/// Activations of one pass of up to `rows` tokens.
pub(super) struct PrefillScratch {
    rows: usize,
    tok: DevBuf<i32>,
    slots: DevBuf<i32>,
    x: DevBuf<f32>,
    normed: DevBuf<f32>,
    delta: DevBuf<f32>,
    proj: DevBuf<f32>,
    mixed: DevBuf<f32>,
    core: DevBuf<f32>,
    mix_out: DevBuf<f32>,
    q: DevBuf<f32>,
    qb: DevBuf<u16>,
    kb: DevBuf<u16>,
    vb: DevBuf<u16>,
    gate: DevBuf<f32>,
    beta: DevBuf<f32>,
    ws: DevBuf<u8>,
    router: DevBuf<f32>,
    ids: DevBuf<i32>,
    weights: DevBuf<f32>,
    sg: DevBuf<f32>,
    h: DevBuf<f32>,
    y: DevBuf<f32>,
    hs: DevBuf<f32>,
    ys: DevBuf<f32>,
    order: DevBuf<i32>,
    tiles: DevBuf<i32>,
    n_tiles: DevBuf<i32>,
    logits: DevBuf<f32>,
}

impl PrefillScratch {
    fn new(m: &GpuModel, rows: usize) -> Result<PrefillScratch> {
        let (g, c, r) = (&*m.gpu, &m.cfg, rows);
        let h = c.hidden_size;
        let ks = c.experts_per_token + 1;
        let (mut proj, mut inter, mut shared_inter, mut gdn) = (0, 0, 0, None);
        for l in &m.layers {
            match &l.mixer {
                GpuMixer::Linear { proj: p, dims, .. } => {
                    proj = proj.max(p.n);
                    gdn = Some(*dims);
                }
                GpuMixer::Full { proj: p, .. } => proj = proj.max(p.n),
            }
            match &l.ffn {
                GpuFfn::Dense { gate_up, .. } => inter = inter.max(gate_up.n / 2),
                GpuFfn::Moe {
                    experts_gu, shared, ..
                } => {
                    inter = inter.max(experts_gu.n / 2 * ks);
                    if let Some((gu, _)) = shared {
                        shared_inter = shared_inter.max(gu.n / 2);
                    }
                }
            }
        }
        let ws = match gdn {
            Some(d) => gdn_chunk::workspace_bytes(GdnChunkDims {
                t: rows,
                hk: d.hk,
                hv: d.hv,
                dk: d.dk,
                dv: d.dv,
            }),
            None => 1,
        };
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
            router: g.zeros(r * (c.num_experts + 1))?,
            ids: g.zeros(pairs)?,
            weights: g.zeros(pairs)?,
            sg: g.zeros(r)?,
            h: g.zeros(r * inter)?,
            y: g.zeros(pairs * h)?,
            hs: g.zeros(r * shared_inter)?,
            ys: g.zeros(r * h)?,
            order: g.zeros(pairs)?,
            tiles: g.zeros(3 * pf::max_tiles(pairs, c.num_experts + 1, pf::TILE_CORES))?,
            n_tiles: g.zeros(1)?,
            logits: g.zeros(LOGIT_ROWS * c.vocab_size)?,
        })
    }
}

/// `ops::matvec` (or SwiGLU when `swiglu`) over `t` input rows of `xs` floats.
#[allow(clippy::too_many_arguments)]
fn rows_mv(
    g: &Gpu,
    m: ops::Matvec,
    x: u64,
    y: u64,
    t: usize,
    xs: usize,
    swiglu: bool,
) -> Result<()> {
    let sl = Slots::rows(t, xs);
    if swiglu {
        ops::matvec_swiglu(g, m, x, y, sl)
    } else {
        ops::matvec(g, m, x, y, sl)
    }
}

/// Byte offset of slot `slot` in a per-layer state array of `per_slot` floats per slot.
fn slot_at(buf: &Option<DevBuf<f32>>, slot: usize, per_slot: usize) -> u64 {
    buf.as_ref().map_or(0, |b| b.at(slot * per_slot))
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
        ops::embed(
            &g,
            self.embed.mv(),
            ps.tok.ptr(),
            ps.x.ptr(),
            self.hidden,
            t,
        )?;
        for i in 0..self.layers.len() {
            let delta = if i == 0 { 0 } else { ps.delta.ptr() };
            self.rows_norm(ps, delta, self.layers[i].input_norm.ptr(), t)?;
            match &self.layers[i].mixer {
                GpuMixer::Linear { .. } => self.prefill_gdn(ps, i, seq, t)?,
                GpuMixer::Full { .. } => self.prefill_attention(ps, i, seq, t)?,
            }
            self.rows_norm(ps, ps.delta.ptr(), self.layers[i].post_norm.ptr(), t)?;
            self.prefill_ffn(ps, i, t)?;
        }
        // Final norm + lm_head for the wanted rows only.
        let h = self.hidden;
        let first = match which {
            Logits::All => 0,
            Logits::Last => t - 1,
        };
        let mut r0 = first;
        while r0 < t {
            let n = (t - r0).min(LOGIT_ROWS);
            ops::add_rmsnorm(
                &g,
                ps.x.at(r0 * h),
                ps.delta.at(r0 * h),
                self.final_norm.ptr(),
                ps.normed.at(r0 * h),
                n,
                h,
                self.eps,
            )?;
            rows_mv(
                &g,
                self.lm_head.mv(),
                ps.normed.at(r0 * h),
                ps.logits.ptr(),
                n,
                h,
                false,
            )?;
            let got = g.read(&ps.logits, n * self.vocab)?;
            match which {
                Logits::All => out.extend_from_slice(&got),
                Logits::Last => *out = got,
            }
            r0 += n;
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
    fn rows_norm(&self, ps: &PrefillScratch, delta: u64, scale: u64, t: usize) -> Result<()> {
        ops::add_rmsnorm(
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

    fn prefill_gdn(&self, ps: &PrefillScratch, i: usize, seq: &GpuSeq, t: usize) -> Result<()> {
        let GpuMixer::Linear {
            proj,
            conv_w,
            neg_a,
            dt_bias,
            norm_w,
            out,
            dims,
            conv_dim,
            kernel,
        } = &self.layers[i].mixer
        else {
            return Err(unsupported(format!("layer {i} is not a GDN layer")));
        };
        let (g, pool) = (&*self.gpu, self.pool()?);
        let conv = slot_at(&pool.conv[i], seq.slot, (kernel - 1) * conv_dim);
        let rec = slot_at(&pool.rec[i], seq.slot, dims.hv * dims.dk * dims.dv);
        rows_mv(
            g,
            proj.mv(),
            ps.normed.ptr(),
            ps.proj.ptr(),
            t,
            self.hidden,
            false,
        )?;
        let p = proj.n;
        pf::gdn_conv_rows(
            g,
            ps.proj.ptr(),
            p,
            conv,
            conv_w.ptr(),
            ps.mixed.ptr(),
            *conv_dim,
            *kernel,
            t,
        )?;
        let packed = GdnPacked {
            q: ps.qb.ptr(),
            k: ps.kb.ptr(),
            v: ps.vb.ptr(),
            gate: ps.gate.ptr(),
            beta: ps.beta.ptr(),
        };
        let path = gdn_path(self.prefill_gdn, t);
        if path == GdnPrefill::Chunked {
            pf::gdn_pack(
                g,
                ps.mixed.ptr(),
                ps.proj.ptr(),
                p,
                neg_a.ptr(),
                dt_bias.ptr(),
                packed,
                *dims,
                t,
            )?;
        }
        let cd = GdnChunkDims {
            t,
            hk: dims.hk,
            hv: dims.hv,
            dk: dims.dk,
            dv: dims.dv,
        };
        let bufs = GdnChunkBufs {
            q: ps.qb.ptr(),
            k: ps.kb.ptr(),
            v: ps.vb.ptr(),
            g: ps.gate.ptr(),
            beta: ps.beta.ptr(),
            state: rec,
            out: ps.core.ptr(),
            workspace: ps.ws.ptr(),
        };
        match path {
            GdnPrefill::Chunked => gdn_chunk::gdn_chunk_forward(g, bufs, cd, true)?,
            GdnPrefill::Recurrent | GdnPrefill::Auto => pf::gdn_rec_rows(
                g,
                ps.mixed.ptr(),
                ps.proj.ptr(),
                p,
                rec,
                neg_a.ptr(),
                dt_bias.ptr(),
                ps.core.ptr(),
                *dims,
                t,
            )?,
        }
        pf::gated_rmsnorm_rows(
            g,
            ps.core.ptr(),
            ps.proj.ptr(),
            p,
            *conv_dim,
            norm_w.ptr(),
            ps.mix_out.ptr(),
            dims.hv,
            dims.dv,
            self.eps,
            t,
        )?;
        rows_mv(
            g,
            out.mv(),
            ps.mix_out.ptr(),
            ps.delta.ptr(),
            t,
            out.k,
            false,
        )
    }

    fn prefill_attention(
        &self,
        ps: &PrefillScratch,
        i: usize,
        seq: &GpuSeq,
        t: usize,
    ) -> Result<()> {
        let GpuMixer::Full { proj, qn, kn, out } = &self.layers[i].mixer else {
            return Err(unsupported(format!("layer {i} is not an attention layer")));
        };
        let (g, pool, a) = (&*self.gpu, self.pool()?, self.attn);
        let kc = pool.k_cache[i].as_ref().map_or(0, |x| x.ptr());
        let vc = pool.v_cache[i].as_ref().map_or(0, |x| x.ptr());
        rows_mv(
            g,
            proj.mv(),
            ps.normed.ptr(),
            ps.proj.ptr(),
            t,
            self.hidden,
            false,
        )?;
        let bt = Batch {
            rows: t,
            slots: ps.slots.ptr(),
        };
        ops::attn_prep(
            g,
            ps.proj.ptr(),
            proj.n,
            qn.ptr(),
            kn.ptr(),
            self.inv_freq.ptr(),
            ps.q.ptr(),
            kc,
            vc,
            pool.pos.ptr(),
            a,
            self.eps,
            bt,
            pool.ctx,
            true,
        )?;
        let per_slot = pool.ctx * a.hkv * a.d;
        pf::attn_prefill(
            g,
            ps.q.ptr(),
            slot_at(&pool.k_cache[i], seq.slot, per_slot),
            slot_at(&pool.v_cache[i], seq.slot, per_slot),
            ps.proj.ptr(),
            proj.n,
            ps.mix_out.ptr(),
            a,
            t,
            seq.pos,
        )?;
        rows_mv(
            g,
            out.mv(),
            ps.mix_out.ptr(),
            ps.delta.ptr(),
            t,
            out.k,
            false,
        )
    }

    fn prefill_ffn(&self, ps: &PrefillScratch, i: usize, t: usize) -> Result<()> {
        let (g, h) = (&*self.gpu, self.hidden);
        match &self.layers[i].ffn {
            GpuFfn::Dense { gate_up, down } => {
                rows_mv(g, gate_up.mv(), ps.normed.ptr(), ps.h.ptr(), t, h, true)?;
                rows_mv(g, down.mv(), ps.h.ptr(), ps.delta.ptr(), t, down.k, false)
            }
            GpuFfn::Moe {
                router,
                experts_gu,
                experts_down,
                shared,
                offload,
            } => {
                let i_e = experts_gu.n / 2;
                let ks = self.top_k + shared.is_none() as usize;
                let route = self.route(shared.is_none());
                let (ids, pairs) = (ps.ids.ptr(), t * ks);
                rows_mv(
                    g,
                    router.mv(),
                    ps.normed.ptr(),
                    ps.router.ptr(),
                    t,
                    h,
                    false,
                )?;
                ops::router_topk(
                    g,
                    ps.router.ptr(),
                    router.n,
                    route,
                    ids,
                    ps.weights.ptr(),
                    ps.sg.ptr(),
                    t,
                )?;
                let (gu, dn) = match offload {
                    Some(_) => self.stage_experts(i, &ps.ids, pairs)?,
                    None => (experts_gu.mv(), experts_down.mv()),
                };
                if pf::grouped_supported(&gu, h) && pf::grouped_supported(&dn, i_e) {
                    let stacked = self.num_experts + shared.is_none() as usize;
                    let tile = pf::group_tile(&gu, &dn);
                    pf::moe_group(
                        g,
                        ids,
                        pairs,
                        stacked,
                        tile,
                        ps.order.ptr(),
                        ps.tiles.ptr(),
                        ps.n_tiles.ptr(),
                    )?;
                    let gr = Grouped {
                        order: ps.order.ptr(),
                        tiles: ps.tiles.ptr(),
                        n_tiles: ps.n_tiles.ptr(),
                        tile,
                        max_tiles: pf::max_tiles(pairs, stacked, tile),
                        x_stride: h,
                        x_div: ks,
                    };
                    pf::grouped_swiglu(g, gu, ps.normed.ptr(), ps.h.ptr(), gr)?;
                    let gr = Grouped {
                        x_stride: i_e,
                        x_div: 1,
                        ..gr
                    };
                    pf::grouped_matvec(g, dn, ps.h.ptr(), ps.y.ptr(), gr)?;
                } else {
                    let gu_slots = Slots::experts(pairs, ids, h, ks);
                    ops::matvec_swiglu(g, gu, ps.normed.ptr(), ps.h.ptr(), gu_slots)?;
                    let down_slots = Slots::experts(pairs, ids, i_e, 1);
                    ops::matvec(g, dn, ps.h.ptr(), ps.y.ptr(), down_slots)?;
                }
                let bufs = super::MoeTail {
                    normed: ps.normed.ptr(),
                    hs: ps.hs.ptr(),
                    ys: ps.ys.ptr(),
                    sg: ps.sg.ptr(),
                    y: ps.y.ptr(),
                    weights: ps.weights.ptr(),
                    delta: ps.delta.ptr(),
                };
                self.moe_tail(shared.as_ref(), bufs, ks, t, None)
            }
        }
    }
}

impl GpuModel {
    /// How later prefills run the GDN layers' delta rule.
    pub fn set_prefill_gdn(&mut self, mode: GdnPrefill) {
        self.prefill_gdn = mode;
    }

    /// Tokens of the vocabulary (rows of the lm_head).
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Weights one token multiplies (2 FLOPs each): projections, router, the top-k (and shared)
    /// experts and the lm_head; the embedding is a lookup and attention's own FLOPs are not
    /// weights.
    pub fn active_params(&self) -> usize {
        let mat = |m: &super::DevMat| m.n * m.k;
        let mut p = mat(&self.lm_head);
        for l in &self.layers {
            p += match &l.mixer {
                GpuMixer::Linear { proj, out, .. } | GpuMixer::Full { proj, out, .. } => {
                    mat(proj) + mat(out)
                }
            };
            p += match &l.ffn {
                GpuFfn::Dense { gate_up, down } => mat(gate_up) + mat(down),
                GpuFfn::Moe {
                    router,
                    experts_gu,
                    experts_down,
                    shared,
                    ..
                } => {
                    let per = self.top_k + shared.is_none() as usize;
                    mat(router)
                        + per * (mat(experts_gu) + mat(experts_down))
                        + shared.as_ref().map_or(0, |(gu, d)| mat(gu) + mat(d))
                }
            };
        }
        p
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
