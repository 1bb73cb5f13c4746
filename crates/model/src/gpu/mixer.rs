//! A decode step's token mixers (Gated DeltaNet and gated attention), and the choice of the fused
//! decode form.
//!
//! In the fused form (one row, every mixer projection on the single-row tensor-core kernel) the
//! residual `x` is whole at every sublayer boundary: the input projection normalizes `x` as it
//! stages it and, for a GDN layer, runs the conv step on its output rows; the output projection
//! adds into `x`; the router normalizes `x` for the ffn and leaves that row in `normed` for the
//! experts (a router the kernel does not take, e.g. bf16 or 2-bit, or a dense ffn gets the norm
//! as its own launch); the expert down projections (or, with the shared expert apart or experts
//! on the host, the combine after them) add their weighted sum into `x`.
//! That saves the add+norm, conv and combine launches of every layer. Otherwise the norms run as their own launches on
//! `normed` and each sublayer's output waits in `delta` for the next add+norm.

use deltamoe_compute::cuda::ops::{self, Matvec, Slots};
use deltamoe_compute::cuda::vec::{self, VecIo};

use super::{unsupported, GpuFfn, GpuMixer, GpuModel, Result, ATTN_SPLITS};

/// Whether a step of `rows` rows runs the fused decode form: one row and every mixer input and
/// output projection (`mats`) taken by the single-row kernel.
pub(crate) fn fused_decode(rows: usize, mut mats: impl Iterator<Item = Matvec>) -> bool {
    rows == 1 && mats.all(|m| vec::takes(&m, &Slots::one()))
}

impl GpuModel {
    /// Whether a `b`-row step runs the fused decode form (see the module doc).
    pub(super) fn fused(&self, b: usize) -> bool {
        let mats = self.layers.iter().flat_map(|l| {
            let (proj, out) = match &l.mixer {
                GpuMixer::Linear { proj, out, .. } | GpuMixer::Full { proj, out, .. } => {
                    (proj, out)
                }
            };
            [proj.mv(), out.mv()]
        });
        fused_decode(b, mats)
    }

    /// In the fused form, whether layer `i`'s ffn normalizes the residual itself: an MoE whose
    /// router the single-row kernel takes (else the norm runs as its own launch).
    pub(super) fn router_normalizes(&self, i: usize) -> bool {
        match &self.layers[i].ffn {
            GpuFfn::Moe { router, .. } => vec::takes(&router.mv(), &Slots::one()),
            GpuFfn::Dense { .. } => false,
        }
    }

    /// The mixer's input projection of `x` (`normed`, or in the fused form the residual with
    /// the layer's input norm applied as it is staged, and `io`'s conv step) into `proj`.
    fn input_projection(&self, i: usize, m: Matvec, b: usize, io: VecIo) -> Result<()> {
        let (g, s) = (&*self.gpu, &self.scratch);
        if self.fused(b) {
            let io = VecIo {
                norm: self.layers[i].input_norm.ptr(),
                eps: self.eps,
                ..io
            };
            vec::matvec(g, m, s.x.ptr(), s.proj.ptr(), io)
        } else {
            let rows = Slots::rows(b, self.hidden);
            ops::matvec(g, m, s.normed.ptr(), s.proj.ptr(), rows)
        }
    }

    /// The mixer's output projection of `mix_out`: added into the residual in the fused form,
    /// else into `delta`.
    fn output_projection(&self, m: Matvec, b: usize) -> Result<()> {
        let (g, s) = (&*self.gpu, &self.scratch);
        if self.fused(b) {
            let io = VecIo {
                accumulate: 1,
                ..VecIo::default()
            };
            vec::matvec(g, m, s.mix_out.ptr(), s.x.ptr(), io)
        } else {
            let rows = Slots::rows(b, m.k);
            ops::matvec(g, m, s.mix_out.ptr(), s.delta.ptr(), rows)
        }
    }

