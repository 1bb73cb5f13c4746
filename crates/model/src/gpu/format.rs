//! Weight formats on the GPU, in one place, and the device matrices ([`DevMat`]) stored in them: how a stack of `[n, k]` matrices of each format is
//! laid out (its arrays and their bytes per matrix, the same in device and pinned host memory),
//! which format a checkpoint's weights take, how they are written in that layout, and the kernel
//! operands that describe it ([`WeightFormat`]). The kernels' dispatch on those operands is
//! `deltamoe_compute::cuda::ops`'s. Adding a format is one arm in each function here (see
//! `docs/architecture.md`).

use deltamoe_compute::cuda::ops::{AffineParams, Far, Matvec, WeightFormat};
use deltamoe_compute::cuda::{DevBuf, Gpu, Result};
use deltamoe_compute::dtype::f32_to_bf16;
use deltamoe_compute::quant::{pack_row, unpack_row};
use deltamoe_compute::TensorData;
use rayon::prelude::*;

use crate::checkpoint::{DenseSource, Linear, LinearWeight};

/// How a device matrix stack is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DevFormat {
    /// bf16 values `[E, N, K]` (f16/f32 checkpoints rounded, other formats dequantized).
    Bf16,
    /// Affine: u32 words `[E, N, K·bits/32]` and two parameter arrays `[E, N, K/group]`: bf16
    /// scales and biases (MLX), or f16 scales and zero points (GPTQ/AWQ; see [`AffineParams`]).
    Affine {
        bits: u32,
        group: usize,
        params: AffineParams,
    },
    /// Fine-grained FP8: e4m3 bytes `[E, N, K]`, f32 scales `[E, N, ⌈K/group⌉]` (each row's copy
    /// of the scales of the blocks it lies in; `group` the blocks' width along K).
    Fp8 { group: usize },
}

/// The bits the quantized CUDA kernels read for affine codes of `bits`: 2, 4 and 8 as they are;
/// 3, 5 and 6 (MLX's, GGUF's Q5_0/Q5_1/Q5_K), which pack across words, widened to 8-bit codes
/// of the same values and parameters (exact, 8 bits a weight instead of bf16's 16).
fn gpu_bits(bits: u32) -> Option<u32> {
    match bits {
        2 | 4 | 8 => Some(bits),
        3 | 5 | 6 => Some(8),
        _ => None,
    }
}

/// Affine group sizes every quantized CUDA kernel reads.
const GPU_GROUPS: [usize; 3] = [32, 64, 128];

/// Whether the CUDA kernels read a checkpoint's `bits`-bit codes in groups of `group`:
/// [`GPU_GROUPS`] on every form, and codes held at 4 or 8 bits in groups of 16: 8-bit ones with
/// f32 parameters (GGUF's Q6_K, 3/5-bit K-quants and stacks with them) on every form, the others
/// (a tensor-parallel share of a projection that cuts its groups of 32, `checkpoint::heads`) on
/// the CUDA-core forms, which `cuda::dispatch` gives every matrix the tensor-core forms do not
/// take.
fn gpu_group(bits: u32, group: usize) -> bool {
    GPU_GROUPS.contains(&group) || (group == 16 && matches!(gpu_bits(bits), Some(4 | 8)))
}

