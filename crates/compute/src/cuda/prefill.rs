//! Launch wrappers for prefill (T tokens of one sequence per launch): `kernels/prefill.cu` (GDN
//! conv over rows, q/k/v packing and gates, gated RMSNorm over rows, MoE grouping by expert),
//! causal attention over rows on tensor cores (`kernels/flash_prefill.cu`), the grouped expert
//! products of `kernels/matvec_rows.cu` and `attn_prep` with per-row positions. Arguments are
//! raw device addresses as in [`super::ops`]; state pointers arrive already offset to the
//! sequence's slot. CPU twins: `cpu::conv`, `cpu::norm`, `cpu::attention`, and the per-pair
//! expert products of [`super::ops::matvec`].

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::LaunchConfig;

use super::launch::Launch;
use super::ops::{blocks, cfg, matrix_args, AttnDims, GdnDims, Matvec, WeightFormat, ATTN_DMAX};
use super::{driver_err, CudaError, Gpu, Result};

/// Conv1d + SiLU over `t` rows (row i at `proj + i·proj_stride` floats, the first `c` used)
/// from the carried state `[k−1, c]`, into `mixed [t, c]`; then the state takes the last k−1
/// inputs.
#[allow(clippy::too_many_arguments)]
pub fn gdn_conv_rows(
    g: &Gpu,
    proj: u64,
    proj_stride: usize,
    state: u64,
    w: u64,
    mixed: u64,
    c: usize,
    k: usize,
    t: usize,
) -> Result<()> {
    let (c32, k32, t32, ps) = (c as i32, k as i32, t as i32, proj_stride as i64);
    let mut b = g.launch_builder(g.kernels().get("gdn_conv_rows"));
    b.arg(&proj)
        .arg(&ps)
        .arg(&state)
        .arg(&w)
        .arg(&mixed)
        .arg(&c32)
        .arg(&k32);
    // SAFETY: proj holds t rows of proj_stride ≥ c floats, state (k−1)·c, w c·k, mixed t·c;
    // channels are bounds-checked against c.
    unsafe { b.launch(cfg((blocks(c, 256), t as u32), 256, 0)) }
        .map_err(driver_err("gdn_conv_rows"))?;
    let mut b = g.launch_builder(g.kernels().get("gdn_conv_state"));
    b.arg(&proj)
        .arg(&ps)
        .arg(&state)
        .arg(&c32)
        .arg(&k32)
        .arg(&t32);
    // SAFETY: as above; reads rows < t and state rows < k−1.
    unsafe { b.launch(cfg((blocks(c, 256), 1), 256, 0)) }.map_err(driver_err("gdn_conv_state"))?;
    Ok(())
}

/// Buffers `gdn_pack` writes: q, k bf16 `[t, hk·dk]`, v bf16 `[t, hv·dv]`, gates (log decay)
/// and beta f32 `[t, hv]`.
#[derive(Clone, Copy, Debug)]
pub struct GdnPacked {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub gate: u64,
    pub beta: u64,
}

/// From the conv output `mixed [t, conv dim]` and the projection rows: q, k, v rounded to bf16
/// and per (row, value head) `gate = neg_a·softplus(a + dt_bias)`, `beta = sigmoid(b)`.
#[allow(clippy::too_many_arguments)]
pub fn gdn_pack(
    g: &Gpu,
    mixed: u64,
    proj: u64,
    proj_stride: usize,
    neg_a: u64,
    dt_bias: u64,
    out: GdnPacked,
    d: GdnDims,
    t: usize,
) -> Result<()> {
    if d.hv > 256 {
        return Err(CudaError::Unsupported(format!(
            "gdn_pack: {} value heads exceed 256",
            d.hv
        )));
    }
    let c = 2 * d.hk * d.dk + d.hv * d.dv;
    let (hk, hv, dk, dv) = (d.hk as i32, d.hv as i32, d.dk as i32, d.dv as i32);
    let ps = proj_stride as i64;
    let mut b = g.launch_builder(g.kernels().get("gdn_pack"));
    b.arg(&mixed)
        .arg(&proj)
        .arg(&ps)
        .arg(&neg_a)
        .arg(&dt_bias)
        .arg(&out.q)
        .arg(&out.k)
        .arg(&out.v)
        .arg(&out.gate)
        .arg(&out.beta);
    b.arg(&hk).arg(&hv).arg(&dk).arg(&dv);
    // SAFETY: mixed holds t·c floats, proj t rows of proj_stride ≥ c + hv·dv + 2·hv floats,
    // neg_a and dt_bias hv; the outputs as `GdnPacked` states; hv ≤ 256 (checked).
    unsafe { b.launch(cfg((blocks(c, 256), t as u32), 256, 0)) }.map_err(driver_err("gdn_pack"))?;
    Ok(())
}

