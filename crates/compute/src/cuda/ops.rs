//! Launch wrappers, one per kernel. Arguments are raw device addresses ([`super::DevBuf::ptr`])
//! so that the same calls work eagerly and inside a CUDA-graph capture; 0 stands for an absent
//! optional pointer. Each wrapper states the sizes its kernel reads and writes (see the `.cu`
//! headers for layouts); callers own keeping the buffers that large.

use cudarc::driver::LaunchConfig;

use super::launch::Launch;

pub use super::attention::{attn_decode, attn_prep, AttnDims, ATTN_DMAX, ATTN_MAX_SPLITS};
use super::dispatch::{self, vector_x, Plan, RowsForm, MMA_ROWS_INPUTS, MV_ROWS, MV_VECS};
pub use super::dispatch::{
    affine_kernel, affine_rows_per_warp, swiglu_warps_per_block, tensor_core_rows, GEMM_MIN_ROWS,
};
pub use super::gdn::{
    gdn_conv_step, gdn_conv_verify, gdn_restore, gdn_step, gdn_verify, GdnDims, GDN_CONV_KMAX,
    GDN_DK_MAX, GDN_DV_MAX, GDN_VERIFY_MAX,
};
use super::host::far_args;
pub use super::host::Far;
pub use super::moe::{
    down_combine_form, down_combine_takes, host_experts_publish, host_experts_wait, moe_combine,
    moe_combine_norm, moe_down_combine, router_topk, Mailbox, Route,
};
use super::{driver_err, Gpu, Result};

pub(crate) fn cfg(grid: (u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// A launch of a 3-D grid of `block`-thread blocks with `shared` bytes of dynamic shared memory.
pub(crate) fn cfg3(grid: (u32, u32, u32), block: u32, shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared,
    }
}

pub(crate) fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

/// What the two parameter arrays of an affine matrix hold, per group of `group` weights with
/// code q (both arrays `[E, N, K/group]` of [`AffineParams::bytes`] each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AffineParams {
    /// MLX: bf16 scales and bf16 biases, w = q·scale + bias.
    Bf16,
    /// GPTQ/AWQ: f16 scales s and, in the `biases` slot, f16 zero points z (integers below
    /// 2^bits), w = (q − z)·s. The kernels take it as scale s and bias −z·s, exact in f32;
    /// their builds for it are compiled on first use ([`super::Kernels::affine`]).
    F16Zero,
    /// f32 scales and biases, w = q·scale + bias: parameters neither form above holds exactly
    /// (GGUF's K-quants, whose d·sc has up to 17 significant bits). Built on first use too.
    F32,
}

impl AffineParams {
    /// Bytes of one scale (and of one bias).
    pub fn bytes(self) -> usize {
        match self {
            AffineParams::Bf16 | AffineParams::F16Zero => 2,
            AffineParams::F32 => 4,
        }
    }
}

/// How a device matrix is stored.
#[derive(Clone, Copy, Debug)]
pub enum WeightFormat {
    /// bf16 `[E, N, K]`.
    Bf16,
    /// Affine: u32 words `[E, N, K·bits/32]` (codes LSB first), scales and biases
    /// `[E, N, K/group]` as `params` says (MLX's bf16 pair, or f16 scales and zero points).
    Affine {
        bits: u32,
        group: usize,
        scales: u64,
        biases: u64,
        params: AffineParams,
    },
    /// Fine-grained FP8: e4m3 bytes `[E, N, K]` (K % 8 == 0), f32 scales `[E, N, ⌈K/group⌉]`
    /// (each row's copy of its 128 × 128 blocks' scales; group % 8 == 0). Kernels in fp8.cu.
    Fp8 { group: usize, scales: u64 },
}

impl WeightFormat {
    /// Whether these are 8-bit affine codes in groups of 16 with f32 parameters (GGUF's Q6_K):
    /// the weights the tensor-core forms take through their `_g16` entries.
    pub fn group16(&self) -> bool {
        matches!(
            self,
            WeightFormat::Affine {
                bits: 8,
                group: 16,
                params: AffineParams::F32,
                ..
            }
        )
    }