impl DevFormat {
    /// The format of `parts` stacked by rows: affine when every part is affine with the same
    /// bits (3/5/6 widened to 8) and group (32/64/128), FP8 when every part is FP8 with the same
    /// block width (a multiple of 8) and K % 8 == 0 (fp8.cu's 8-byte loads), else bf16.
    pub fn of(parts: &[&LinearWeight]) -> DevFormat {
        let fp8: Option<Vec<_>> = parts.iter().map(|p| p.as_fp8()).collect();
        if let Some(f) = fp8.filter(|f| !f.is_empty()) {
            let (group, k) = (f[0].block()[1], f[0].in_features());
            let same = f.iter().all(|w| w.block()[1] == group);
            return match same && group.is_multiple_of(8) && k.is_multiple_of(8) {
                true => DevFormat::Fp8 { group },
                false => DevFormat::Bf16,
            };
        }
        let affine: Option<Vec<_>> = parts.iter().map(|p| p.as_affine()).collect();
        let Some(a) = affine.filter(|a| !a.is_empty()) else {
            return DevFormat::Bf16;
        };
        // Parts of other widths, groups or parameter forms share the widest codes, the smallest
        // group (a wider one's parameters repeated) and, when their forms differ, f32 parameters,
        // which hold every form's values exactly.
        let bits = a.iter().map(|w| gpu_bits(w.bits())).max().flatten();
        let group = a.iter().map(|w| w.group_size()).min().unwrap_or(0);
        let params = match a.iter().map(|w| params_of(w)).collect::<Vec<_>>() {
            p if p.iter().all(|&x| x == p[0]) => p[0],
            _ => AffineParams::F32,
        };
        let fits = a.iter().all(|w| {
            gpu_bits(w.bits()).is_some()
                && gpu_group(w.bits(), group)
                && w.group_size().is_multiple_of(group)
        });
        match (fits, bits) {
            (true, Some(bits)) => DevFormat::Affine {
                bits,
                group,
                params,
            },
            _ => DevFormat::Bf16,
        }
    }

    /// The format of an embedding table `w`, whose rows are looked up one at a time (ops::embed):
    /// affine codes held at 2, 4 or 8 bits in any group that divides the row, with their exact
    /// parameters; else as [`Self::of`].
    pub fn lookup(w: &LinearWeight) -> DevFormat {
        let Some(a) = w.as_affine() else {
            return DevFormat::of(&[w]);
        };
        match gpu_bits(a.bits()) {
            Some(bits) => DevFormat::Affine {
                bits,
                group: a.group_size(),
                params: params_of(a),
            },
            None => DevFormat::of(&[w]),
        }
    }

    /// Compile and load the kernels this format needs beyond the default build (GPTQ/AWQ's),
    /// before any step is captured: called by both constructors of a stack ([`DevMat::stack`],
    /// [`Fmt::device_stack`]).
    pub fn prepare(&self, g: &Gpu) -> Result<()> {
        match *self {
            DevFormat::Affine { params, .. } => g.kernels().prepare(params),
            _ => Ok(()),
        }
    }

    /// Bytes one `[n, k]` matrix takes in each array.
    pub fn array_bytes(&self, n: usize, k: usize) -> Vec<usize> {
        let nk = n * k;
        match *self {
            DevFormat::Bf16 => vec![2 * nk],
            DevFormat::Affine {
                bits,
                group,
                params,
            } => {
                let p = params.bytes() * nk / group;
                vec![nk * bits as usize / 8, p, p]
            }
            DevFormat::Fp8 { group } => vec![nk, 4 * n * k.div_ceil(group)],
        }
    }

    /// `parts` stacked by rows in this format (one of [`Self::of`] the parts, or of a stack they
    /// are part of), as the bytes of each array.
    pub fn arrays(&self, parts: &[&LinearWeight]) -> Vec<Vec<u8>> {
        if let DevFormat::Fp8 { .. } = self {
            if let Some(f) = parts.iter().map(|p| p.as_fp8()).collect::<Option<Vec<_>>>() {
                return vec![
                    concat(f.iter().map(|w| w.codes())),
                    concat(f.iter().map(|w| row_scales(w))),
                ];
            }
        }
        let affine: Option<Vec<_>> = parts.iter().map(|p| p.as_affine()).collect();
        let (
            &DevFormat::Affine {
                params,
                bits,
                group,
            },
            Some(a),
        ) = (self, affine)
        else {
            return vec![concat(parts.iter().map(|p| bf16_bits(*p)))];
        };
        let (mut scales, mut biases) = (Vec::new(), Vec::new());
        for w in &a {
            let (s, b) = param_bytes(w, params, w.group_size() / group);
            scales.extend(s);
            biases.extend(b);
        }
        vec![concat(a.iter().map(|w| words_at(w, bits))), scales, biases]
    }

