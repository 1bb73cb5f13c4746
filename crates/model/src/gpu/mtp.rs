//! The MTP layer on the GPU (see [`crate::checkpoint::Mtp`]): from the embedding of token t + 1
//! and the main model's final hidden state at t it proposes token t + 2. A pass of `r` rows runs
//! pairs of one sequence at consecutive MTP positions: both halves of `[embedding ; hidden]`
//! normalized into `proj`, the `fc` projection into the residual, one full-attention decoder
//! layer (its own KV caches in the pool) with the main layers' ffn kind, its final norm, the
//! shared lm_head and a greedy pick per row. The layer runs unfused (the drafts only steer how
//! much a verify pass keeps, never what it emits).

use deltamoe_compute::cpu::rope::Rope;
use deltamoe_compute::cuda::ops;
use deltamoe_compute::cuda::{DevBuf, Gpu, Result};

use super::format::DevMat;
use super::layers::attention::AttnMixer;
use super::layers::dense::DenseFfn;
use super::layers::head::Head;
use super::layers::moe::MoeFfn;
use super::layers::{pass_mv, FfnIo, FfnMade, GpuLayer, Needs, Pass, State, Step};
use super::random::Filler;
use crate::checkpoint::Mtp;
use crate::config::{FfnKind, ModelConfig};

pub(crate) struct GpuMtp {
    embed_norm: DevBuf<f32>,
    hidden_norm: DevBuf<f32>,
    /// `[H, 2H]`: the embedding half first.
    fc: DevMat,
    pub layer: GpuLayer,
    norm: DevBuf<f32>,
}

/// Where an MTP pass reads and writes (device addresses).
pub(crate) struct MtpIo {
    /// The pass's token ids, `[rows]`.
    pub tokens: u64,
    /// The layer's KV caches.
    pub state: State,
    /// The routed ids' buffer.
    pub ids: u64,
}

impl GpuMtp {
    /// A loaded MTP layer on the device (its experts resident: one layer's worth).
    pub fn upload(g: &Gpu, m: &Mtp, c: &ModelConfig) -> Result<GpuMtp> {
        let rope = Rope::new(c.rotary_dim, c.rope_theta);
        let (layer, _) =
            super::upload::upload_layer(g, &m.layer, (c.num_layers, c, &rope), false, None)?;
        Ok(GpuMtp {
            embed_norm: g.upload(&m.embed_norm)?,
            hidden_norm: g.upload(&m.hidden_norm)?,
            fc: DevMat::of(g, &m.fc)?,
            layer,
            norm: g.upload(&m.norm)?,
        })
    }

    /// Random weights of config `c`'s shape.
    pub fn random(f: &mut Filler, c: &ModelConfig) -> Result<GpuMtp> {
        let h = c.hidden_size;
        let ffn: FfnMade = match c.ffn_kinds.first() {
            Some(FfnKind::Moe) => MoeFfn::random(f, c, c.num_layers, false, None)?,
            _ => (Box::new(DenseFfn::random(f, h, c.intermediate_size)?), None),
        };
        let layer = GpuLayer {
            input_norm: f.vec(h, 0.5, 1.5)?,
            mixer: Box::new(AttnMixer::random(f, c)?),
            post_norm: f.vec(h, 0.5, 1.5)?,
            ffn: ffn.0,
        };
        Ok(GpuMtp {
            embed_norm: f.vec(h, 0.5, 1.5)?,
            hidden_norm: f.vec(h, 0.5, 1.5)?,
            fc: f.mats(1, h, 2 * h)?,
            layer,
            norm: f.vec(h, 0.5, 1.5)?,
        })
    }

    /// Scratch its passes need: `[embedding ; hidden]` rows in `proj`, and the layer's own.
    pub fn needs(&self, hidden: usize) -> Needs {
        let l = &self.layer;
        let own = Needs {
            proj: 2 * hidden,
            ..Needs::default()
        };
        let fc = Needs::products(&[(self.fc.mv(), false)]);
        own.max(fc).max(l.mixer.needs(1)).max(l.ffn.needs())
    }

