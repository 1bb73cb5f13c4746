//! The dense SwiGLU MLP on the GPU: `[gate | up]` as one matrix (SwiGLU in its epilogue), then
//! down. With the heads divided among GPUs (`checkpoint::heads`) each holds its share of the
//! intermediate rows, and the GPUs' partial outputs are added up by one all-reduce.
use deltamoe_compute::cuda::ops;
use deltamoe_compute::cuda::{Gpu, Result};

use super::{gate_up, pass_mv, Ffn, FfnIo, Needs, Pass, Stager, Step};
use crate::checkpoint::Mlp;
use crate::gpu::format::DevMat;
use crate::gpu::random::Filler;

pub(crate) struct DenseFfn {
    gate_up: DevMat,
    down: DevMat,
}

impl DenseFfn {
    /// A loaded MLP's weights on the device.
    pub fn upload(g: &Gpu, m: &Mlp, hidden: usize) -> Result<DenseFfn> {
        let i = m.gate.out_features();
        Ok(DenseFfn {
            gate_up: DevMat::stack(g, &gate_up(m), 2 * i, hidden, None)?,
            down: DevMat::of(g, &m.down)?,
        })
    }

    /// Random weights: hidden size `h`, intermediate size `n`.
    pub fn random(f: &mut Filler, h: usize, n: usize) -> Result<DenseFfn> {
        Ok(DenseFfn {
            gate_up: f.mats(1, 2 * n, h)?,
            down: f.mats(1, h, n)?,
        })
    }
}

impl Ffn for DenseFfn {
    fn needs(&self) -> Needs {
        Needs {
            inter: self.gate_up.n / 2,
            ..Needs::products(&[(self.gate_up.mv(), true), (self.down.mv(), false)])
        }
    }

    fn bytes_per_token(&self) -> usize {
        self.gate_up.bytes() + self.down.bytes()
    }

    fn bytes_per_step(&self, _rows: usize) -> usize {
        self.bytes_per_token()
    }

    fn params(&self) -> usize {
        self.gate_up.params() + self.down.params()
    }

    fn normalizes_after(&self) -> bool {
        false
    }

    fn normalizes_input(&self) -> bool {
        false
    }

    fn decode(&self, st: &Step, io: &FfnIo) -> Result<()> {
        let (g, s) = (st.g, st.s);
        let x_rows = st.row_slots(st.hidden);
        ops::matvec_swiglu(g, self.gate_up.mv(), s.normed.ptr(), s.ffn.h.ptr(), x_rows)?;
        let dm = self.down.mv();
        ops::matvec(g, dm, s.ffn.h.ptr(), s.delta.ptr(), st.row_slots(dm.k))?;
        st.sum_parts(s.delta.ptr())?;
        if st.fused {
            // The residual stays whole: the output joins it now (the norm written with it goes
            // unused; the next projection normalizes).
            st.add_norm(s.delta.ptr(), io.norm_after)?;
        }
        Ok(())
    }

    fn prefill(&self, p: &Pass, _stage: &Stager) -> Result<()> {
        let ps = p.ps;
        let gu = (ps.normed.ptr(), ps.ffn.h.ptr());
        pass_mv(p, self.gate_up.mv(), gu, p.hidden, true)?;
        let dm = self.down.mv();
        pass_mv(p, dm, (ps.ffn.h.ptr(), ps.delta.ptr()), dm.k, false)?;
        p.sum_parts()
    }
}