    /// A quantized format's kernel arguments as the affine and FP8 kernels take them: scales and
    /// biases (device addresses), group and bits (FP8: no biases, 0, and bits 8); None for bf16.
    pub(crate) fn quant_args(&self) -> Option<(u64, u64, i32, i32)> {
        match *self {
            WeightFormat::Affine {
                bits,
                group,
                scales,
                biases,
                ..
            } => Some((scales, biases, group as i32, bits as i32)),
            WeightFormat::Fp8 { group, scales } => Some((scales, 0, group as i32, 8)),
            WeightFormat::Bf16 => None,
        }
    }
}

/// Pushes the leading arguments of the row and grouped product kernels, in their order: W,
/// (quantized: scales, biases,) the `io` addresses, N and K, (quantized: group, bits).
pub(crate) fn matrix_args<'a>(
    b: &mut Launch<'a>,
    w: &'a u64,
    affine: &'a Option<(u64, u64, i32, i32)>,
    io: &'a [u64],
    nk: &'a [i32; 2],
) {
    b.arg(w);
    if let Some((scales, biases, _, _)) = affine {
        b.arg(scales).arg(biases);
    }
    for a in io {
        b.arg(a);
    }
    b.arg(&nk[0]).arg(&nk[1]);
    if let Some((_, _, group, bits)) = affine {
        b.arg(group).arg(bits);
    }
}

/// Operands of a matrix-vector product: W `[E, N, K]` at `w`; optional f32 bias `[E, N]`
/// (0: none). [`Slots`] says which matrix and input row each output slot uses.
#[derive(Clone, Copy, Debug)]
pub struct Matvec {
    pub w: u64,
    pub n: usize,
    pub k: usize,
    pub bias: u64,
    pub format: WeightFormat,
}

/// The outputs of one matvec launch: slot s (of `n`) multiplies matrix `ids[s]` (device
/// int[n]; matrix 0 when `ids` is 0) by input row `s / x_div` at `x + row·x_stride` floats, and
/// writes output row s.
#[derive(Clone, Copy, Debug)]
pub struct Slots {
    pub n: usize,
    pub ids: u64,
    pub x_stride: usize,
    pub x_div: usize,
    /// A second stack that ids from `far.split` on index into (as `id − split`).
    pub far: Option<Far>,
    /// Room for a wide-form product's partial sums (device address, floats; 0: none).
    pub ws: (u64, usize),
}

impl Slots {
    /// One vector through matrix 0.
    pub fn one() -> Slots {
        Slots::rows(1, 0)
    }

    /// `n` input rows of `x_stride` floats, each through matrix 0.
    pub fn rows(n: usize, x_stride: usize) -> Slots {
        Slots {
            n,
            ids: 0,
            x_stride,
            x_div: 1,
            far: None,
            ws: (0, 0),
        }
    }

    /// `n` slots picking their matrices by `ids`; groups of `x_div` consecutive slots share an
    /// input row (x_stride 0: all share one).
    pub fn experts(n: usize, ids: u64, x_stride: usize, x_div: usize) -> Slots {
        Slots {
            n,
            ids,
            x_stride,
            x_div: x_div.max(1),
            far: None,
            ws: (0, 0),
        }
    }

    /// These slots with `floats` floats at `ptr` for the partial sums of the wide form.
    pub fn with_ws(self, ptr: u64, floats: usize) -> Slots {
        Slots {
            ws: (ptr, floats),
            ..self
        }
    }

    /// These slots with ids from `far.split` on reading the far stack.
    pub fn with_far(self, far: Option<Far>) -> Slots {
        Slots { far, ..self }
    }
}

/// Rows of a batched decode step: row b belongs to the sequence whose state is in slot
/// `slots[b]` (device int[rows]).
#[derive(Clone, Copy, Debug)]
pub struct Batch {
    pub rows: usize,
    pub slots: u64,
}

/// The matvec kernels read x as float4s (bf16 rows only when K is a multiple of 8).
fn check_stride(m: &Matvec, x_stride: usize) -> Result<()> {
    if vector_x(m) && !x_stride.is_multiple_of(4) {
        return Err(super::CudaError::Unsupported(format!(
            "matvec input stride {x_stride} is not a multiple of 4"
        )));
    }
    Ok(())
}

