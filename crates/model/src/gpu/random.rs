//! Random weights made directly in device (or pinned host) memory from seeds: bf16, MLX
//! affine-quantized or FP8 matrices and f32 vectors, for synthetic models of real shapes.

use std::ops::Range;

use deltamoe_compute::cuda::ops::{self, AffineParams};
use deltamoe_compute::cuda::{DevBuf, Gpu, Result};
use deltamoe_compute::DType;

use super::format::{DevFormat, DevMat, Fmt};
use super::host_store::{seed_at, Dest, ExpertSource, Held};
use crate::convert::ROUTER_SPEC;

/// Fills buffers with seeded uniform values, a new seed per buffer. Matrices are in `format`
/// (bf16, affine or FP8), but for what quantized checkpoints keep apart ([`Self::router`],
/// [`Self::lm_head`]).
pub(crate) struct Filler<'a> {
    pub g: &'a Gpu,
    seed: u64,
    format: DevFormat,
}

impl<'a> Filler<'a> {
    /// Values from `seed` on; matrices in `format`.
    pub fn new(g: &'a Gpu, seed: u64, format: DevFormat) -> Filler<'a> {
        Filler { g, seed, format }
    }

    fn next_seed(&mut self) -> u64 {
        self.seed = self
            .seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.seed
    }

    /// `count` stacked `[n, k]` matrices with values of magnitude about 1/sqrt(k), in the
    /// model's format for matrices other than routed experts ([`Self::mats_as`]): bf16 in a
    /// GPTQ model, whose checkpoints (Qwen's GPTQ-Int4) quantize only the routed experts.
    pub fn mats(&mut self, count: usize, n: usize, k: usize) -> Result<DevMat> {
        self.mats_as(self.dense_format(), count, n, k)
    }

    fn dense_format(&self) -> DevFormat {
        match self.format {
            DevFormat::Affine {
                params: AffineParams::F16Zero,
                ..
            } => DevFormat::Bf16,
            f => f,
        }
    }

    /// Whether a shared expert ([`Self::mats`]) is stored like the routed ones
    /// ([`Self::expert_mats_of`]), so that it may be stacked with them.
    pub fn shared_like_routed(&self) -> bool {
        self.dense_format() == self.format
    }

    /// Routed experts' `[n, k]` matrices in the model's format: those of `parts` (ranges of
    /// indices) of a stack of them made here, one after another (`[0..count]`: the whole stack;
    /// one GPU of several holds its share).
    pub fn expert_mats_of(&mut self, parts: &[Range<usize>], n: usize, k: usize) -> Result<DevMat> {
        let seeded = self.seeded_as(self.format, n, k);
        let stack = seeded
            .fmt
            .device_stack(self.g, parts.iter().map(Range::len).sum())?;
        let mut at = 0;
        for r in parts.iter().filter(|r| !r.is_empty()) {
            let to = Dest {
                arrays: &stack.pieces(),
                at,
            };
            seeded.write(self.g, r.clone(), to)?;
            at += r.len();
        }
        Ok(stack)
    }

    /// As [`Self::mats`], in `format`: the matrices [`Seeded::write`] fills with the seeds they
    /// are given here.
    pub fn mats_as(
        &mut self,
        format: DevFormat,
        count: usize,
        n: usize,
        k: usize,
    ) -> Result<DevMat> {
        let seeded = self.seeded_as(format, n, k);
        let stack = seeded.fmt.device_stack(self.g, count)?;
        seeded.write(
            self.g,
            0..count,
            Dest {
                arrays: &stack.pieces(),
                at: 0,
            },
        )?;
        Ok(stack)
    }

    /// An MoE router (its experts' rows and the shared-expert gate's) as `deltamoe convert` and
    /// mlx-lm store it in an MLX affine model, at [`ROUTER_SPEC`] (8 bits, group 64), and FP8
    /// and GPTQ checkpoints in bf16.
    pub fn router(&mut self, n: usize, k: usize) -> Result<DevMat> {
        let format = match self.format {
            DevFormat::Affine {
                params: AffineParams::Bf16,
                ..
            } => DevFormat::Affine {
                bits: ROUTER_SPEC.bits,
                group: ROUTER_SPEC.group_size,
                params: AffineParams::Bf16,
            },
            _ => DevFormat::Bf16,
        };
        self.mats_as(format, 1, n, k)
    }

    /// The lm_head: in the model's format, but bf16 for FP8 and GPTQ models (Qwen's FP8 and
    /// GPTQ checkpoints leave it unquantized).
    pub fn lm_head(&mut self, n: usize, k: usize) -> Result<DevMat> {
        let format = match self.format {
            DevFormat::Fp8 { .. }
            | DevFormat::Affine {
                params: AffineParams::F16Zero,
                ..
            } => DevFormat::Bf16,
            f => f,
        };
        self.mats_as(format, 1, n, k)
    }

    /// The seeds [`Self::mats`] would fill `[n, k]` matrices with, for matrices written later
    /// wherever they are placed ([`SeededExperts`]): the same values as a stack made here.
    fn seeded(&mut self, n: usize, k: usize) -> Seeded {
        self.seeded_as(self.format, n, k)
    }

    fn seeded_as(&mut self, format: DevFormat, n: usize, k: usize) -> Seeded {
        let seeds = [self.next_seed(), self.next_seed(), self.next_seed()];
        Seeded {
            fmt: Fmt::new(n, k, format),
            seeds,
        }
    }

    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Result<DevBuf<f32>> {
        let v: DevBuf<f32> = self.g.zeros(n)?;
        let seed = self.next_seed();
        ops::fill_uniform(self.g, v.ptr(), n, DType::F32, seed, lo, hi)?;
        Ok(v)
    }
}

/// The seeds of a stack of random `[n, k]` matrices ([`Filler::seeded`]): values, or affine
/// words, scales and biases.
struct Seeded {
    fmt: Fmt,
    seeds: [u64; 3],
}

impl Seeded {
    /// Fill matrices `mats` of the stack into `to`, with the values [`Filler::mats`] gives them.
    fn write(&self, g: &Gpu, mats: Range<usize>, to: Dest<'_>) -> Result<()> {
        let (first, count, dst, at) = (mats.start, mats.len(), to.arrays, to.at);
        let (n, k) = (self.fmt.n, self.fmt.k);
        let a = 1.0 / (k as f32).sqrt();
        let nk = n * k;
        let (bits, group, params) = match self.fmt.format {
            DevFormat::Bf16 => {
                let (d, bytes) = dst[0];
                let out = d + (at * bytes) as u64;
                let seed = seed_at(self.seeds[0], first * nk);
                return ops::fill_uniform(g, out, count * nk, DType::BF16, seed, -a, a);
            }
            DevFormat::Fp8 { group } => {
                // Codes of exponent ≤ 14 (|code| ≤ 240, no NaN), row scales a/240.
                let at_of = |i: usize| dst[i].0 + (at * dst[i].1) as u64;
                let seed = seed_at(self.seeds[0], 2 * first * nk / 4);
                ops::fill_random_fp8(g, at_of(0), count * nk / 4, seed)?;
                let scales = n * k.div_ceil(group);
                let s1 = seed_at(self.seeds[1], first * scales);
                let (lo, hi) = (0.5 * a / 240.0, 1.5 * a / 240.0);
                return ops::fill_uniform(g, at_of(1), count * scales, DType::F32, s1, lo, hi);
            }
            DevFormat::Affine {
                bits,
                group,
                params,
            } => (bits, group, params),
        };
        let step = 2.0 * a / ((1u32 << bits) - 1) as f32;
        let (words, groups) = (nk * bits as usize / 32, nk / group);
        let at_of = |i: usize| dst[i].0 + (at * dst[i].1) as u64;
        // fill_random_u32 draws two values a word.
        let seed = seed_at(self.seeds[0], 2 * first * words);
        ops::fill_random_u32(g, at_of(0), count * words, seed)?;
        let (s1, s2) = (
            seed_at(self.seeds[1], first * groups),
            seed_at(self.seeds[2], first * groups),
        );
        // MLX: bf16 scales and biases in about [−1.5a, −0.5a]; GPTQ: f16 scales and zero points
        // about the middle code; f32 (GGUF's K-quants) as MLX's.
        let (dtype, zero) = match params {
            AffineParams::Bf16 => (DType::BF16, (-1.5 * a, -0.5 * a)),
            AffineParams::F16Zero => (DType::F16, (7.0, 8.0)),
            AffineParams::F32 => (DType::F32, (-1.5 * a, -0.5 * a)),
        };
        let scale = (0.5 * step, 1.5 * step);
        ops::fill_uniform(g, at_of(1), count * groups, dtype, s1, scale.0, scale.1)?;
        ops::fill_uniform(g, at_of(2), count * groups, dtype, s2, zero.0, zero.1)
    }
}

/// A synthetic MoE layer's experts (`[gate | up]`, down): filled where they are placed. The
/// source numbers the experts `held` from 0 (then the stacked shared expert), with the values
/// they have in the stack of all the layer's experts (the shared one at `held.total`).
pub(crate) struct SeededExperts {
    gu: Seeded,
    down: Seeded,
    held: Held,
}

impl SeededExperts {
    /// The seeds of random experts whose `[gate | up]` and down are `gu` and `down` (n, k), the
    /// `held` ones of the layer's.
    pub fn new(
        f: &mut Filler,
        (gu, down): ((usize, usize), (usize, usize)),
        held: Held,
    ) -> SeededExperts {
        let (gu, down) = (f.seeded(gu.0, gu.1), f.seeded(down.0, down.1));
        SeededExperts { gu, down, held }
    }
}

impl ExpertSource for SeededExperts {
    fn formats(&self) -> (Fmt, Fmt) {
        (self.gu.fmt, self.down.fmt)
    }

    fn write(&self, g: &Gpu, down: bool, experts: Range<usize>, to: Dest<'_>) -> Result<()> {
        let stack = if down { &self.down } else { &self.gu };
        // The routed experts among `experts`, then the shared one, at their indices in the
        // stack of all experts.
        let (n, first, routed) = (self.held.len(), self.held.own.start, self.held.total);
        let (a, b) = (experts.start.min(n), experts.end.min(n));
        let shared = experts.start.max(n)..experts.end.max(n);
        let parts = [
            (first + a..first + b, to.at),
            (
                routed + shared.start - n..routed + shared.end - n,
                to.at + b - a,
            ),
        ];
        for (mats, at) in parts.into_iter().filter(|(m, _)| !m.is_empty()) {
            stack.write(g, mats, Dest { at, ..to })?;
        }
        Ok(())
    }
}
