//! Gated full attention on the GPU: the fused input projection `[q/gate | k | v]`, q/k RMSNorm
//! and RoPE with the KV-cache append, split-K decode attention (tensor-core flash attention in
//! prefill) gated by the sigmoid of the gate rows, then the output projection. State per slot:
//! the K and V caches `[ctx, Hkv, D]`.
use deltamoe_compute::cpu::rope::Rope;
use deltamoe_compute::cuda::gemm;
use deltamoe_compute::cuda::ops::{self, AttnDims, Batch, Matvec, ATTN_DMAX};
use deltamoe_compute::cuda::prefill as pf;
use deltamoe_compute::cuda::vec::VecIo;
use deltamoe_compute::cuda::{CudaError, DevBuf, Gpu, Result};

use super::bufs::ATTN_SPLITS;
use super::{pass_mv, slot_at, Mixer, Needs, Pass, PrefillGemm, State, StateSpec, Step};
use crate::checkpoint::Attention;
use crate::config::ModelConfig;
use crate::gpu::format::DevMat;
use crate::gpu::random::Filler;

pub(crate) struct AttnMixer {
    proj: DevMat,
    qn: DevBuf<f32>,
    kn: DevBuf<f32>,
    out: DevMat,
    dims: AttnDims,
    inv_freq: DevBuf<f32>,
}

/// Attention geometry of config `c`, checked against the CUDA kernels' head-dim limit.
fn dims(c: &ModelConfig) -> Result<AttnDims> {
    if c.head_dim > ATTN_DMAX {
        return Err(CudaError::Unsupported(format!(
            "head_dim {} exceeds the CUDA attention limit {ATTN_DMAX}",
            c.head_dim
        )));
    }
    Ok(AttnDims {
        hq: c.num_heads,
        hkv: c.num_kv_heads,
        d: c.head_dim,
        rotary: c.rotary_dim,
    })
}

impl AttnMixer {
    /// A loaded layer's weights on the device.
    pub fn upload(g: &Gpu, a: &Attention, c: &ModelConfig, rope: &Rope) -> Result<AttnMixer> {
        let ws = [&a.q_proj, &a.k_proj, &a.v_proj];
        let n = ws.iter().map(|l| l.out_features()).sum();
        // One bias over the fused rows when the projections have them (zeros where one lacks it).
        let bias = a.q_proj.bias.is_some().then(|| {
            ws.iter()
                .flat_map(|l| {
                    l.bias
                        .clone()
                        .unwrap_or_else(|| vec![0.0; l.out_features()])
                })
                .collect()
        });
        Ok(AttnMixer {
            proj: DevMat::stack(g, &ws.map(|l| &l.weight), n, c.hidden_size, bias)?,
            qn: g.upload(&a.q_norm)?,
            kn: g.upload(&a.k_norm)?,
            out: DevMat::of(g, &a.o_proj)?,
            dims: dims(c)?,
            inv_freq: g.upload(rope.inv_freq())?,
        })
    }

    /// Random weights of config `c`'s shape.
    pub fn random(f: &mut Filler, c: &ModelConfig) -> Result<AttnMixer> {
        let (h, qd, kvd) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        );
        let rope = Rope::new(c.rotary_dim, c.rope_theta);
        Ok(AttnMixer {
            proj: f.mats(1, 2 * qd + 2 * kvd, h)?,
            qn: f.vec(c.head_dim, 0.5, 1.5)?,
            kn: f.vec(c.head_dim, 0.5, 1.5)?,
            out: f.mats(1, h, qd)?,
            dims: dims(c)?,
            inv_freq: f.g.upload(rope.inv_freq())?,
        })
    }

    /// Floats of one position of a K or V cache.
    fn row(&self) -> usize {
        self.dims.hkv * self.dims.d
    }

    /// q/k norm + RoPE of the projected rows into `q`, K and V appended to the caches at each
    /// row's position (`row_advances`: row r of one sequence is at pos + r).
    fn prep(
        &self,
        g: &Gpu,
        bufs: (u64, u64),
        st: (State, u64, usize),
        bt: Batch,
        eps: f32,
        row_advances: bool,
    ) -> Result<()> {
        let ((proj, q), ([kc, vc], pos, ctx)) = (bufs, st);
        ops::attn_prep(
            g,
            proj,
            self.proj.n,
            self.qn.ptr(),
            self.kn.ptr(),
            self.inv_freq.ptr(),
            q,
            kc,
            vc,
            pos,
            self.dims,
            eps,
            bt,
            ctx,
            row_advances,
        )
    }
}

