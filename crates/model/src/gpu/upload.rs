//! Uploading a loaded model's weights: device matrices (bf16 or MLX affine), the fused
//! projections and the per-layer mixer and ffn weights.

use std::ops::Range;

use deltamoe_compute::cuda::ops::{GdnDims, Matvec, WeightFormat, GDN_DK_MAX, GDN_DV_MAX};
use deltamoe_compute::cuda::{DevBuf, Gpu};
use deltamoe_compute::dtype::f32_to_bf16;
use deltamoe_compute::{AffineWeight, TensorData};

use super::host_store::{Dest, ExpertSource, Fmt};
use super::offload::Pending;
use super::{unsupported, GpuFfn, GpuMixer, Result};
use crate::layers::gdn::InProj;
use crate::layers::{DenseSource, Linear, LinearWeight, Mlp};
use crate::qwen3_hybrid::{Ffn, Mixer};

/// bf16 bits of a tensor (rounded from f16/f32; quantized weights dequantized).
pub(crate) fn bf16_bits<W: DenseSource + ?Sized>(w: &W) -> Vec<u16> {
    let t = w.dense();
    match t.data() {
        TensorData::BF16(s) => s.iter().map(|v| v.to_bits()).collect(),
        TensorData::F16(s) => s.iter().map(|v| f32_to_bf16(v.to_f32())).collect(),
        TensorData::F32(s) => s.iter().map(|&v| f32_to_bf16(v)).collect(),
    }
}

/// A device matrix (or a stack of same-shaped matrices, e.g. experts) with its per-matrix
/// geometry and optional bias.
pub(crate) struct DevMat {
    pub(super) w: DevWeights,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) bias: Option<DevBuf<f32>>,
}

pub(crate) enum DevWeights {
    Bf16(DevBuf<u16>),
    Affine {
        words: DevBuf<u32>,
        scales: DevBuf<u16>,
        biases: DevBuf<u16>,
        bits: u32,
        group: usize,
    },
}

/// Bits the quantized CUDA kernels read (MLX's 3 and 6 bits pack across words: dequantized).
const GPU_BITS: [u32; 3] = [2, 4, 8];

impl DevMat {
    /// `parts` stacked by rows, read as matrices of `n` rows: kept quantized when every part is
    /// affine with the same bits (2/4/8) and group, else bf16 (dequantized where needed).
    pub(super) fn stack(
        g: &Gpu,
        parts: &[&LinearWeight],
        n: usize,
        k: usize,
        bias: Option<Vec<f32>>,
    ) -> Result<DevMat> {
        let bias = bias.map(|b| g.upload(&b)).transpose()?;
        let w = match StackData::of(parts) {
            StackData::Bf16(bits) => DevWeights::Bf16(g.upload(&bits)?),
            StackData::Affine {
                words,
                scales,
                biases,
                bits,
                group,
            } => DevWeights::Affine {
                words: g.upload(&words)?,
                scales: g.upload(&scales)?,
                biases: g.upload(&biases)?,
                bits,
                group,
            },
        };
        Ok(DevMat { w, n, k, bias })
    }

    pub(super) fn of(g: &Gpu, l: &Linear) -> Result<DevMat> {
        let [n, k] = l.weight.shape();
        DevMat::stack(g, &[&l.weight], n, k, l.bias.clone())
    }

    pub(super) fn mv(&self) -> Matvec {
        let bias = self.bias.as_ref().map_or(0, |b| b.ptr());
        let (w, format) = match &self.w {
            DevWeights::Bf16(b) => (b.ptr(), WeightFormat::Bf16),
            DevWeights::Affine {
                words,
                scales,
                biases,
                bits,
                group,
            } => (
                words.ptr(),
                WeightFormat::Affine {
                    bits: *bits,
                    group: *group,
                    scales: scales.ptr(),
                    biases: biases.ptr(),
                },
            ),
        };
        Matvec {
            w,
            n: self.n,
            k: self.k,
            bias,
            format,
        }
    }

    /// Bytes one matrix of the stack occupies.
    pub(super) fn bytes(&self) -> usize {
        self.fmt().matrix_bytes()
    }

    pub(super) fn fmt(&self) -> Fmt {
        Fmt {
            n: self.n,
            k: self.k,
            affine: self.w.affine(),
        }
    }

    /// A stack of no matrices in this one's format.
    pub(super) fn empty(&self, g: &Gpu) -> Result<DevMat> {
        self.fmt().device_stack(g, 0)
    }