/// A batch of rows through one matrix on `kernel` in `form` (see [`dispatch::plan`]):
/// `y[b] = W x_b (+ bias)`, or `h[b] = silu(G x_b) ⊙ U x_b` when `swiglu`.
fn matvec_rows(
    g: &Gpu,
    m: Matvec,
    (x, y): (u64, u64),
    sl: Slots,
    plan: (&str, RowsForm),
    swiglu: bool,
) -> Result<()> {
    let (name, form) = plan;
    let out_rows = if swiglu { m.n / 2 } else { m.n };
    let (nk, b32, xs) = (
        [out_rows as i32, m.k as i32],
        sl.n as i32,
        sl.x_stride as i64,
    );
    let grid = match form {
        RowsForm::Wide => return super::wide::matvec(g, m, (x, y), sl, name, swiglu),
        RowsForm::Gemm => (blocks(sl.n, MMA_ROWS_INPUTS), blocks(out_rows, 128)),
        RowsForm::SplitK => (blocks(sl.n, MMA_ROWS_INPUTS), blocks(out_rows, 16)),
        RowsForm::Cores => {
            let per_warp = if swiglu { MV_ROWS / 2 } else { MV_ROWS };
            (blocks(sl.n, MV_VECS), blocks(out_rows, 8 * per_warp))
        }
    };
    let (affine, io) = (m.format.quant_args(), [x, y]);
    let mut b = g.launch_builder(g.kernels().for_format(name, &m.format)?);
    matrix_args(&mut b, &m.w, &affine, &io, &nk);
    b.arg(&b32).arg(&xs);
    if !swiglu {
        b.arg(&m.bias);
    }
    // SAFETY: W holds N·K weights of its format (N = 2I for SwiGLU), x holds n rows of
    // x_stride ≥ K floats (16-byte aligned: x_stride % 4 == 0, checked), y holds n·N floats (n·I
    // for SwiGLU); rows and batch rows are bounds-checked in the kernel.
    unsafe { b.launch(cfg(grid, 256, 0)) }.map_err(driver_err(name))?;
    Ok(())
}

/// `y[s, :N] = W_e · x_s (+ bias_e)` for every slot of `sl`.
pub fn matvec(g: &Gpu, m: Matvec, x: u64, y: u64, sl: Slots) -> Result<()> {
    check_stride(&m, sl.x_stride)?;
    let (name, rpw) = match dispatch::plan(&m, &sl, false) {
        Plan::OneRow | Plan::VecRows => {
            let io = super::vec::VecIo::default();
            return super::vec::matvec_rows(g, m, (x, y), sl.n, sl.x_stride, io);
        }
        Plan::Rows { kernel, form } => return matvec_rows(g, m, (x, y), sl, (kernel, form), false),
        Plan::Slots {
            kernel,
            rows_per_warp,
            ..
        } => (kernel, rows_per_warp),
    };
    let (n32, k32, xs, xd) = (m.n as i32, m.k as i32, sl.x_stride as i64, sl.x_div as i32);
    let (slots, ids) = (sl.n, sl.ids);
    let (fw, fs, fb, split) = far_args(&sl);
    let grid = (slots as u32, blocks(m.n, 8 * rpw));
    match m.format {
        WeightFormat::Bf16 => {
            let mut b = g.launch_builder(g.kernels().get(name));
            b.arg(&m.w)
                .arg(&x)
                .arg(&y)
                .arg(&n32)
                .arg(&k32)
                .arg(&ids)
                .arg(&xs)
                .arg(&xd)
                .arg(&m.bias)
                .arg(&fw)
                .arg(&split);
            // SAFETY: W holds split·N·K bf16 (all ids < split without a far stack) and the far
            // stack (max id − split + 1)·N·K, x holds (slots / x_div)·x_stride + K floats, y
            // holds slots·N floats; rows are bounds-checked against N.
            unsafe { b.launch(cfg(grid, 256, 0)) }.map_err(driver_err(name))?;
        }
        WeightFormat::Affine {
            group,
            scales,
            biases,
            params,
            ..
        } => {
            let g32 = group as i32;
            let mut b = g.launch_builder(g.kernels().affine(name, params)?);
            b.arg(&m.w)
                .arg(&scales)
                .arg(&biases)
                .arg(&x)
                .arg(&y)
                .arg(&n32)
                .arg(&k32)
                .arg(&g32);
            b.arg(&ids).arg(&xs).arg(&xd).arg(&m.bias);
            b.arg(&fw).arg(&fs).arg(&fb).arg(&split);
            // SAFETY: as the bf16 case with words (max id + 1)·N·K·bits/32 u32 and scales,
            // biases (max id + 1)·N·K/group bf16; bits ∈ {2, 4, 8} and group | K (checked at
            // upload).
            unsafe { b.launch(cfg(grid, 256, 0)) }.map_err(driver_err(name))?;
        }
        WeightFormat::Fp8 { group, scales } => {
            let g32 = group as i32;
            let mut b = g.launch_builder(g.kernels().get(name));
            b.arg(&m.w).arg(&scales).arg(&0u64).arg(&x).arg(&y);
            b.arg(&n32).arg(&k32).arg(&g32);
            b.arg(&ids).arg(&xs).arg(&xd).arg(&m.bias);
            b.arg(&fw).arg(&fs).arg(&fb).arg(&split);
            // SAFETY: as the bf16 case with codes (max id + 1)·N·K bytes (K % 8 == 0) and
            // scales (max id + 1)·N·⌈K/group⌉ f32 (checked at upload); one warp a row.
            unsafe { b.launch(cfg(grid, 256, 0)) }.map_err(driver_err(name))?;
        }
    }
    Ok(())
}

