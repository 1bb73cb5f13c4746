//! Prefill products in bf16 with f32 accumulation: dense projections through cuBLASLt
//! ([`Blas::gemm`]), with their operands put in bf16 by `kernels/gemm.cu` ([`rows_to_bf16`],
//! [`dequant_affine`]); routed experts through the grouped kernel of the same file
//! ([`grouped_gemm`]). CPU twins: `cpu::gemm_twin`.
//!
//! cuBLASLt is loaded at run time like the driver (cudarc, dynamic loading): a machine without it
//! gets an error naming the library from [`Blas::new`], and prefill keeps the exact kernels.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;

use super::ops::{blocks, cfg, Matvec, WeightFormat};
use super::prefill::Grouped;
use super::{driver_err, raise_smem_of, CudaError, DevBuf, Gpu, Result};

/// Pairs per tile of the grouped kernel (`GB_M` in gemm.cu): `moe_group`'s tile for it.
pub const TILE_GEMM: usize = 64;
/// Weight rows per block of the grouped kernel (`GB_N`), outputs per block in the SwiGLU form.
const GB_N: usize = 128;
const GB_SW: usize = 64;
/// Dynamic shared memory of the grouped kernel (`GEMM_SMEM`).
const GEMM_SMEM: usize = 2 * (64 + 128) * 72 * 2;
/// cuBLASLt workspace.
const WORKSPACE: usize = 32 << 20;

fn blas_err(what: &'static str) -> impl FnOnce(lt::CublasError) -> CudaError {
    move |e| CudaError::Driver {
        what: format!("cuBLASLt {what}"),
        msg: format!("{e:?}"),
    }
}

/// A cuBLASLt handle on the device's stream, its workspace and the algorithm chosen per shape.
pub struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: DevBuf<u8>,
    algos: Mutex<HashMap<(usize, usize, usize), sys::cublasLtMatmulAlgo_t>>,
}

// SAFETY: the handle is used only from calls that enqueue on the one stream of its `Gpu`, one at a
// time (the algorithm cache is behind a mutex); cuBLASLt handles may be shared between threads.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once here.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// Owned cuBLASLt descriptors of one product, destroyed on drop.
struct Desc {
    op: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: each was created once in `Desc::new` and is destroyed once here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.op);
        }
    }
}