    /// (base address, bytes per matrix) of each array of the stack.
    pub(super) fn pieces(&self) -> Vec<(u64, usize)> {
        let ptrs = match &self.w {
            DevWeights::Bf16(b) => vec![b.ptr()],
            DevWeights::Affine {
                words,
                scales,
                biases,
                ..
            } => vec![words.ptr(), scales.ptr(), biases.ptr()],
        };
        ptrs.into_iter()
            .zip(array_bytes(self.n, self.k, self.w.affine()))
            .collect()
    }
}

impl DevWeights {
    /// (bits, group) of affine weights.
    fn affine(&self) -> Option<(u32, usize)> {
        match self {
            DevWeights::Bf16(_) => None,
            DevWeights::Affine { bits, group, .. } => Some((*bits, *group)),
        }
    }
}

/// Bytes per `[n, k]` matrix of each array of a stack in the device layout: the bf16 values, or
/// the affine words, scales and biases (`affine`: bits and group).
pub(crate) fn array_bytes(n: usize, k: usize, affine: Option<(u32, usize)>) -> Vec<usize> {
    let nk = n * k;
    match affine {
        None => vec![2 * nk],
        Some((bits, group)) => vec![nk * bits as usize / 8, 2 * nk / group, 2 * nk / group],
    }
}

/// Stacked weights on the host, in the device layout: bf16 bits, or MLX affine words, scales
/// and biases.
pub(crate) enum StackData {
    Bf16(Vec<u16>),
    Affine {
        words: Vec<u32>,
        scales: Vec<u16>,
        biases: Vec<u16>,
        bits: u32,
        group: usize,
    },
}

impl StackData {
    /// Each array's bytes.
    fn arrays(&self) -> Vec<&[u8]> {
        fn bytes<T>(v: &[T]) -> &[u8] {
            // SAFETY: plain integers: any initialised value is valid as bytes, same length.
            unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
        }
        match self {
            StackData::Bf16(b) => vec![bytes(b)],
            StackData::Affine {
                words,
                scales,
                biases,
                ..
            } => vec![bytes(words), bytes(scales), bytes(biases)],
        }
    }

    /// `parts` stacked by rows: quantized when every part is affine with the same bits (2/4/8)
    /// and group, else bf16 (dequantized where needed).
    pub(crate) fn of(parts: &[&LinearWeight]) -> StackData {
        StackData::as_format(parts, stack_format(parts))
    }

    /// `parts` stacked by rows in the format `stack_format` chose for them (or for a stack
    /// they are part of).
    fn as_format(parts: &[&LinearWeight], affine: Option<(u32, usize)>) -> StackData {
        let a: Option<Vec<&AffineWeight>> = parts.iter().map(|p| p.as_affine()).collect();
        let (Some((bits, group)), Some(a)) = (affine, a) else {
            return StackData::Bf16(parts.iter().flat_map(|p| bf16_bits(*p)).collect());
        };
        StackData::Affine {
            words: a.iter().flat_map(|w| w.words().into_owned()).collect(),
            scales: a.iter().flat_map(|w| bf16_bits(w.scales())).collect(),
            biases: a.iter().flat_map(|w| bf16_bits(w.biases())).collect(),
            bits,
            group,
        }
    }
}

/// The device format of `parts` stacked: affine `(bits, group)` when every part is affine with
/// the same bits (2/4/8) and group, else bf16 (None).
fn stack_format(parts: &[&LinearWeight]) -> Option<(u32, usize)> {
    let a: Vec<&AffineWeight> = parts.iter().map(|p| p.as_affine()).collect::<Option<_>>()?;
    let (bits, group) = (a.first()?.bits(), a[0].group_size());
    let same = a
        .iter()
        .all(|w| w.bits() == bits && w.group_size() == group);
    (same && GPU_BITS.contains(&bits)).then_some((bits, group))
}

/// A loaded MoE layer's experts as an [`ExpertSource`]: `[gate | up]` (two parts an expert)
/// and down of each, the shared expert last when stacked.
struct LoadedExperts<'a> {
    gu: Vec<&'a LinearWeight>,
    down: Vec<&'a LinearWeight>,
    formats: (Fmt, Fmt),
}