/// Per row and value head: `out = o / rms(o) · w · silu(z)` with o from `o [t, hv, dv]` and z at
/// float `z_off + h·dv` of each projection row; out `[t, hv·dv]`.
#[allow(clippy::too_many_arguments)]
pub fn gated_rmsnorm_rows(
    g: &Gpu,
    o: u64,
    proj: u64,
    proj_stride: usize,
    z_off: usize,
    w: u64,
    out: u64,
    hv: usize,
    dv: usize,
    eps: f32,
    t: usize,
) -> Result<()> {
    if dv > 1024 {
        return Err(CudaError::Unsupported(format!(
            "gated_rmsnorm_rows: head dim {dv} exceeds 1024"
        )));
    }
    let (ps, zo, hv32, dv32) = (proj_stride as i64, z_off as i32, hv as i32, dv as i32);
    let mut b = g.launch_builder(g.kernels().get("gated_rmsnorm_rows"));
    b.arg(&o)
        .arg(&proj)
        .arg(&ps)
        .arg(&zo)
        .arg(&w)
        .arg(&out)
        .arg(&hv32)
        .arg(&dv32)
        .arg(&eps);
    let threads = (dv.div_ceil(32) * 32) as u32;
    // SAFETY: o and out hold t·hv·dv floats, proj t rows of proj_stride ≥ z_off + hv·dv floats,
    // w dv floats; dv ≤ 1024 (checked).
    unsafe { b.launch(cfg((hv as u32, t as u32), threads, 0)) }
        .map_err(driver_err("gated_rmsnorm_rows"))?;
    Ok(())
}

/// Positions per K/V tile of the flash kernels (`FP_BN` in flash_prefill.cu).
const FP_BN: usize = 32;
/// Most warps (16 query rows each) per block of the flash kernels.
const FP_WARPS: usize = 8;

/// Dynamic shared memory of `flash_prefill_<dt>` with `warps` warps (the kernel header's sum;
/// half without the lo parts of the split form).
fn flash_smem(dt: usize, warps: usize, split: bool) -> usize {
    let (qs, vs, parts) = (dt / 2 + 4, FP_BN / 2 + 4, 1 + split as usize);
    4 * parts * (16 * warps * qs + FP_BN * qs + dt * vs)
}