impl Desc {
    /// `D [T, N] f32 = X [T, K] bf16 · W [N, K]ᵀ bf16`, all row-major and packed. In cuBLAS's
    /// column-major terms: D (N × T, ld N) = op(A) · B with A = W as K × N (ld K, transposed) and
    /// B = X as K × T (ld K).
    fn new(n: usize, k: usize, t: usize) -> Result<Desc> {
        use sys::cudaDataType::{CUDA_R_16BF, CUDA_R_32F};
        let op = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, CUDA_R_32F)
            .map_err(blas_err("matmul descriptor"))?;
        let mut desc = Desc {
            op,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
        };
        let trans: i32 = 1;
        // SAFETY: `op` is live; the attribute is an i32 (cublasOperation_t) of the size given.
        unsafe {
            lt::set_matmul_desc_attribute(
                op,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &trans as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(blas_err("transpose attribute"))?;
        let (n, k, t) = (n as u64, k as u64, t as u64);
        desc.a =
            lt::create_matrix_layout(CUDA_R_16BF, k, n, k as i64).map_err(blas_err("layout"))?;
        desc.b =
            lt::create_matrix_layout(CUDA_R_16BF, k, t, k as i64).map_err(blas_err("layout"))?;
        desc.d =
            lt::create_matrix_layout(CUDA_R_32F, n, t, n as i64).map_err(blas_err("layout"))?;
        Ok(desc)
    }
}

impl Blas {
    /// A handle and workspace on `g`'s device; an error naming the library when it is missing.
    pub fn new(g: &Gpu) -> Result<Blas> {
        // SAFETY: only probes whether the shared library loads.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "libcublasLt (the CUDA toolkit's cuBLASLt) was not found on the library path"
                    .into(),
            ));
        }
        let handle = lt::create_handle().map_err(blas_err("handle"))?;
        Ok(Blas {
            handle,
            workspace: g.zeros(WORKSPACE)?,
            algos: Mutex::new(HashMap::new()),
        })
    }

    /// `y [t, n] f32 = x [t, k] bf16 · w [n, k]ᵀ bf16` on `g`'s stream (all packed row-major).
    pub fn gemm(
        &self,
        g: &Gpu,
        w: u64,
        x: u64,
        y: u64,
        (n, k, t): (usize, usize, usize),
    ) -> Result<()> {
        if n == 0 || t == 0 {
            return Ok(());
        }
        let desc = Desc::new(n, k, t)?;
        let algo = self.algo(&desc, (n, k, t))?;
        let (alpha, beta) = (1f32, 0f32);
        let stream = g.stream().cu_stream() as sys::cudaStream_t;
        // SAFETY: w holds n·k and x t·k bf16, y t·n f32 (the caller's contract); the descriptors
        // describe exactly those; the workspace is ours and the stream is the device's one.
        unsafe {
            lt::matmul(
                self.handle,
                desc.op,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                desc.a,
                x as *const c_void,
                desc.b,
                y as *const c_void,
                desc.d,
                y as *mut c_void,
                desc.d,
                &algo,
                self.workspace.ptr() as *mut c_void,
                WORKSPACE,
                stream,
            )
        }
        .map_err(blas_err("matmul"))
    }

    /// The heuristic's first algorithm for this shape, asked once per shape.
    fn algo(&self, desc: &Desc, key: (usize, usize, usize)) -> Result<sys::cublasLtMatmulAlgo_t> {
        let mut algos = self
            .algos
            .lock()
            .map_err(|_| CudaError::Unsupported("cuBLASLt algorithm cache poisoned".into()))?;
        if let Some(a) = algos.get(&key) {
            return Ok(*a);
        }
        let pref = lt::create_matmul_pref().map_err(blas_err("preference"))?;
        let ws = WORKSPACE as u64;
        // SAFETY: `pref` is live; the attribute is a u64 of the size given. The descriptors are
        // live for the call.
        let found =
            unsafe {
                lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
            .and_then(|_| {
                lt::get_matmul_algo_heuristic(
                    self.handle, desc.op, desc.a, desc.b, desc.d, desc.d, pref,
                )
            })
            };
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        let algo = found.map_err(blas_err("algorithm search"))?.algo;
        algos.insert(key, algo);
        Ok(algo)
    }
}

/// `y [t, k] bf16 = bf16(x)` for `t` rows of `x` at `xs` floats apart.
pub fn rows_to_bf16(g: &Gpu, x: u64, xs: usize, y: u64, k: usize, t: usize) -> Result<()> {
    if t == 0 || k == 0 {
        return Ok(());
    }
    // Four values a thread where rows and addresses allow 16-byte loads.
    let v4 =
        xs.is_multiple_of(4) && k.is_multiple_of(4) && x.is_multiple_of(16) && y.is_multiple_of(8);
    let (name, per) = if v4 {
        ("rows_to_bf16_v4", 1024)
    } else {
        ("rows_to_bf16", 256)
    };
    let (xs, k32) = (xs as i64, k as i32);
    let mut b = g.launch_builder(g.kernels().get(name));
    b.arg(&x).arg(&xs).arg(&y).arg(&k32);
    // SAFETY: x holds t rows of xs ≥ k floats, y t·k bf16; threads past k idle; the v4 form's
    // loads and stores are aligned (checked above).
    unsafe { b.launch(cfg((blocks(k, per), t as u32), 256, 0)) }.map_err(driver_err(name))
}