impl ExpertSource for LoadedExperts<'_> {
    fn formats(&self) -> (Fmt, Fmt) {
        self.formats
    }

    fn write(&self, g: &Gpu, down: bool, experts: Range<usize>, to: Dest<'_>) -> Result<()> {
        let (parts, per, fmt) = match down {
            false => (&self.gu, 2, self.formats.0),
            true => (&self.down, 1, self.formats.1),
        };
        for (j, e) in experts.enumerate() {
            let data = StackData::as_format(&parts[e * per..(e + 1) * per], fmt.affine);
            let at = (to.at + j) as u64;
            for (src, &(d, bytes)) in data.arrays().into_iter().zip(to.arrays) {
                // SAFETY: `src` is one matrix's array (`bytes` bytes, the format's size) and
                // `to` holds matrix at; a copy from pageable memory returns once the source
                // has been read.
                unsafe { g.copy_raw(d + at * bytes as u64, src.as_ptr() as u64, bytes)? };
            }
        }
        Ok(())
    }
}

/// `[gate | up]` rows of an MLP, then its down projection.
fn gate_up(m: &Mlp) -> [&LinearWeight; 2] {
    [&m.gate.weight, &m.up.weight]
}

pub(super) fn upload_mixer(g: &Gpu, m: &Mixer, hidden: usize) -> Result<GpuMixer> {
    Ok(match m {
        Mixer::Linear(l) => {
            let s = l.shape;
            if s.k_dim > GDN_DK_MAX || s.v_dim > GDN_DV_MAX {
                return Err(unsupported(format!(
                    "GDN head dims {}/{} exceed the CUDA kernel limits ({GDN_DK_MAX}/{GDN_DV_MAX})",
                    s.k_dim, s.v_dim
                )));
            }
            let conv_dim = l.conv_w.len() / l.conv_kernel;
            let n = conv_dim + s.n_v_heads * s.v_dim + 2 * s.n_v_heads;
            let proj = match &l.proj {
                InProj::Split { qkv, z, b, a } => DevMat::stack(
                    g,
                    &[&qkv.weight, &z.weight, &b.weight, &a.weight],
                    n,
                    hidden,
                    None,
                )?,
                InProj::Packed { qkvz, ba } => {
                    let (qkvz_runs, ba_runs) =
                        packed_runs(s.n_k_heads, s.n_v_heads, s.k_dim, s.v_dim);
                    let parts: Vec<LinearWeight> = row_runs(&qkvz.weight, &qkvz_runs)
                        .into_iter()
                        .chain(row_runs(&ba.weight, &ba_runs))
                        .collect();
                    DevMat::stack(g, &parts.iter().collect::<Vec<_>>(), n, hidden, None)?
                }
            };
            GpuMixer::Linear {
                proj,
                conv_w: g.upload(&l.conv_w)?,
                neg_a: g.upload(&l.neg_a)?,
                dt_bias: g.upload(&l.dt_bias)?,
                norm_w: g.upload(&l.norm_w)?,
                out: DevMat::of(g, &l.out_proj)?,
                dims: GdnDims {
                    hk: s.n_k_heads,
                    hv: s.n_v_heads,
                    dk: s.k_dim,
                    dv: s.v_dim,
                },
                conv_dim,
                kernel: l.conv_kernel,
            }
        }
        Mixer::Full(a) => {
            let ws = [&a.q_proj, &a.k_proj, &a.v_proj];
            let n = ws.iter().map(|l| l.out_features()).sum();
            let bias = if a.q_proj.bias.is_some() {
                Some(
                    ws.iter()
                        .flat_map(|l| {
                            l.bias
                                .clone()
                                .unwrap_or_else(|| vec![0.0; l.out_features()])
                        })
                        .collect(),
                )
            } else {
                None
            };
            GpuMixer::Full {
                proj: DevMat::stack(g, &ws.map(|l| &l.weight), n, hidden, bias)?,
                qn: g.upload(&a.q_norm)?,
                kn: g.upload(&a.k_norm)?,
                out: DevMat::of(g, &a.o_proj)?,
            }
        }
    })
}

/// Rows `start..start + len` of a weight.
pub(crate) type RowRun = (usize, usize);