/// `h[s, :I] = silu(G_e x_s) ⊙ (U_e x_s)` where W_e = `[gate (I rows) | up (I rows)]`, so
/// `m.n = 2I`, for every slot of `sl`. No bias.
pub fn matvec_swiglu(g: &Gpu, m: Matvec, x: u64, h: u64, sl: Slots) -> Result<()> {
    check_stride(&m, sl.x_stride)?;
    let (name, rpw, wpb) = match dispatch::plan(&m, &sl, true) {
        Plan::Rows { kernel, form } => return matvec_rows(g, m, (x, h), sl, (kernel, form), true),
        Plan::Slots {
            kernel,
            rows_per_warp,
            warps,
        } => (kernel, rows_per_warp, warps),
        Plan::OneRow | Plan::VecRows => {
            return Err(super::CudaError::Unsupported(
                "no single-row SwiGLU kernel".into(),
            ))
        }
    };
    let i = m.n / 2;
    let (i32_, k32, xs, xd) = (i as i32, m.k as i32, sl.x_stride as i64, sl.x_div as i32);
    let (slots, ids) = (sl.n, sl.ids);
    let (fw, fs, fb, split) = far_args(&sl);
    match m.format {
        WeightFormat::Bf16 => {
            let grid = (slots as u32, blocks(i, 8));
            let mut b = g.launch_builder(g.kernels().get(name));
            b.arg(&m.w)
                .arg(&x)
                .arg(&h)
                .arg(&i32_)
                .arg(&k32)
                .arg(&ids)
                .arg(&xs)
                .arg(&xd)
                .arg(&fw)
                .arg(&split);
            // SAFETY: as `matvec` with 2I rows per expert and h of slots·I floats.
            unsafe { b.launch(cfg(grid, 256, 0)) }.map_err(driver_err(name))?;
        }
        WeightFormat::Affine {
            group,
            scales,
            biases,
            params,
            ..
        } => {
            let g32 = group as i32;
            let grid = (slots as u32, blocks(i, wpb as usize * rpw / 2));
            let mut b = g.launch_builder(g.kernels().affine(name, params)?);
            b.arg(&m.w)
                .arg(&scales)
                .arg(&biases)
                .arg(&x)
                .arg(&h)
                .arg(&i32_)
                .arg(&k32)
                .arg(&g32);
            b.arg(&ids).arg(&xs).arg(&xd);
            b.arg(&fw).arg(&fs).arg(&fb).arg(&split);
            // SAFETY: as `matvec`'s affine case with 2I rows per expert; the block size is the
            // one the entry's launch bounds name (qmatvec.cu, QMV_SWIGLU_R2_THREADS).
            unsafe { b.launch(cfg(grid, 32 * wpb, 0)) }.map_err(driver_err(name))?;
        }
        WeightFormat::Fp8 { group, scales } => {
            let g32 = group as i32;
            let grid = (slots as u32, blocks(i, 8));
            let mut b = g.launch_builder(g.kernels().get(name));
            b.arg(&m.w).arg(&scales).arg(&0u64).arg(&x).arg(&h);
            b.arg(&i32_).arg(&k32).arg(&g32);
            b.arg(&ids).arg(&xs).arg(&xd);
            b.arg(&fw).arg(&fs).arg(&fb).arg(&split);
            // SAFETY: as `matvec`'s FP8 case with 2I rows per expert and h of slots·I floats.
            unsafe { b.launch(cfg(grid, 256, 0)) }.map_err(driver_err(name))?;
        }
    }
    Ok(())
}