    /// The kernels' operands for a stack whose arrays start at `ptrs`.
    pub fn operands(&self, ptrs: &[u64]) -> (u64, WeightFormat) {
        match *self {
            DevFormat::Bf16 => (ptrs[0], WeightFormat::Bf16),
            DevFormat::Affine {
                bits,
                group,
                params,
            } => (
                ptrs[0],
                WeightFormat::Affine {
                    bits,
                    group,
                    scales: ptrs[1],
                    biases: ptrs[2],
                    params,
                },
            ),
            DevFormat::Fp8 { group } => (
                ptrs[0],
                WeightFormat::Fp8 {
                    group,
                    scales: ptrs[1],
                },
            ),
        }
    }

    /// The far-stack operands (pinned host arrays at `ptrs`) for ids from `split` on.
    pub fn far(&self, ptrs: &[u64], split: usize) -> Far {
        let (w, f) = self.operands(ptrs);
        let (scales, biases) = match f {
            WeightFormat::Affine { scales, biases, .. } => (scales, biases),
            WeightFormat::Fp8 { scales, .. } => (scales, 0),
            WeightFormat::Bf16 => (0, 0),
        };
        Far {
            w,
            scales,
            biases,
            split,
        }
    }
}

/// The format of one `[n, k]` matrix of a stack.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Fmt {
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) format: DevFormat,
}

impl Fmt {
    pub(crate) fn new(n: usize, k: usize, format: DevFormat) -> Fmt {
        Fmt { n, k, format }
    }

    /// Bytes of one matrix in each array.
    pub(crate) fn array_bytes(&self) -> Vec<usize> {
        self.format.array_bytes(self.n, self.k)
    }

    pub(crate) fn matrix_bytes(&self) -> usize {
        self.array_bytes().iter().sum()
    }

    /// A zeroed device stack of `count` matrices.
    pub(crate) fn device_stack(&self, g: &Gpu, count: usize) -> Result<DevMat> {
        self.format.prepare(g)?;
        let arrays = self.array_bytes().into_iter();
        let arrays = arrays.map(|b| g.zeros(count * b)).collect::<Result<_>>()?;
        Ok(DevMat {
            w: DevWeights {
                format: self.format,
                arrays,
            },
            n: self.n,
            k: self.k,
            bias: None,
        })
    }
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
        DevMat::upload(g, DevFormat::of(parts), parts, (n, k), bias)
    }

    /// An embedding table `[n, k]` in [`DevFormat::lookup`]'s format.
    pub(crate) fn table(g: &Gpu, w: &LinearWeight, n: usize, k: usize) -> Result<DevMat> {
        DevMat::upload(g, DevFormat::lookup(w), &[w], (n, k), None)
    }

    fn upload(
        g: &Gpu,
        format: DevFormat,
        parts: &[&LinearWeight],
        (n, k): (usize, usize),
        bias: Option<DevBuf<f32>>,
    ) -> Result<DevMat> {
        format.prepare(g)?;
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

    pub(crate) fn fmt(&self) -> Fmt {
        Fmt::new(self.n, self.k, self.w.format)
    }

    /// A stack of no matrices in this one's format.
    pub(crate) fn empty(&self, g: &Gpu) -> Result<DevMat> {
        self.fmt().device_stack(g, 0)
    }

    /// (base address, bytes per matrix) of each array of the stack.
    pub(crate) fn pieces(&self) -> Vec<(u64, usize)> {
        let ptrs = self.w.arrays.iter().map(|a| a.ptr());
        ptrs.zip(self.fmt().array_bytes()).collect()
    }
}