/// Row runs that turn Qwen3-Next's per-key-head groups `[q | k | v | z] × Hk` and
/// `[b | a] × Hk` into `[q (all heads) | k | v | z]` and `[b | a]`.
pub(crate) fn packed_runs(
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
) -> (Vec<RowRun>, Vec<RowRun>) {
    let r = hv / hk;
    let rv = r * dv;
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
fn row_runs(w: &LinearWeight, runs: &[(usize, usize)]) -> Vec<LinearWeight> {
    runs.iter()
        .map(|&(start, len)| match w {
            LinearWeight::Dense(t) => LinearWeight::Dense(t.narrow(start, len)),
            LinearWeight::Affine(a) => LinearWeight::Affine(Box::new(a.rows(start, len))),
        })
        .collect()
}

/// Whether two weights are stored alike (both dense, or affine with the same bits and group).
fn same_format(a: &LinearWeight, b: &LinearWeight) -> bool {
    match (a, b) {
        (LinearWeight::Dense(_), LinearWeight::Dense(_)) => true,
        (LinearWeight::Affine(x), LinearWeight::Affine(y)) => {
            x.bits() == y.bits() && x.group_size() == y.group_size()
        }
        _ => false,
    }
}

/// Layer `layer`'s ffn device weights; with `offload`, an MoE layer's device expert stacks start
/// empty and its routed experts are returned to be placed (see [`super::offload`]).
pub(super) fn upload_ffn<'a>(
    g: &Gpu,
    f: &'a Ffn,
    layer: usize,
    hidden: usize,
    offload: bool,
) -> Result<(GpuFfn, Option<Pending<'a>>)> {
    let ffn = match f {
        Ffn::Dense(m) => {
            let i = m.gate.out_features();
            GpuFfn::Dense {
                gate_up: DevMat::stack(g, &gate_up(m), 2 * i, hidden, None)?,
                down: DevMat::of(g, &m.down)?,
            }
        }
        Ffn::Moe(m) => {
            let (e, i) = (m.experts.len(), m.experts[0].gate.out_features());
            if e > 1024 || m.top_k > 32 {
                return Err(unsupported(format!(
                    "{e} experts / top-{} exceed the CUDA router limits (1024 / 32)",
                    m.top_k
                )));
            }
            let si = m.shared.gate.out_features();
            // The shared expert joins the routed ones as one more stacked expert when it has
            // their shape and storage format: then it runs in the same launches.
            let stack_shared =
                si == i && same_format(&m.shared.gate.weight, &m.experts[0].gate.weight);
            let mlps = m.experts.iter().chain(stack_shared.then_some(&m.shared));
            let gu: Vec<&LinearWeight> = mlps.clone().flat_map(gate_up).collect();
            let down: Vec<&LinearWeight> = mlps.map(|x| &x.down.weight).collect();
            let shared = if stack_shared {
                None
            } else {
                Some((
                    DevMat::stack(g, &gate_up(&m.shared), 2 * si, hidden, None)?,
                    DevMat::of(g, &m.shared.down)?,
                ))
            };
            let router = DevMat::stack(
                g,
                &[&m.router.weight, &m.shared_gate.weight],
                e + 1,
                hidden,
                None,
            )?;
            if offload {
                let formats = (
                    Fmt {
                        n: 2 * i,
                        k: hidden,
                        affine: stack_format(&gu),
                    },
                    Fmt {
                        n: hidden,
                        k: i,
                        affine: stack_format(&down),
                    },
                );
                let ffn = GpuFfn::Moe {
                    router,
                    experts_gu: formats.0.device_stack(g, 0)?,
                    experts_down: formats.1.device_stack(g, 0)?,
                    shared,
                    offload: None,
                };
                let src = LoadedExperts { gu, down, formats };
                let pending = Pending {
                    layer,
                    experts: e,
                    stacked: stack_shared,
                    src: Box::new(src),
                };
                return Ok((ffn, Some(pending)));
            }
            GpuFfn::Moe {
                router,
                experts_gu: DevMat::stack(g, &gu, 2 * i, hidden, None)?,
                experts_down: DevMat::stack(g, &down, hidden, i, None)?,
                shared,
                offload: None,
            }
        }
    };
    Ok((ffn, None))
}

#[cfg(test)]
mod tests {
    #[test]
    fn packed_runs_match_the_cpu_unpacking() {
        // hk 2, hv 4 (r 2), dk 1, dv 1: group = [q, k, v0, v1, z0, z1] per key head.
        let rows = |runs: Vec<(usize, usize)>| -> Vec<usize> {
            runs.into_iter().flat_map(|(s, l)| s..s + l).collect()
        };
        let (qkvz, ba) = super::packed_runs(2, 4, 1, 1);
        let (qkvz, ba) = (rows(qkvz), rows(ba));
        assert_eq!(qkvz, vec![0, 6, 1, 7, 2, 3, 8, 9, 4, 5, 10, 11]);
        assert_eq!(ba, vec![0, 1, 4, 5, 2, 3, 6, 7]);
    }
}