/// Threads of the kernels that compute an RMSNorm of a residual row (add_rmsnorm,
/// moe_combine_norm): one order of the sum of squares, so equal values whichever computes it.
pub const NORM_THREADS: u32 = 1024;

/// Per row of width `h` (`rows` rows): x += delta (when delta ≠ 0), out = rmsnorm(x)·scale.
#[allow(clippy::too_many_arguments)]
pub fn add_rmsnorm(
    g: &Gpu,
    x: u64,
    delta: u64,
    scale: u64,
    out: u64,
    rows: usize,
    h: usize,
    eps: f32,
) -> Result<()> {
    let h32 = h as i32;
    let mut b = g.launch_builder(g.kernels().get("add_rmsnorm"));
    b.arg(&x)
        .arg(&delta)
        .arg(&scale)
        .arg(&out)
        .arg(&h32)
        .arg(&eps);
    // SAFETY: x, delta, out hold rows·h floats, scale h floats.
    unsafe { b.launch(cfg((rows as u32, 1), NORM_THREADS, 0)) }
        .map_err(driver_err("add_rmsnorm"))?;
    Ok(())
}

/// `x[b] = table[tok[b]]` (bf16 → f32) for width `h`, `rows` rows.
pub fn embed_bf16(g: &Gpu, table: u64, tok: u64, x: u64, h: usize, rows: usize) -> Result<()> {
    let h32 = h as i32;
    let mut b = g.launch_builder(g.kernels().get("embed_bf16"));
    b.arg(&table).arg(&tok).arg(&x).arg(&h32);
    // SAFETY: tok[b] < vocab (checked by the engine before it is written), x holds rows·h
    // floats.
    unsafe { b.launch(cfg((blocks(h, 256), rows as u32), 256, 0)) }
        .map_err(driver_err("embed_bf16"))?;
    Ok(())
}

/// `x[b] = table[tok[b]]` as f32 (bf16 rows converted, affine rows dequantized), width `h`,
/// `rows` rows.
pub fn embed(g: &Gpu, m: Matvec, tok: u64, x: u64, h: usize, rows: usize) -> Result<()> {
    let (bits, group, scales, biases, params) = match m.format {
        WeightFormat::Affine {
            bits,
            group,
            scales,
            biases,
            params,
        } => (bits, group, scales, biases, params),
        WeightFormat::Bf16 => return embed_bf16(g, m.w, tok, x, h, rows),
        WeightFormat::Fp8 { .. } => {
            return Err(super::CudaError::Unsupported(
                "an FP8 embedding (upload it as bf16)".into(),
            ))
        }
    };
    let (h32, g32, b32) = (h as i32, group as i32, bits as i32);
    let mut b = g.launch_builder(g.kernels().affine("embed_affine", params)?);
    b.arg(&m.w)
        .arg(&scales)
        .arg(&biases)
        .arg(&tok)
        .arg(&x)
        .arg(&h32)
        .arg(&g32)
        .arg(&b32);
    // SAFETY: tok[b] < vocab (checked by the engine before it is written); the table holds
    // vocab rows of h values; x holds rows·h floats.
    unsafe { b.launch(cfg((blocks(h, 256), rows as u32), 256, 0)) }
        .map_err(driver_err("embed_affine"))?;
    Ok(())
}

/// Fill `n` u32 words at `out` with random bits (synthetic packed weights).
pub fn fill_random_u32(g: &Gpu, out: u64, n: usize, seed: u64) -> Result<()> {
    fill_words(g, "fill_random_u32", out, n, seed)
}