/// The parameter form that holds an affine weight's scales and biases exactly: f16 scales and
/// zero points (GPTQ/AWQ), bf16 (MLX's bf16 parameters), else f32 (GGUF's, or f16/f32 ones).
fn params_of(w: &deltamoe_compute::AffineWeight) -> AffineParams {
    use deltamoe_compute::DType;
    match w.has_zero_points() {
        true => AffineParams::F16Zero,
        false if w.scales().dtype() == DType::BF16 && w.biases().dtype() == DType::BF16 => {
            AffineParams::Bf16
        }
        false => AffineParams::F32,
    }
}

/// The bytes of `w`'s scales and biases in `params` form (one its values fit exactly), each
/// value `repeat` times (a stack of a smaller group).
fn param_bytes(
    w: &deltamoe_compute::AffineWeight,
    params: AffineParams,
    repeat: usize,
) -> (Vec<u8>, Vec<u8>) {
    let (s, b): (Vec<u16>, Vec<u16>) = match params {
        AffineParams::Bf16 => (bf16_bits(w.scales()), bf16_bits(w.biases())),
        AffineParams::F16Zero => f16_scales_zeros(w),
        AffineParams::F32 => {
            let f = |t: &deltamoe_compute::Tensor| concat(std::iter::once(t.to_f32_vec()));
            return (
                repeated(&f(w.scales()), 4, repeat),
                repeated(&f(w.biases()), 4, repeat),
            );
        }
    };
    let (s, b) = (concat(std::iter::once(s)), concat(std::iter::once(b)));
    (repeated(&s, 2, repeat), repeated(&b, 2, repeat))
}

/// Each `size`-byte value of `bytes` `repeat` times.
fn repeated(bytes: &[u8], size: usize, repeat: usize) -> Vec<u8> {
    match repeat {
        1 => bytes.to_vec(),
        _ => bytes
            .chunks_exact(size)
            .flat_map(|v| std::iter::repeat_n(v, repeat).flatten().copied())
            .collect(),
    }
}

/// bf16 bits of a tensor (rounded from f16/f32; quantized weights dequantized).
pub(crate) fn bf16_bits<W: DenseSource + ?Sized>(w: &W) -> Vec<u16> {
    let t = w.dense();
    match t.data() {
        TensorData::BF16(s) => s.iter().map(|v| v.to_bits()).collect(),
        TensorData::F16(s) => s.iter().map(|v| f32_to_bf16(v.to_f32())).collect(),
        TensorData::F32(s) => s.iter().map(|&v| f32_to_bf16(v)).collect(),
    }
}

/// The packed words of `w` with its codes at `bits` (its own, or wider: the same values).
fn words_at(w: &deltamoe_compute::AffineWeight, bits: u32) -> std::borrow::Cow<'_, [u32]> {
    if w.bits() == bits {
        return w.words();
    }
    let (k, wpr) = (w.in_features(), w.in_features() * bits as usize / 32);
    let mut out = vec![0u32; w.out_features() * wpr];
    let rows = out.par_chunks_exact_mut(wpr.max(1)).enumerate();
    rows.for_each_init(
        || (vec![0.0f32; k], vec![0u8; k], Vec::new()),
        |(codes, q, scratch), (r, row)| {
            unpack_row(w.row_words(r, scratch), w.bits(), codes);
            q.iter_mut()
                .zip(codes.iter())
                .for_each(|(q, &c)| *q = c as u8);
            pack_row(q, bits, row);
        },
    );
    std::borrow::Cow::Owned(out)
}

/// The f16 bits of a zero-point weight's scales `s` and zero points `z = −bias/s` (both exact:
/// the loader made the scales from f16 values and the biases as `−z·s`).
pub(crate) fn f16_scales_zeros(w: &deltamoe_compute::AffineWeight) -> (Vec<u16>, Vec<u16>) {
    let (s, b) = (w.scales().to_f32_vec(), w.biases().to_f32_vec());
    let f16 = |v: f32| half::f16::from_f32(v).to_bits();
    s.par_iter()
        .zip(&b)
        .map(|(&s, &b)| {
            (
                f16(s),
                f16(deltamoe_compute::AffineWeight::zero_point(s, b)),
            )
        })
        .unzip()
}