/// Causal gated attention of `t` query rows (`q [t, hq, d]`, row i at position `pos0 + i`)
/// against one slot's caches `[ctx, hkv, d]` (offset to the slot; rows `0..pos0 + t` written),
/// gates from the projection rows (`proj_stride` floats apart); out `[t, hq·d]`. Tensor cores
/// (`flash_prefill.cu`, f32 accumulation and online softmax): q, k, v and the probabilities as
/// bf16 hi + lo splits (about f32 accuracy), or with `bf16` rounded to bf16 once (a third of
/// the products; the caches are then bf16 copies of the slot's rows `0..pos0 + t`, e.g. from
/// `gemm::rows_to_bf16`); the q heads sharing a kv head share its K/V tiles.
pub fn attn_prefill(
    g: &Gpu,
    (q, proj, proj_stride, out): (u64, u64, usize, u64),
    (k_cache, v_cache): (u64, u64),
    a: AttnDims,
    (t, pos0): (usize, usize),
    bf16: bool,
) -> Result<()> {
    if a.d > ATTN_DMAX || a.hkv == 0 || !a.hq.is_multiple_of(a.hkv) {
        return Err(CudaError::Unsupported(format!(
            "attn_prefill: head dim {} (≤ {ATTN_DMAX}) or heads {}/{}",
            a.d, a.hq, a.hkv
        )));
    }
    if t == 0 {
        return Ok(());
    }
    let (dt, name) = match (a.d, bf16) {
        (0..=64, false) => (64, "flash_prefill_64"),
        (65..=128, false) => (128, "flash_prefill_128"),
        (_, false) => (256, "flash_prefill_256"),
        (0..=64, true) => (64, "flash_prefill_64_bf16"),
        (65..=128, true) => (128, "flash_prefill_128_bf16"),
        (_, true) => (256, "flash_prefill_256_bf16"),
    };
    let max_smem = g
        .stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(driver_err(name))? as usize;
    // One warp per 16 (token, head) rows up to FP_WARPS, fewer where shared memory is short.
    let rows = t * (a.hq / a.hkv);
    let mut warps = rows.div_ceil(16).min(FP_WARPS);
    while warps > 1 && flash_smem(dt, warps, !bf16) > max_smem {
        warps -= 1;
    }
    let smem = flash_smem(dt, warps, !bf16);
    if smem > max_smem {
        return Err(CudaError::Unsupported(format!(
            "attn_prefill: head dim {} needs {smem} bytes of shared memory, the device has {max_smem}",
            a.d
        )));
    }
    g.raise_smem(name, smem)?;
    let (ps, t32, p32) = (proj_stride as i64, t as i32, pos0 as i32);
    let (hq, hkv, d) = (a.hq as i32, a.hkv as i32, a.d as i32);
    let scale_log2 = std::f32::consts::LOG2_E / (a.d as f32).sqrt();
    let mut b = g.launch_builder(g.kernels().get(name));
    b.arg(&q)
        .arg(&k_cache)
        .arg(&v_cache)
        .arg(&proj)
        .arg(&ps)
        .arg(&out)
        .arg(&t32)
        .arg(&p32)
        .arg(&hq)
        .arg(&hkv)
        .arg(&d)
        .arg(&scale_log2);
    let grid = (blocks(rows, 16 * warps), a.hkv as u32);
    // SAFETY: d ≤ dt ≤ 256 (the kernel's register tiles; columns past d are zero-filled and not
    // written), hq a multiple of hkv (checked); q and out hold t·hq·d floats, proj t rows with
    // the gates, the caches pos0 + t written positions (reads stop at pos0 + t − 1); the block
    // has 32·warps threads and the shared memory the kernel lays out for them (checked against
    // the device's opt-in limit).
    unsafe { b.launch(cfg(grid, 32 * warps as u32, smem as u32)) }.map_err(driver_err(name))?;
    Ok(())
}

/// Most experts `moe_group` sorts (`MG_EMAX` in prefill.cu).
pub const MOE_GROUP_EMAX: usize = 1040;
/// Pairs per grouped tile of the CUDA-core grouped kernels (`MV_VECS` in matvec_rows.cu).
pub const TILE_CORES: usize = 8;
/// Pairs per grouped tile of the tensor-core grouped kernels (`8·MMA_TILES` in mma_rows.cu).
pub const TILE_MMA: usize = 32;
/// Pairs per grouped tile the split-K grouped kernels take (`8·MT` in mma_rows.cu,
/// `mma_gsplit_*`): decode batches, a few pairs an expert.
pub const TILES_SPLIT: [usize; 2] = [8, 16];

/// Tiles a grouping of `pairs` pairs over `experts` experts in tiles of `tile` can take (the
/// grid of the grouped products).
pub fn max_tiles(pairs: usize, experts: usize, tile: usize) -> usize {
    pairs.min(pairs.div_ceil(tile) + experts)
}