/// Whether [`weights_bf16`] and the grouped kernel take matrix `m` (bf16 with K % 8 == 0,
/// 4/8-bit affine with groups of 16, 32, 64 or 128, FP8 with K and its blocks multiples of 32).
pub fn supported(m: &Matvec) -> bool {
    match m.format {
        WeightFormat::Fp8 { group, .. } => m.k.is_multiple_of(32) && group.is_multiple_of(32),
        WeightFormat::Bf16 => m.k.is_multiple_of(8),
        WeightFormat::Affine { bits, group, .. } => {
            matches!(bits, 4 | 8)
                && matches!(group, 16 | 32 | 64 | 128)
                && m.k.is_multiple_of(group.max(32))
        }
    }
}

/// Matrix 0 of `m` as bf16 `[n, k]`: its own address for bf16 weights, else dequantized into
/// `out` (n·k bf16) and `out`'s address.
pub fn weights_bf16(g: &Gpu, m: &Matvec, out: &DevBuf<u16>) -> Result<u64> {
    let (bits, group, scales, biases, params) = match m.format {
        WeightFormat::Affine {
            bits,
            group,
            scales,
            biases,
            params,
        } => (bits, group, scales, biases, params),
        WeightFormat::Fp8 { group, scales } => return fp8_bf16(g, m, (group, scales), out),
        WeightFormat::Bf16 => return Ok(m.w),
    };
    if !supported(m) || out.len() < m.n * m.k {
        return Err(CudaError::Unsupported(format!(
            "dequant_affine: {bits}-bit group {group} [{}, {}] into {} values",
            m.n,
            m.k,
            out.len()
        )));
    }
    let words = m.n * m.k * bits as usize / 32;
    let (n32, k32, g32, b32) = (m.n as i32, m.k as i32, group as i32, bits as i32);
    let dst = out.ptr();
    let mut b = g.launch_builder(g.kernels().affine("dequant_affine_bf16", params)?);
    b.arg(&m.w)
        .arg(&scales)
        .arg(&biases)
        .arg(&dst)
        .arg(&n32)
        .arg(&k32)
        .arg(&g32)
        .arg(&b32);
    // SAFETY: the words, scales and biases are matrix 0 of an affine stack of this shape; out
    // holds n·k bf16 (checked); one thread a word, those past the matrix exit.
    unsafe { b.launch(cfg((blocks(words, 256), 1), 256, 0)) }
        .map_err(driver_err("dequant_affine_bf16"))?;
    Ok(out.ptr())
}

/// Matrix 0 of an FP8 `m` (blocks of `group`, row scales at `scales`) dequantized into `out`
/// (n·k bf16); `out`'s address.
fn fp8_bf16(g: &Gpu, m: &Matvec, (group, scales): (usize, u64), out: &DevBuf<u16>) -> Result<u64> {
    if !supported(m) || out.len() < m.n * m.k {
        return Err(CudaError::Unsupported(format!(
            "dequant_fp8: [{}, {}] in blocks of {group} into {} values",
            m.n,
            m.k,
            out.len()
        )));
    }
    let (n32, k32, g32, dst) = (m.n as i32, m.k as i32, group as i32, out.ptr());
    let mut b = g.launch_builder(g.kernels().get("dequant_fp8_bf16"));
    b.arg(&m.w)
        .arg(&scales)
        .arg(&dst)
        .arg(&n32)
        .arg(&k32)
        .arg(&g32);
    // SAFETY: codes n·k bytes and scales n·⌈k/group⌉ f32 are matrix 0 of an FP8 stack of this
    // shape; out holds n·k bf16 (checked); one thread a word of 4 codes, those past exit.
    unsafe { b.launch(cfg((blocks(m.n * m.k / 4, 256), 1), 256, 0)) }
        .map_err(driver_err("dequant_fp8_bf16"))?;
    Ok(out.ptr())
}