    pub(super) fn enqueue_gdn(&self, i: usize, b: usize) -> Result<()> {
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
        let (g, s, pool) = (&*self.gpu, &self.scratch, self.pool()?);
        let (conv, rec) = (pool.conv[i].as_ref(), pool.rec[i].as_ref());
        let (conv, rec) = (conv.map_or(0, |x| x.ptr()), rec.map_or(0, |x| x.ptr()));
        let bt = self.batch(b);
        if self.fused(b) {
            let io = VecIo {
                slots: bt.slots,
                conv_state: conv,
                conv_w: conv_w.ptr(),
                mixed: s.mixed.ptr(),
                conv_c: *conv_dim as i32,
                conv_k: *kernel as i32,
                ..VecIo::default()
            };
            self.input_projection(i, proj.mv(), b, io)?;
        } else {
            self.input_projection(i, proj.mv(), b, VecIo::default())?;
            ops::gdn_conv_step(
                g,
                s.proj.ptr(),
                proj.n,
                conv,
                conv_w.ptr(),
                s.mixed.ptr(),
                *conv_dim,
                *kernel,
                bt,
            )?;
        }
        ops::gdn_step(
            g,
            s.mixed.ptr(),
            s.proj.ptr(),
            proj.n,
            rec,
            neg_a.ptr(),
            dt_bias.ptr(),
            norm_w.ptr(),
            s.mix_out.ptr(),
            *dims,
            self.eps,
            bt,
        )?;
        self.output_projection(out.mv(), b)
    }

    pub(super) fn enqueue_attention(&self, i: usize, b: usize) -> Result<()> {
        let GpuMixer::Full { proj, qn, kn, out } = &self.layers[i].mixer else {
            return Err(unsupported(format!("layer {i} is not an attention layer")));
        };
        let (g, s, pool) = (&*self.gpu, &self.scratch, self.pool()?);
        let kc = pool.k_cache[i].as_ref().map_or(0, |x| x.ptr());
        let vc = pool.v_cache[i].as_ref().map_or(0, |x| x.ptr());
        let bt = self.batch(b);
        self.input_projection(i, proj.mv(), b, VecIo::default())?;
        ops::attn_prep(
            g,
            s.proj.ptr(),
            proj.n,
            qn.ptr(),
            kn.ptr(),
            self.inv_freq.ptr(),
            s.q.ptr(),
            kc,
            vc,
            pool.pos.ptr(),
            self.attn,
            self.eps,
            bt,
            pool.ctx,
            false,
        )?;
        ops::attn_decode(
            g,
            s.q.ptr(),
            kc,
            vc,
            pool.pos.ptr(),
            s.part_o.ptr(),
            s.part_ml.ptr(),
            s.proj.ptr(),
            proj.n,
            s.mix_out.ptr(),
            self.attn,
            ATTN_SPLITS,
            bt,
            pool.ctx,
        )?;
        self.output_projection(out.mv(), b)
    }
}

#[cfg(test)]
mod tests {
    use super::fused_decode;
    use deltamoe_compute::cuda::ops::{Matvec, WeightFormat};

    fn mat(n: usize, k: usize, bits: u32) -> Matvec {
        let format = match bits {
            16 => WeightFormat::Bf16,
            _ => WeightFormat::Affine {
                bits,
                group: 64,
                scales: 0,
                biases: 0,
            },
        };
        Matvec {
            w: 0,
            n,
            k,
            bias: 0,
            format,
        }
    }

    #[test]
    fn fused_decode_takes_one_row_of_4_and_8_bit_mixer_projections() {
        let layer = |bits| [mat(12_352, 2048, bits), mat(2048, 4096, bits)];
        assert!(fused_decode(1, layer(4).into_iter()));
        assert!(fused_decode(1, layer(8).into_iter()));
        // Batches, bf16 or 2-bit weights, or inputs past the staging limit (an 8-bit input
        // counts as two digits) do not.
        assert!(!fused_decode(2, layer(4).into_iter()));
        assert!(!fused_decode(1, [mat(2048, 4096, 16)].into_iter()));
        assert!(!fused_decode(1, [mat(2048, 4096, 2)].into_iter()));
        assert!(!fused_decode(1, [mat(2048, 16_384, 4)].into_iter()));
        assert!(!fused_decode(1, [mat(2048, 8192, 8)].into_iter()));
    }
}