/// Sort the `n` (token, slot) pairs of `ids [n]` by expert: `order [n]`, tiles int3
/// `[max_tiles(n, e, tile)]` of at most `tile` pairs and their count in `n_tiles [1]`.
#[allow(clippy::too_many_arguments)]
pub fn moe_group(
    g: &Gpu,
    ids: u64,
    n: usize,
    e: usize,
    tile: usize,
    order: u64,
    tiles: u64,
    n_tiles: u64,
) -> Result<()> {
    if e > MOE_GROUP_EMAX {
        return Err(CudaError::Unsupported(format!(
            "moe_group: {e} experts exceed {MOE_GROUP_EMAX}"
        )));
    }
    let (n32, e32, t32) = (n as i32, e as i32, tile.max(1) as i32);
    let mut b = g.launch_builder(g.kernels().get("moe_group"));
    b.arg(&ids)
        .arg(&n32)
        .arg(&e32)
        .arg(&order)
        .arg(&tiles)
        .arg(&n_tiles)
        .arg(&t32);
    // SAFETY: ids holds n ints each < e ≤ MG_EMAX (router_topk writes ids < experts + 1);
    // order holds n ints, tiles 3·max_tiles(n, e, tile), n_tiles one.
    unsafe { b.launch(cfg((1, 1), 1024, 0)) }.map_err(driver_err("moe_group"))?;
    Ok(())
}

/// A grouping from [`moe_group`] and how the grouped products read their inputs: pair p reads
/// row `p / x_div` of `x_stride` floats. `tile` is the grouping's tile size: [`TILE_MMA`]
/// selects the tensor-core kernels, [`TILE_CORES`] the CUDA-core ones.
#[derive(Clone, Copy, Debug)]
pub struct Grouped {
    pub order: u64,
    pub tiles: u64,
    pub n_tiles: u64,
    pub tile: usize,
    pub max_tiles: usize,
    pub x_stride: usize,
    pub x_div: usize,
}

/// Whether the grouped kernels take matrix `m` with inputs `x_stride` floats apart (float4
/// loads: bf16 needs K % 8 == 0; the stride a multiple of 4).
pub fn grouped_supported(m: &Matvec, x_stride: usize) -> bool {
    let k_ok = matches!(m.format, WeightFormat::Affine { .. }) || m.k.is_multiple_of(8);
    k_ok && x_stride.is_multiple_of(4)
}

/// The arguments every grouped product kernel takes first, in their order: the matrix's (see
/// `ops::matrix_args`; N the outputs), then the grouping's tiles, tile count, order, input
/// stride (kernels that read x itself, not staged rows) and divisor. Held here so that the
/// launch builder may borrow them.
pub(crate) struct GroupedArgs {
    w: u64,
    affine: Option<(u64, u64, i32, i32)>,
    io: Vec<u64>,
    nk: [i32; 2],
    tiles: [u64; 3],
    xs: Option<i64>,
    xd: i32,
}

impl GroupedArgs {
    pub(crate) fn new(
        m: &Matvec,
        io: Vec<u64>,
        out_rows: usize,
        gr: &Grouped,
        stride: bool,
    ) -> GroupedArgs {
        GroupedArgs {
            w: m.w,
            affine: m.format.quant_args(),
            io,
            nk: [out_rows as i32, m.k as i32],
            tiles: [gr.tiles, gr.n_tiles, gr.order],
            xs: stride.then_some(gr.x_stride as i64),
            xd: gr.x_div as i32,
        }
    }

    pub(crate) fn push<'a>(&'a self, b: &mut Launch<'a>) {
        matrix_args(b, &self.w, &self.affine, &self.io, &self.nk);
        for t in &self.tiles {
            b.arg(t);
        }
        if let Some(xs) = &self.xs {
            b.arg(xs);
        }
        b.arg(&self.xd);
    }
}