/// `h [t, i] = silu(gu[:, ..i]) · gu[:, i..]` for `gu [t, 2i]`.
pub fn swiglu_rows(g: &Gpu, gu: u64, h: u64, i: usize, t: usize) -> Result<()> {
    if t == 0 || i == 0 {
        return Ok(());
    }
    let i32_ = i as i32;
    let mut b = g.launch_builder(g.kernels().get("swiglu_rows"));
    b.arg(&gu).arg(&h).arg(&i32_);
    // SAFETY: gu holds t·2i floats, h t·i; threads past i exit.
    unsafe { b.launch(cfg((blocks(i, 256), t as u32), 256, 0)) }.map_err(driver_err("swiglu_rows"))
}

/// The grouped expert product over a grouping of [`TILE_GEMM`] pairs a tile, inputs bf16 (pair p
/// reads row `p / x_div` at `x + row·x_stride` values): plain, `y [pairs, N] f32`; SwiGLU
/// (`m.n = 2I`), `h [pairs, I] bf16 = bf16(silu(G x)·(U x))`.
pub fn grouped_gemm(g: &Gpu, m: Matvec, x: u64, out: u64, gr: Grouped, swiglu: bool) -> Result<()> {
    if !supported(&m) || gr.tile != TILE_GEMM || !gr.x_stride.is_multiple_of(8) || gr.x_div == 0 {
        return Err(CudaError::Unsupported(format!(
            "grouped GEMM: [{}, {}] with tile {} and stride {}",
            m.n, m.k, gr.tile, gr.x_stride
        )));
    }
    let (name, group, scales, biases) = match (m.format, swiglu) {
        (WeightFormat::Bf16, false) => ("moe_gemm_bf16", 0, 0, 0),
        (WeightFormat::Bf16, true) => ("moe_gemm_bf16_swiglu", 0, 0, 0),
        (WeightFormat::Fp8 { group, scales }, false) => ("moe_gemm_fp8", group, scales, 0),
        (WeightFormat::Fp8 { group, scales }, true) => ("moe_gemm_fp8_swiglu", group, scales, 0),
        (
            WeightFormat::Affine {
                bits,
                group,
                scales,
                biases,
                ..
            },
            sw,
        ) => {
            let name = match (bits, sw) {
                (4, false) => "moe_gemm_affine4",
                (4, true) => "moe_gemm_affine4_swiglu",
                (_, false) => "moe_gemm_affine8",
                (_, true) => "moe_gemm_affine8_swiglu",
            };
            (name, group, scales, biases)
        }
    };
    let f = g.kernels().for_format(name, &m.format)?;
    raise_smem_of(f, name, GEMM_SMEM)?;
    let (y, h) = if swiglu { (0u64, out) } else { (out, 0u64) };
    let (xs, xd, n32, k32, g32) = (
        gr.x_stride as i64,
        gr.x_div as i32,
        m.n as i32,
        m.k as i32,
        group as i32,
    );
    let mut b = g.launch_builder(f);
    b.arg(&m.w).arg(&scales).arg(&biases);
    b.arg(&x).arg(&xs).arg(&xd).arg(&y).arg(&h);
    b.arg(&n32).arg(&k32).arg(&g32);
    b.arg(&gr.tiles).arg(&gr.n_tiles).arg(&gr.order);
    let cols = match swiglu {
        true => (m.n / 2).div_ceil(GB_SW),
        false => m.n.div_ceil(GB_N),
    };
    let grid = (gr.max_tiles.max(1) as u32, cols as u32);
    // SAFETY: the tiles come from moe_group over the same pairs in tiles of TILE_GEMM (checked),
    // experts < the stack's count; x holds (max pair / x_div + 1) rows of x_stride ≥ K bf16 with
    // x_stride % 8 == 0 (16-byte rows: checked); y pairs·N floats or h pairs·N/2 bf16; the
    // weights are a stack of this format with K and group as `supported` requires (checked);
    // the block's shared memory is GEMM_SMEM (limit raised above).
    unsafe { b.launch(cfg(grid, 256, GEMM_SMEM as u32)) }.map_err(driver_err(name))
}
