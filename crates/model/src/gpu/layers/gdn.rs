//! The Gated DeltaNet mixer on the GPU: the fused input projection `[qkv | z | b | a]`
//! (Qwen3-Next's per-key-head packing reordered by row runs at upload), the causal conv, the
//! gated delta rule and the gated RMSNorm, then the output projection. State per slot: the conv
//! window `[K−1, C]` and the recurrent state `[Hv, Dk, Dv]`. FP8 and GPTQ/AWQ checkpoints keep
//! `b` and `a` unquantized: their rows of the quantized projection are zeros, and a bf16 product
//! of its own writes them (`GdnMixer::ba`), so that neither is rounded to the other's format.
use deltamoe_compute::cuda::gdn_chunk::{self, GdnChunkBufs, GdnChunkDims};
use deltamoe_compute::cuda::ops::{self, GdnDims, Matvec, GDN_DK_MAX, GDN_DV_MAX};
use deltamoe_compute::cuda::prefill::{self as pf, GdnPacked};
use deltamoe_compute::cuda::vec::VecIo;
use deltamoe_compute::cuda::{CudaError, DevBuf, Gpu, Result};
use deltamoe_compute::fp8::Bytes;
use deltamoe_compute::{AffineWeight, DType, Fp8Weight, PackedWords, Tensor};

use super::{gdn_path, pass_mv, slot_at, GdnPrefill, Mixer, Needs, Pass, State, StateSpec, Step};
use crate::checkpoint::gdn::InProj;
use crate::checkpoint::{GatedDeltaNet, LinearWeight};
use crate::config::ModelConfig;
use crate::gpu::format::{DevFormat, DevMat};
use crate::gpu::random::Filler;

pub(crate) struct GdnMixer {
    proj: DevMat,
    /// `[b | a]` when they are stored apart from an FP8 `[qkv | z]` (see the module doc).
    ba: Option<DevMat>,
    conv_w: DevBuf<f32>,
    neg_a: DevBuf<f32>,
    dt_bias: DevBuf<f32>,
    norm_w: DevBuf<f32>,
    out: DevMat,
    dims: GdnDims,
    conv_dim: usize,
    kernel: usize,
}

impl GdnMixer {
    /// A loaded layer's weights on the device.
    pub fn upload(g: &Gpu, l: &GatedDeltaNet, hidden: usize) -> Result<GdnMixer> {
        let s = l.shape;
        let dims = GdnDims {
            hk: s.n_k_heads,
            hv: s.n_v_heads,
            dk: s.k_dim,
            dv: s.v_dim,
        };
        check(dims)?;
        let conv_dim = l.conv_w.len() / l.conv_kernel;
        let n = conv_dim + s.n_v_heads * s.v_dim + 2 * s.n_v_heads;
        let (main, tail): (Vec<LinearWeight>, Vec<LinearWeight>) = match &l.proj {
            InProj::Split { qkv, z, b, a } => (
                vec![qkv.weight.clone(), z.weight.clone()],
                vec![b.weight.clone(), a.weight.clone()],
            ),
            InProj::Packed { qkvz, ba } => {
                let (qkvz_runs, ba_runs) = packed_runs(dims);
                (
                    row_runs(&qkvz.weight, &qkvz_runs),
                    row_runs(&ba.weight, &ba_runs),
                )
            }
        };
        let format = |v: &[LinearWeight]| DevFormat::of(&v.iter().collect::<Vec<_>>());
        let (fm, ft) = (format(&main), format(&tail));
        let apart = fm != DevFormat::Bf16 && fm != ft;
        let zeros = match apart {
            true => zero_rows(&main[0], 2 * s.n_v_heads, hidden)?,
            false => None,
        };
        let (proj, ba) = match zeros {
            Some(zeros) => {
                let parts: Vec<&LinearWeight> = main.iter().chain([&zeros]).collect();
                let tail: Vec<&LinearWeight> = tail.iter().collect();
                let ba = DevMat::stack(g, &tail, 2 * s.n_v_heads, hidden, None)?;
                (DevMat::stack(g, &parts, n, hidden, None)?, Some(ba))
            }
            _ => {
                let parts: Vec<&LinearWeight> = main.iter().chain(&tail).collect();
                (DevMat::stack(g, &parts, n, hidden, None)?, None)
            }
        };
        Ok(GdnMixer {
            proj,
            ba,
            conv_w: g.upload(&l.conv_w)?,
            neg_a: g.upload(&l.neg_a)?,
            dt_bias: g.upload(&l.dt_bias)?,
            norm_w: g.upload(&l.norm_w)?,
            out: DevMat::of(g, &l.out_proj)?,
            dims,
            conv_dim,
            kernel: l.conv_kernel,
        })
    }