/// The scales of an FP8 matrix as the device holds them: each row's block-row of the grid,
/// `[out, ⌈in/bk⌉]` f32.
fn row_scales(w: &deltamoe_compute::Fp8Weight) -> Vec<f32> {
    (0..w.out_features())
        .flat_map(|r| w.row_scales(r).iter().copied())
        .collect()
}

/// The bytes of `parts` one after another.
fn concat<T: bytemuck::Pod, P: AsRef<[T]>>(parts: impl Iterator<Item = P>) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(bytemuck::cast_slice(p.as_ref()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{AffineParams, DevFormat};

    #[test]
    fn array_bytes_per_matrix() {
        assert_eq!(DevFormat::Bf16.array_bytes(4, 64), vec![512]);
        let a4 = DevFormat::Affine {
            bits: 4,
            group: 64,
            params: AffineParams::Bf16,
        };
        assert_eq!(a4.array_bytes(4, 128), vec![256, 16, 16]);
        let a8 = DevFormat::Affine {
            bits: 8,
            group: 32,
            params: AffineParams::F16Zero,
        };
        assert_eq!(a8.array_bytes(2, 64), vec![128, 8, 8]);
    }

    /// Groups of 16 go up as they are for codes held at 4 and 8 bits (3-, 5- and 6-bit ones
    /// widened to 8); 2-bit ones are held as bf16.
    #[test]
    fn groups_of_16_stay_affine_at_4_and_8_bits() {
        use super::gpu_group;
        assert!(gpu_group(4, 16) && gpu_group(8, 16) && gpu_group(8, 32) && gpu_group(4, 128));
        assert!(gpu_group(6, 16) && gpu_group(3, 16) && gpu_group(5, 16));
        assert!(!gpu_group(2, 16) && !gpu_group(4, 8) && !gpu_group(6, 8));
    }

    #[test]
    fn operands_name_each_array() {
        let (w, f) = DevFormat::Bf16.operands(&[7]);
        assert_eq!(w, 7);
        assert!(matches!(f, deltamoe_compute::cuda::ops::WeightFormat::Bf16));
        let a = DevFormat::Affine {
            bits: 4,
            group: 64,
            params: AffineParams::Bf16,
        };
        let far = a.far(&[1, 2, 3], 9);
        assert_eq!((far.w, far.scales, far.biases, far.split), (1, 2, 3, 9));
    }

    /// 3-, 5- and 6-bit codes go up as 8-bit codes of the same values, in their groups; f32
    /// parameters as f32.
    #[test]
    fn odd_bits_widen_to_eight() {
        use crate::checkpoint::LinearWeight;
        use deltamoe_compute::quant::{pack_row, unpack_row};
        use deltamoe_compute::{AffineWeight, PackedWords, Tensor};
        let (n, k) = (3, 64);
        for (bits, group) in [(3, 32), (5, 64), (6, 32), (6, 16)] {
            let q: Vec<u8> = (0..n * k).map(|i| (i * 7 % (1 << bits)) as u8).collect();
            let mut words = vec![0u32; n * k * bits as usize / 32];
            let wpr = k * bits as usize / 32;
            for (row, qs) in words.chunks_exact_mut(wpr).zip(q.chunks_exact(k)) {
                pack_row(qs, bits, row);
            }
            let p = || Tensor::from_f32(vec![n, k / group], vec![0.5; n * k / group]);
            let w = AffineWeight::new(bits, group, n, k, PackedWords::from_vec(words), p(), p());
            let lw = LinearWeight::from(w.unwrap());
            let f = DevFormat::of(&[&lw]);
            let table = DevFormat::Affine {
                bits: 8,
                group,
                params: AffineParams::F32,
            };
            assert_eq!(DevFormat::lookup(&lw), table);
            assert_eq!(f, table);
            let bytes = &f.arrays(&[&lw])[0];
            let wide: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let mut got = vec![0.0f32; n * k];
            for (o, r) in got.chunks_exact_mut(k).zip(wide.chunks_exact(k / 4)) {
                unpack_row(r, 8, o);
            }
            assert!(
                got.iter().zip(&q).all(|(g, &q)| *g == q as f32),
                "{bits} bits"
            );
        }
    }

    /// Parts of other widths, groups and parameter forms stack as the widest codes in the
    /// smallest group with f32 parameters, every value kept: a 4-bit part in groups of 64 with
    /// bf16 parameters beside an 8-bit part in groups of 32 with f16 zero points.
    #[test]
    fn mixed_parts_share_one_exact_form() {
        use crate::checkpoint::LinearWeight;
        use deltamoe_compute::quant::{pack_row, unpack_row};
        use deltamoe_compute::{AffineWeight, DType, PackedWords, Tensor};
        let k = 128;
        let part = |bits: u32, group: usize, n: usize| {
            let q: Vec<u8> = (0..n * k).map(|i| (i * 5 % (1 << bits)) as u8).collect();
            let wpr = k * bits as usize / 32;
            let mut words = vec![0u32; n * wpr];
            for (row, qs) in words.chunks_exact_mut(wpr).zip(q.chunks_exact(k)) {
                pack_row(qs, bits, row);
            }
            let g = n * k / group;
            let s: Vec<f32> = (0..g).map(|i| 0.25 + i as f32 / 64.0).collect();
            (q, words, s, g)
        };
        let (qa, wa, sa, ga) = part(4, 64, 2);
        let t = |v: Vec<f32>, n: usize, g: usize| {
            Tensor::from_half_bits(
                DType::BF16,
                vec![n, g / n],
                v.into_iter()
                    .map(deltamoe_compute::dtype::f32_to_bf16)
                    .collect(),
            )
        };
        let a = AffineWeight::new(
            4,
            64,
            2,
            k,
            PackedWords::from_vec(wa),
            t(sa.clone(), 2, ga),
            t(vec![-0.5; ga], 2, ga),
        );
        let (qb, wb, sb, gb) = part(8, 32, 3);
        let zb: Vec<f32> = sb.iter().map(|s| -128.0 * s).collect();
        let b = AffineWeight::new(
            8,
            32,
            3,
            k,
            PackedWords::from_vec(wb),
            Tensor::from_f32(vec![3, gb / 3], sb.clone()),
            Tensor::from_f32(vec![3, gb / 3], zb.clone()),
        );
        let (a, b) = (
            LinearWeight::from(a.unwrap()),
            LinearWeight::from(b.unwrap().with_zero_points()),
        );
        let f = DevFormat::of(&[&a, &b]);
        let want = DevFormat::Affine {
            bits: 8,
            group: 32,
            params: AffineParams::F32,
        };
        assert_eq!(f, want);
        assert_eq!(
            f.array_bytes(5, k),
            vec![5 * k, 4 * 5 * k / 32, 4 * 5 * k / 32]
        );
        let arrays = f.arrays(&[&a, &b]);
        let f32s = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let (s, bias) = (f32s(&arrays[1]), f32s(&arrays[2]));
        // Part a's groups of 64 each become two groups of 32 with its parameters.
        let want_s: Vec<f32> = sa.iter().flat_map(|&v| [v, v]).chain(sb).collect();
        let want_b: Vec<f32> = std::iter::repeat_n(-0.5, 2 * ga).chain(zb).collect();
        assert_eq!(s, want_s);
        assert_eq!(bias, want_b);
        let words: Vec<u32> = arrays[0]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let mut got = vec![0.0f32; 5 * k];
        for (o, r) in got.chunks_exact_mut(k).zip(words.chunks_exact(k / 4)) {
            unpack_row(r, 8, o);
        }
        let want_q: Vec<f32> = qa.iter().chain(&qb).map(|&q| q as f32).collect();
        assert_eq!(got, want_q);
    }
}