fn grouped(g: &Gpu, m: Matvec, x: u64, y: u64, gr: Grouped, swiglu: bool) -> Result<()> {
    if !grouped_supported(&m, gr.x_stride) || gr.x_div == 0 {
        return Err(CudaError::Unsupported(format!(
            "grouped product: K {} / stride {} not supported",
            m.k, gr.x_stride
        )));
    }
    let out_rows = if swiglu { m.n / 2 } else { m.n };
    let mma = gr.tile == TILE_MMA;
    if mma && !super::ops::tensor_core_rows(&m) {
        return Err(CudaError::Unsupported(
            "grouped product: tensor-core tiles for a matrix the tensor-core kernels do not take"
                .into(),
        ));
    }
    let name = match (m.format, swiglu, mma) {
        (WeightFormat::Fp8 { .. }, false, _) => "grouped_rows_fp8",
        (WeightFormat::Fp8 { .. }, true, _) => "grouped_swiglu_fp8",
        (WeightFormat::Bf16, false, false) => "grouped_rows_bf16",
        (WeightFormat::Bf16, true, false) => "grouped_swiglu_bf16",
        (WeightFormat::Affine { .. }, false, false) => "grouped_rows_affine",
        (WeightFormat::Affine { .. }, true, false) => "grouped_swiglu_affine",
        (WeightFormat::Bf16, false, true) => "mma_grouped_rows_bf16",
        (WeightFormat::Bf16, true, true) => "mma_grouped_swiglu_bf16",
        (WeightFormat::Affine { .. }, false, true) => "mma_grouped_rows_affine",
        (WeightFormat::Affine { .. }, true, true) => "mma_grouped_swiglu_affine",
    };
    let args = GroupedArgs::new(&m, vec![x, y], out_rows, &gr, true);
    let mut b = g.launch_builder(g.kernels().for_format(name, &m.format)?);
    args.push(&mut b);
    let rows_per_block = if mma { 128 } else { 8 };
    let grid = (gr.max_tiles.max(1) as u32, blocks(out_rows, rows_per_block));
    // SAFETY: the tiles come from moe_group over the same pairs (experts < the stack's count,
    // pair indices < pairs); x holds (max pair / x_div + 1) rows of x_stride ≥ K floats
    // (16-byte aligned: checked), y pairs·N floats (pairs·I for SwiGLU); W holds the stacked
    // experts of its format.
    unsafe { b.launch(cfg(grid, 256, 0)) }.map_err(driver_err(name))?;
    Ok(())
}

/// `y[p] = W_{e(p)} x_{p / x_div}` for every pair p of the grouping (no bias).
pub fn grouped_matvec(g: &Gpu, m: Matvec, x: u64, y: u64, gr: Grouped) -> Result<()> {
    grouped(g, m, x, y, gr, false)
}

/// `h[p] = silu(G_e x) ⊙ U_e x` for every pair p of the grouping (`m.n = 2I`).
pub fn grouped_swiglu(g: &Gpu, m: Matvec, x: u64, h: u64, gr: Grouped) -> Result<()> {
    grouped(g, m, x, h, gr, true)
}