    /// Random weights of config `c`'s shape.
    pub fn random(f: &mut Filler, c: &ModelConfig) -> Result<GdnMixer> {
        let (h, hv, vd, cd) = (
            c.hidden_size,
            c.linear_v_heads,
            c.linear_value_size(),
            c.conv_dim(),
        );
        let dims = GdnDims {
            hk: c.linear_k_heads,
            hv,
            dk: c.linear_k_dim,
            dv: c.linear_v_dim,
        };
        check(dims)?;
        Ok(GdnMixer {
            proj: f.mats(1, cd + vd + 2 * hv, h)?,
            ba: None,
            conv_w: f.vec(cd * c.conv_kernel, -0.5, 0.5)?,
            neg_a: f.vec(hv, -1.0, -0.05)?,
            dt_bias: f.vec(hv, -1.0, 1.0)?,
            norm_w: f.vec(c.linear_v_dim, 0.5, 1.5)?,
            out: f.mats(1, h, vd)?,
            dims,
            conv_dim: cd,
            kernel: c.conv_kernel,
        })
    }

    /// Geometry of the chunked delta rule over `t` tokens.
    pub fn chunk_dims(&self, t: usize) -> GdnChunkDims {
        let d = self.dims;
        GdnChunkDims {
            t,
            hk: d.hk,
            hv: d.hv,
            dk: d.dk,
            dv: d.dv,
        }
    }

    fn rec_floats(&self) -> usize {
        self.dims.hv * self.dims.dk * self.dims.dv
    }

    /// A decode step's conv (unless the input projection ran it: `conv_apart` false) and delta
    /// rule, each row one token of its sequence.
    fn step(&self, st: &Step, [conv, rec]: State, conv_apart: bool) -> Result<()> {
        let (g, s, bt) = (st.g, st.s, st.bt);
        let n = self.proj.n;
        if conv_apart {
            let (c, k) = (self.conv_dim, self.kernel);
            let w = self.conv_w.ptr();
            ops::gdn_conv_step(g, s.proj.ptr(), n, conv, w, s.mixed.ptr(), c, k, bt)?;
        }
        let (neg_a, dt_bias, norm_w) = (self.neg_a.ptr(), self.dt_bias.ptr(), self.norm_w.ptr());
        let (mixed, proj, out) = (s.mixed.ptr(), s.proj.ptr(), s.mix_out.ptr());
        ops::gdn_step(
            g, mixed, proj, n, rec, neg_a, dt_bias, norm_w, out, self.dims, st.eps, bt,
        )
    }

    /// A verify pass's conv and delta rule ([`Step::verify`]): over the pass's tokens in turn,
    /// keeping the states after each token but the last in `saved`.
    fn verify(&self, st: &Step, [conv, rec]: State, [sconv, srec]: State) -> Result<()> {
        let (g, s, bt) = (st.g, st.s, st.bt);
        let (n, c, k) = (self.proj.n, self.conv_dim, self.kernel);
        let (proj, mixed) = (s.proj.ptr(), s.mixed.ptr());
        let w = self.conv_w.ptr();
        ops::gdn_conv_verify(g, proj, n, conv, w, mixed, (c, k), bt, sconv)?;
        let weights = (self.neg_a.ptr(), self.dt_bias.ptr(), self.norm_w.ptr());
        let io = (mixed, proj, n);
        ops::gdn_verify(
            g,
            io,
            rec,
            weights,
            s.mix_out.ptr(),
            self.dims,
            st.eps,
            bt,
            srec,
        )
    }

    /// Writes `[b | a]` of `rows` input rows (`x`, rows `xs` floats apart) into their columns
    /// of the projection rows at `proj`, through `tmp` (rows·2Hv floats), when they are
    /// stored apart ([`Self::ba`]); `mv` runs the product.
    fn fill_ba(
        &self,
        g: &Gpu,
        (x, proj, tmp): (u64, u64, u64),
        rows: usize,
        mv: impl FnOnce(Matvec, (u64, u64)) -> Result<()>,
    ) -> Result<()> {
        let Some(ba) = &self.ba else {
            return Ok(());
        };
        mv(ba.mv(), (x, tmp))?;
        let (n, w) = (self.proj.n, ba.n);
        // SAFETY: proj holds rows of n floats, whose last w columns the copy writes; tmp holds
        // rows·w floats the product just wrote.
        unsafe { g.copy_rows_f32((proj + 4 * (n - w) as u64, n), (tmp, w), w, rows) }
    }
}