    /// `[embedding ; hidden]` of `rows` pairs (`e` and `hidden` rows of `h` floats) into `cat`
    /// (rows of 2h): each half normalized into `tmp` (rows·h), then laid into its columns.
    fn cat_rows(
        &self,
        g: &Gpu,
        (e, hidden): (u64, u64),
        (tmp, cat): (u64, u64),
        (rows, h, eps): (usize, usize, f32),
    ) -> Result<()> {
        let half = |src: u64, scale: u64, col: usize| -> Result<()> {
            ops::add_rmsnorm(g, src, 0, scale, tmp, rows, h, eps)?;
            // SAFETY: tmp holds rows of h floats, cat rows of at least 2h (the callers' scratch).
            unsafe { g.copy_rows_f32((cat + (4 * col) as u64, 2 * h), (tmp, h), h, rows) }
        };
        half(hidden, self.hidden_norm.ptr(), h)?;
        half(e, self.embed_norm.ptr(), 0)
    }

    /// A prefill pass over `p.t` pairs, for their rows of the layer's KV caches only (`state`):
    /// the embeddings of the tokens at `tokens` and the hidden states at `hidden` (`p.t` rows
    /// each), `[embedding ; hidden]` normalized into `proj`, `fc`, the input norm and the
    /// attention; its output, the ffn and the head are not needed.
    pub fn prefill(
        &self,
        p: &Pass,
        head: &Head,
        (tokens, hidden): (u64, u64),
        state: State,
    ) -> Result<()> {
        let (g, ps, t, h) = (p.g, p.ps, p.t, p.hidden);
        let (x, cat) = (ps.x.ptr(), ps.proj.ptr());
        head.embed(g, tokens, x, t)?;
        self.cat_rows(g, (x, hidden), (ps.delta.ptr(), cat), (t, h, p.eps))?;
        pass_mv(p, self.fc.mv(), (cat, x), 2 * h, false)?;
        let l = &self.layer;
        ops::add_rmsnorm(g, x, 0, l.input_norm.ptr(), ps.normed.ptr(), t, h, p.eps)?;
        l.mixer.prefill(p, state)
    }

    /// Enqueue a pass over `st.rows()` pairs: the tokens at `io.tokens` (looked up in `head`'s
    /// embedding), the hidden states in `normed` (rows in order). Leaves the layer's normed
    /// outputs in `normed`: what the lm_head reads, and the next draft's hidden state.
    pub fn enqueue(&self, st: &Step, head: &Head, io: &MtpIo) -> Result<()> {
        let (g, s, h, r) = (st.g, st.s, st.hidden, st.rows());
        head.embed(g, io.tokens, s.x.ptr(), r)?;
        let bufs = (s.delta.ptr(), s.proj.ptr());
        self.cat_rows(g, (s.x.ptr(), s.normed.ptr()), bufs, (r, h, st.eps))?;
        ops::matvec(
            g,
            self.fc.mv(),
            s.proj.ptr(),
            s.x.ptr(),
            st.row_slots(2 * h),
        )?;
        let l = &self.layer;
        st.add_norm(0, l.input_norm.ptr())?;
        l.mixer.decode(st, io.state, [0, 0], l.input_norm.ptr())?;
        st.add_norm(s.delta.ptr(), l.post_norm.ptr())?;
        let ffn_io = FfnIo {
            post_norm: l.post_norm.ptr(),
            norm_after: self.norm.ptr(),
            ids: io.ids,
            mailbox: None,
        };
        l.ffn.decode(st, &ffn_io)?;
        if !l.ffn.normalizes_after() {
            st.add_norm(s.delta.ptr(), self.norm.ptr())?;
        }
        Ok(())
    }
}