/// [`grouped_matvec`] (`swiglu` false) or [`grouped_swiglu`] on the split-K grouped kernels,
/// whose tiles ([`TILES_SPLIT`]) hold few pairs, at the accuracy of the tensor-core row
/// products: 16 weight rows a warp, K split over `split_warps(K)` warps, `blocks` blocks
/// (at most `gr.max_tiles`) looping over the tiles — size it for the tiles expected.
pub fn grouped_split(
    g: &Gpu,
    m: Matvec,
    (x, y): (u64, u64),
    gr: Grouped,
    swiglu: bool,
    blocks_x: usize,
) -> Result<()> {
    let two = match gr.tile {
        8 => false,
        16 => true,
        t => {
            return Err(CudaError::Unsupported(format!(
                "grouped split-K product: tiles of {t} pairs (8 or 16)"
            )))
        }
    };
    if !super::ops::tensor_core_rows(&m) || !gr.x_stride.is_multiple_of(4) || gr.x_div == 0 {
        return Err(CudaError::Unsupported(format!(
            "grouped split-K product: K {} / stride {} not supported",
            m.k, gr.x_stride
        )));
    }
    let out_rows = if swiglu { m.n / 2 } else { m.n };
    let ks = split_warps(m.k);
    let ks32 = ks as i32;
    let affine = matches!(m.format, WeightFormat::Affine { .. });
    let name = match (affine, swiglu, two) {
        (false, false, false) => "mma_gsplit_rows_bf16_1",
        (false, true, false) => "mma_gsplit_swiglu_bf16_1",
        (true, false, false) => "mma_gsplit_rows_affine_1",
        (true, true, false) => "mma_gsplit_swiglu_affine_1",
        (false, false, true) => "mma_gsplit_rows_bf16_2",
        (false, true, true) => "mma_gsplit_swiglu_bf16_2",
        (true, false, true) => "mma_gsplit_rows_affine_2",
        (true, true, true) => "mma_gsplit_swiglu_affine_2",
    };
    let args = GroupedArgs::new(&m, vec![x, y], out_rows, &gr, true);
    let mut b = g.launch_builder(g.kernels().for_format(name, &m.format)?);
    args.push(&mut b);
    b.arg(&ks32);
    let grid = (
        blocks_x.clamp(1, gr.max_tiles.max(1)) as u32,
        blocks(out_rows, 16 * 8 / ks),
    );
    // SAFETY: as `grouped`: the tiles (counts ≤ gr.tile, the kernel's 8·MT) come from moe_group
    // over the same pairs; x holds (max pair / x_div + 1) rows of x_stride ≥ K floats (16-byte
    // aligned: checked), y pairs·N floats (pairs·I for SwiGLU); W the stacked experts of a
    // format the tensor-core row kernels take (K % 32 == 0, checked); ks divides 8.
    unsafe { b.launch(cfg(grid, 256, 0)) }.map_err(driver_err(name))?;
    Ok(())
}

/// Warps that split K in the grouped split-K kernels: the most (up to the block's 8, a power
/// of two) that leave each at least 4 chunks of 32.
pub fn split_warps(k: usize) -> usize {
    let chunks = k / 32;
    [8, 4, 2]
        .into_iter()
        .find(|&w| chunks >= 4 * w)
        .unwrap_or(1)
}

/// The gated delta rule over `t` tokens in f32, token by token with the arithmetic of the decode
/// kernel `gdn_step`: q, k, v from the conv output rows `mixed [t, conv dim]`, gates from the
/// projection rows; the state `[hv, dk, dv]` (offset to the slot) is updated in place; out
/// `[t, hv, dv]` before the gated norm ([`gated_rmsnorm_rows`]).
#[allow(clippy::too_many_arguments)]
pub fn gdn_rec_rows(
    g: &Gpu,
    mixed: u64,
    proj: u64,
    proj_stride: usize,
    state: u64,
    neg_a: u64,
    dt_bias: u64,
    out: u64,
    d: GdnDims,
    t: usize,
) -> Result<()> {
    if d.dk > 128 || d.hk == 0 || !d.hv.is_multiple_of(d.hk) {
        return Err(CudaError::Unsupported(format!(
            "gdn_rec_rows: key dim {} (≤ 128) or heads {}/{}",
            d.dk, d.hk, d.hv
        )));
    }
    let (t32, hk, hv, dk, dv) = (t as i32, d.hk as i32, d.hv as i32, d.dk as i32, d.dv as i32);
    let ps = proj_stride as i64;
    let mut b = g.launch_builder(g.kernels().get("gdn_rec_rows"));
    b.arg(&mixed)
        .arg(&proj)
        .arg(&ps)
        .arg(&state)
        .arg(&neg_a)
        .arg(&dt_bias)
        .arg(&out)
        .arg(&t32)
        .arg(&hk)
        .arg(&hv)
        .arg(&dk)
        .arg(&dv);
    let launch = LaunchConfig {
        grid_dim: (d.hv as u32, d.dv.div_ceil(32) as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: dk ≤ 128 (the shared q/k rows and register columns), hv a multiple of hk
    // (checked); mixed holds t rows of 2·hk·dk + hv·dv floats, proj t rows of proj_stride floats
    // with the b and a gates after them, state hv·dk·dv floats, out t·hv·dv; columns ≥ dv idle.
    unsafe { b.launch(launch) }.map_err(driver_err("gdn_rec_rows"))?;
    Ok(())
}