/// An all-zero `[rows, k]` matrix in the quantized format of `like` (FP8 blocks, or affine bits,
/// group and parameter form): the `[b | a]` rows of a quantized projection whose `b` and `a`
/// are stored unquantized (FP8 and GPTQ/AWQ checkpoints). `None` for a dense `like`.
fn zero_rows(like: &LinearWeight, rows: usize, k: usize) -> Result<Option<LinearWeight>> {
    let err = |e: String| CudaError::Unsupported(format!("quantized GDN projection: {e}"));
    match like {
        LinearWeight::Fp8(f) => {
            let block = f.block();
            let grid = rows.div_ceil(block[0]) * k.div_ceil(block[1]);
            let codes = Bytes::from_vec(vec![0; rows * k]);
            Fp8Weight::new(rows, k, block, codes, vec![0.0; grid], DType::F32)
                .map(|w| Some(w.into()))
                .map_err(|e| err(e.to_string()))
        }
        LinearWeight::Affine(a) => {
            let (bits, g) = (a.bits(), a.group_size());
            let words = PackedWords::from_vec(vec![0; rows * k * bits as usize / 32]);
            let zeros = || Tensor::from_f32(vec![rows, k / g], vec![0.0; rows * k / g]);
            let w = AffineWeight::new(bits, g, rows, k, words, zeros(), zeros())
                .map_err(|e| err(e.to_string()))?;
            Ok(Some(match a.has_zero_points() {
                true => w.with_zero_points().into(),
                false => w.into(),
            }))
        }
        LinearWeight::Dense(_) => Ok(None),
    }
}

/// The head dims the CUDA kernels take.
fn check(d: GdnDims) -> Result<()> {
    if d.dk > GDN_DK_MAX || d.dv > GDN_DV_MAX {
        return Err(CudaError::Unsupported(format!(
            "GDN head dims {}/{} exceed the CUDA kernel limits ({GDN_DK_MAX}/{GDN_DV_MAX})",
            d.dk, d.dv
        )));
    }
    Ok(())
}

impl Mixer for GdnMixer {
    fn kind(&self) -> &'static str {
        "gdn"
    }

    fn projections(&self) -> [Matvec; 2] {
        [self.proj.mv(), self.out.mv()]
    }

    fn fusable(&self) -> bool {
        self.ba.is_none()
    }

    fn needs(&self, rows: usize) -> Needs {
        Needs {
            proj: self.proj.n,
            workspace: gdn_chunk::workspace_bytes(self.chunk_dims(rows)),
            ..Needs::default()
        }
    }

    fn state(&self, _ctx: usize) -> StateSpec {
        StateSpec {
            per_slot: [(self.kernel - 1) * self.conv_dim, self.rec_floats()],
            row: None,
        }
    }

    fn bytes_per_token(&self, _ctx: usize) -> usize {
        self.weight_bytes() + 2 * 4 * self.rec_floats()
    }

    fn weight_bytes(&self) -> usize {
        self.proj.bytes() + self.out.bytes() + self.ba.as_ref().map_or(0, DevMat::bytes)
    }

    fn params(&self) -> usize {
        self.proj.params() + self.out.params() + self.ba.as_ref().map_or(0, DevMat::params)
    }

    fn decode(&self, st: &Step, [conv, rec]: State, saved: State, norm: u64) -> Result<()> {
        let (g, s, bt) = (st.g, st.s, st.bt);
        let proj = self.proj.mv();
        // One row of a decode step runs the conv step on the input projection's output rows.
        let conv_in_projection = st.fused && bt.rows == 1 && !st.verify;
        let io = match conv_in_projection {
            true => VecIo {
                slots: bt.slots,
                conv_state: conv,
                conv_w: self.conv_w.ptr(),
                mixed: s.mixed.ptr(),
                conv_c: self.conv_dim as i32,
                conv_k: self.kernel as i32,
                ..VecIo::default()
            },
            false => VecIo::default(),
        };
        st.input_projection(proj, norm, io)?;
        if !st.fused {
            let io = (s.normed.ptr(), s.proj.ptr(), s.mix_out.ptr());
            self.fill_ba(g, io, bt.rows, |m, (x, y)| {
                ops::matvec(g, m, x, y, st.row_slots(m.k))
            })?;
        }
        match st.verify {
            true => self.verify(st, [conv, rec], saved)?,
            false => self.step(st, [conv, rec], !conv_in_projection)?,
        }
        st.output_projection(self.out.mv())
    }

    fn prefill(&self, p: &Pass, [conv, rec]: State) -> Result<()> {
        let (g, ps, t, dims) = (p.g, p.ps, p.t, self.dims);
        let conv = slot_at(conv, p.slot, (self.kernel - 1) * self.conv_dim);
        let rec = slot_at(rec, p.slot, self.rec_floats());
        let n = self.proj.n;
        pass_mv(
            p,
            self.proj.mv(),
            (ps.normed.ptr(), ps.proj.ptr()),
            p.hidden,
            false,
        )?;
        let io = (ps.normed.ptr(), ps.proj.ptr(), ps.mix_out.ptr());
        self.fill_ba(g, io, t, |m, xy| pass_mv(p, m, xy, p.hidden, false))?;
        pf::gdn_conv_rows(
            g,
            ps.proj.ptr(),
            n,
            conv,
            self.conv_w.ptr(),
            ps.mixed.ptr(),
            self.conv_dim,
            self.kernel,
            t,
        )?;
        match gdn_path(p.gdn, t) {
            GdnPrefill::Chunked => {
                let packed = GdnPacked {
                    q: ps.qb.ptr(),
                    k: ps.kb.ptr(),
                    v: ps.vb.ptr(),
                    gate: ps.gate.ptr(),
                    beta: ps.beta.ptr(),
                };
                let (neg_a, dt_bias) = (self.neg_a.ptr(), self.dt_bias.ptr());
                let mixed = ps.mixed.ptr();
                pf::gdn_pack(g, mixed, ps.proj.ptr(), n, neg_a, dt_bias, packed, dims, t)?;
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
                gdn_chunk::gdn_chunk_forward(g, bufs, self.chunk_dims(t), true)?;
            }
            GdnPrefill::Recurrent | GdnPrefill::Auto => pf::gdn_rec_rows(
                g,
                ps.mixed.ptr(),
                ps.proj.ptr(),
                n,
                rec,
                self.neg_a.ptr(),
                self.dt_bias.ptr(),
                ps.core.ptr(),
                dims,
                t,
            )?,
        }
        pf::gated_rmsnorm_rows(
            g,
            ps.core.ptr(),
            ps.proj.ptr(),
            n,
            self.conv_dim,
            self.norm_w.ptr(),
            ps.mix_out.ptr(),
            dims.hv,
            dims.dv,
            p.eps,
            t,
        )?;
        let out = self.out.mv();
        pass_mv(p, out, (ps.mix_out.ptr(), ps.delta.ptr()), out.k, false)
    }
}

