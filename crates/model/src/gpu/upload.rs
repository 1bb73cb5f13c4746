//! Uploading a loaded model: device matrices (bf16 or MLX affine) and the model assembled from
//! its layers, one arm per layer kind.

use deltamoe_compute::cuda::ops::Matvec;
use deltamoe_compute::cuda::{DevBuf, Gpu};

use super::format::DevFormat;
use super::host_store::Fmt;
use super::layers::attention::AttnMixer;
use super::layers::dense::DenseFfn;
use super::layers::gdn::GdnMixer;
use super::layers::head::Head;
use super::layers::moe::MoeFfn;
use super::layers::{FfnMade, GpuLayer, Mixer};
use super::offload::Pending;
use super::{Parts, Result};
use crate::layers::{Linear, LinearWeight};
use crate::qwen3_hybrid::{self as cpu, Qwen3Hybrid};

/// A loaded model's device weights, and (with `offload`) each MoE layer's routed experts still
/// to be placed (see [`super::offload`]).
pub(super) fn upload_model<'a>(
    g: &Gpu,
    m: &'a Qwen3Hybrid,
    offload: bool,
) -> Result<(Parts, Vec<Pending<'a>>)> {
    let c = m.config();
    let h = c.hidden_size;
    let mut pending = Vec::new();
    let mut layers = Vec::with_capacity(m.layers.len());
    for (i, l) in m.layers.iter().enumerate() {
        let mixer: Box<dyn Mixer> = match &l.mixer {
            cpu::Mixer::Linear(x) => Box::new(GdnMixer::upload(g, x, h)?),
            cpu::Mixer::Full(x) => Box::new(AttnMixer::upload(g, x, c, &m.rope)?),
        };
        let (ffn, experts): FfnMade = match &l.ffn {
            cpu::Ffn::Dense(x) => (Box::new(DenseFfn::upload(g, x, h)?), None),
            cpu::Ffn::Moe(x) => MoeFfn::upload(g, x, i, h, offload)?,
        };
        pending.extend(experts);
        layers.push(GpuLayer {
            input_norm: g.upload(&l.input_norm)?,
            mixer,
            post_norm: g.upload(&l.post_norm)?,
            ffn,
        });
    }
    let head = Head::upload(g, m)?;
    Ok((Parts { head, layers }, pending))
}

/// A device matrix (or a stack of same-shaped matrices, e.g. experts) with its per-matrix
/// geometry and optional bias.
pub(crate) struct DevMat {
    pub(crate) w: DevWeights,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) bias: Option<DevBuf<f32>>,
}

/// A stack's arrays on the device, in the layout of its format.
pub(crate) struct DevWeights {
    pub(crate) format: DevFormat,
    pub(crate) arrays: Vec<DevBuf<u8>>,
}

impl DevMat {
    /// `parts` stacked by rows, read as matrices of `n` rows, in the format
    /// [`DevFormat::of`] picks for them.
    pub(crate) fn stack(
        g: &Gpu,
        parts: &[&LinearWeight],
        n: usize,
        k: usize,
        bias: Option<Vec<f32>>,
    ) -> Result<DevMat> {
        let bias = bias.map(|b| g.upload(&b)).transpose()?;
        let format = DevFormat::of(parts);
        let arrays = format.arrays(parts);
        let arrays = arrays.iter().map(|a| g.upload(a)).collect::<Result<_>>()?;
        let w = DevWeights { format, arrays };
        Ok(DevMat { w, n, k, bias })
    }

    pub(crate) fn of(g: &Gpu, l: &Linear) -> Result<DevMat> {
        let [n, k] = l.weight.shape();
        DevMat::stack(g, &[&l.weight], n, k, l.bias.clone())
    }

    pub(crate) fn mv(&self) -> Matvec {
        let bias = self.bias.as_ref().map_or(0, |b| b.ptr());
        let ptrs: Vec<u64> = self.w.arrays.iter().map(|a| a.ptr()).collect();
        let (w, format) = self.w.format.operands(&ptrs);
        Matvec {
            w,
            n: self.n,
            k: self.k,
            bias,
            format,
        }
    }

    /// Bytes one matrix of the stack occupies.
    pub(crate) fn bytes(&self) -> usize {
        self.fmt().matrix_bytes()
    }

    /// Weights of one matrix of the stack.
    pub(crate) fn params(&self) -> usize {
        self.n * self.k
    }

    pub(super) fn fmt(&self) -> Fmt {
        Fmt::new(self.n, self.k, self.w.format)
    }

    /// A stack of no matrices in this one's format.
    pub(super) fn empty(&self, g: &Gpu) -> Result<DevMat> {
        self.fmt().device_stack(g, 0)
    }

    /// (base address, bytes per matrix) of each array of the stack.
    pub(super) fn pieces(&self) -> Vec<(u64, usize)> {
        let ptrs = self.w.arrays.iter().map(|a| a.ptr());
        ptrs.zip(self.fmt().array_bytes()).collect()
    }
}