impl Mixer for AttnMixer {
    fn kind(&self) -> &'static str {
        "attention"
    }

    fn projections(&self) -> [Matvec; 2] {
        [self.proj.mv(), self.out.mv()]
    }

    fn needs(&self, _rows: usize) -> Needs {
        Needs {
            proj: self.proj.n,
            ..Needs::default()
        }
    }

    fn state(&self, ctx: usize) -> StateSpec {
        StateSpec {
            per_slot: [ctx * self.row(), ctx * self.row()],
            row: Some(self.row()),
        }
    }

    fn bytes_per_token(&self, ctx: usize) -> usize {
        self.proj.bytes() + self.out.bytes() + 2 * 4 * ctx * self.row()
    }

    fn weight_bytes(&self) -> usize {
        self.proj.bytes() + self.out.bytes()
    }

    fn params(&self) -> usize {
        self.proj.params() + self.out.params()
    }

    fn decode(&self, st: &Step, state: State, _saved: State, norm: u64) -> Result<()> {
        let (g, s) = (st.g, st.s);
        st.input_projection(self.proj.mv(), norm, VecIo::default())?;
        let bufs = (s.proj.ptr(), s.q.ptr());
        self.prep(g, bufs, (state, st.pos, st.ctx), st.bt, st.eps, st.verify)?;
        let [kc, vc] = state;
        ops::attn_decode(
            g,
            s.q.ptr(),
            kc,
            vc,
            st.pos,
            s.part_o.ptr(),
            s.part_ml.ptr(),
            s.proj.ptr(),
            self.proj.n,
            s.mix_out.ptr(),
            self.dims,
            ATTN_SPLITS,
            st.bt,
            st.ctx,
            st.verify,
        )?;
        st.output_projection(self.out.mv())
    }

    fn prefill(&self, p: &Pass, state: State) -> Result<()> {
        let (g, ps, t) = (p.g, p.ps, p.t);
        let proj = self.proj.mv();
        pass_mv(p, proj, (ps.normed.ptr(), ps.proj.ptr()), p.hidden, false)?;
        let bt = Batch {
            rows: t,
            slots: ps.slots.ptr(),
        };
        let bufs = (ps.proj.ptr(), ps.q.ptr());
        self.prep(g, bufs, (state, p.pos, p.ctx), bt, p.eps, true)?;
        let per_slot = p.ctx * self.row();
        let [kc, vc] = state;
        let io = (ps.q.ptr(), ps.proj.ptr(), proj.n, ps.mix_out.ptr());
        let mut caches = (slot_at(kc, p.slot, per_slot), slot_at(vc, p.slot, per_slot));
        let bf16 = p.gemm == PrefillGemm::Bf16;
        if bf16 {
            // The bf16 form reads bf16 copies of the slot's rows (`ps.kvb`: K, then V).
            let (row, rows) = (self.row(), p.pos0 + t);
            let (kb, vb) = (ps.kvb.ptr(), ps.kvb.at(rows * row));
            gemm::rows_to_bf16(g, caches.0, row, kb, row, rows)?;
            gemm::rows_to_bf16(g, caches.1, row, vb, row, rows)?;
            caches = (kb, vb);
        }
        pf::attn_prefill(g, io, caches, self.dims, (t, p.pos0), bf16)?;
        let out = self.out.mv();
        pass_mv(p, out, (ps.mix_out.ptr(), ps.delta.ptr()), out.k, false)
    }
}