/// Rows `start..start + len` of a weight.
pub(crate) type RowRun = (usize, usize);

/// Row runs that turn Qwen3-Next's per-key-head groups `[q | k | v | z] × Hk` and
/// `[b | a] × Hk` into `[q (all heads) | k | v | z]` and `[b | a]`.
pub(crate) fn packed_runs(d: GdnDims) -> (Vec<RowRun>, Vec<RowRun>) {
    let (hk, dk) = (d.hk, d.dk);
    let r = d.hv / hk;
    let rv = r * d.dv;
    let group = 2 * dk + 2 * rv;
    let sect = |off: usize, len: usize| (0..hk).map(move |h| (h * group + off, len));
    let qkvz = sect(0, dk)
        .chain(sect(dk, dk))
        .chain(sect(2 * dk, rv))
        .chain(sect(2 * dk + rv, rv))
        .collect();
    let ba = (0..hk)
        .map(|h| (h * 2 * r, r))
        .chain((0..hk).map(|h| (h * 2 * r + r, r)))
        .collect();
    (qkvz, ba)
}

/// Row runs of a weight, each a view sharing its storage (quantized weights stay quantized).
fn row_runs(w: &LinearWeight, runs: &[RowRun]) -> Vec<LinearWeight> {
    runs.iter()
        .map(|&(start, len)| w.rows(start, len))
        .collect()
}

#[cfg(test)]
mod tests {
    use deltamoe_compute::cuda::ops::GdnDims;

    #[test]
    fn packed_runs_match_the_cpu_unpacking() {
        // hk 2, hv 4 (r 2), dk 1, dv 1: group = [q, k, v0, v1, z0, z1] per key head.
        let rows = |runs: Vec<(usize, usize)>| -> Vec<usize> {
            runs.into_iter().flat_map(|(s, l)| s..s + l).collect()
        };
        let d = GdnDims {
            hk: 2,
            hv: 4,
            dk: 1,
            dv: 1,
        };
        let (qkvz, ba) = super::packed_runs(d);
        let (qkvz, ba) = (rows(qkvz), rows(ba));
        assert_eq!(qkvz, vec![0, 6, 1, 7, 2, 3, 8, 9, 4, 5, 10, 11]);
        assert_eq!(ba, vec![0, 1, 4, 5, 2, 3, 6, 7]);
    }
}