/// Fill `n` u32 words at `out` with random e4m3 codes, four a word, never NaN (fill.cu).
pub fn fill_random_fp8(g: &Gpu, out: u64, n: usize, seed: u64) -> Result<()> {
    fill_words(g, "fill_random_fp8", out, n, seed)
}

/// Launch the fill.cu kernel `name` that writes `n` random u32 words at `out`.
fn fill_words(g: &Gpu, name: &str, out: u64, n: usize, seed: u64) -> Result<()> {
    let n64 = n as i64;
    let mut b = g.launch_builder(g.kernels().get(name));
    b.arg(&out).arg(&n64).arg(&seed);
    // SAFETY: out holds n u32; grid-stride loop bounded by n.
    unsafe { b.launch(cfg((blocks(n, 256).clamp(1, 65_535), 1), 256, 0)) }
        .map_err(driver_err(name))?;
    Ok(())
}

/// Fill `n` elements of `dtype` at `out` with uniform values in [lo, hi).
pub fn fill_uniform(
    g: &Gpu,
    out: u64,
    n: usize,
    dtype: crate::DType,
    seed: u64,
    lo: f32,
    hi: f32,
) -> Result<()> {
    let n64 = n as i64;
    let name = match dtype {
        crate::DType::BF16 => "fill_uniform_bf16",
        crate::DType::F16 => "fill_uniform_f16",
        crate::DType::F32 => "fill_uniform_f32",
    };
    let mut b = g.launch_builder(g.kernels().get(name));
    b.arg(&out).arg(&n64).arg(&seed).arg(&lo).arg(&hi);
    // SAFETY: out holds n elements of the named type; grid-stride loop bounded by n.
    unsafe { b.launch(cfg((blocks(n, 256).clamp(1, 65_535), 1), 256, 0)) }
        .map_err(driver_err(name))?;
    Ok(())
}

/// Device sampling parameters as `sample_advance` reads them ([`SampleParams::WORDS`] u32, see
/// sample.cu).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SampleParams {
    /// ≤ 0: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// 1: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    pub seed: u64,
}

impl SampleParams {
    /// The device words, with the draw counter at `step`.
    /// Words a slot's parameters take (`SAMPLE_WORDS` in sample.cu).
    pub const WORDS: usize = 7;

    pub fn words(&self, step: u32) -> [u32; Self::WORDS] {
        [
            self.temperature.to_bits(),
            self.top_k,
            self.top_p.to_bits(),
            self.min_p.to_bits(),
            self.seed as u32,
            (self.seed >> 32) as u32,
            step,
        ]
    }
}

/// Per row b of `bt` (slot s): `tok[b]` = a token drawn from `logits[b, ..v]` with the
/// parameters at `params + WORDS·s` (see [`SampleParams::words`]; greedy when the temperature is
/// ≤ 0), `pos[s] += 1`. `best` (one row only): the device address and count of the pairs the
/// lm_head wrote ([`super::vec::VecIo::best`]), from which the logits' max and its index come.
#[allow(clippy::too_many_arguments)]
pub fn sample_advance(
    g: &Gpu,
    logits: u64,
    v: usize,
    params: u64,
    tok: u64,
    pos: u64,
    bt: Batch,
    best: Option<(u64, usize)>,
    advance: bool,
) -> Result<()> {
    if best.is_some() && bt.rows != 1 {
        return Err(super::CudaError::Unsupported(format!(
            "the lm_head's best pairs serve one row, not {}",
            bt.rows
        )));
    }
    let v32 = v as i32;
    let (best, nbest) = best.map_or((0, 0), |(p, n)| (p, n as i32));
    let advance = advance as i32;
    let mut b = g.launch_builder(g.kernels().get("sample_advance"));
    b.arg(&logits)
        .arg(&v32)
        .arg(&params)
        .arg(&tok)
        .arg(&pos)
        .arg(&bt.slots)
        .arg(&best)
        .arg(&nbest)
        .arg(&advance);
    // SAFETY: logits hold rows·v floats, params (max slot + 1)·WORDS u32, pos (max slot + 1) ints,
    // tok and slots rows ints; best, when given, 2·nbest floats (one row, checked above).
    unsafe { b.launch(cfg((bt.rows as u32, 1), 1024, 0)) }.map_err(driver_err("sample_advance"))?;
    Ok(())
}
