//! The activations the layers read and write: a decode step's ([`Scratch`], `rows` rows) and a
//! prefill pass's ([`PrefillScratch`], up to `rows` tokens), sized by what the layers need
//! ([`Needs`]).

use deltamoe_compute::cuda::comm::WINDOW_BYTES;
use deltamoe_compute::cuda::ops::{Matvec, WeightFormat};
use deltamoe_compute::cuda::prefill as pf;
use deltamoe_compute::cuda::{DevBuf, Gpu, Result};

use crate::config::ModelConfig;

/// Words per row of a decode step's wide-form workspace: the staged inputs of a product
/// (`dispatch::wide_staged_words`: K and its group sums for each of a row's inputs, 9 of them
/// for the down products of 8 routed and a shared expert) and the partial sums of K split over
/// blocks (`dispatch::wide_splits`).
pub(crate) const WIDE_PART_PER_ROW: usize = 65_536;

/// Split-K partitions of the attention decode (its partial outputs are sized for them).
pub(crate) const ATTN_SPLITS: usize = 64;

/// Rows of logits computed per lm_head launch of a prefill pass for `Logits::All`.
pub(crate) const LOGIT_ROWS: usize = 64;

/// Scratch a layer needs beyond the residual: floats per row of its input projection's outputs
/// (`proj`), the ffn's hidden activations (`inter`, all slots of a row) and a shared expert's
/// run apart (`shared`); bytes of workspace for a prefill pass (`workspace`); for the bf16
/// products of a prefill pass ([`super::pass_mv`]) the widest input (`gemm_k`), the most
/// weights dequantized at once (`gemm_w`) and the widest SwiGLU product (`gemm_gu`); words per
/// token of the wide kernels' staged inputs for a short pass's expert products (`wide_stage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Needs {
    pub proj: usize,
    pub inter: usize,
    pub shared: usize,
    pub workspace: usize,
    pub gemm_k: usize,
    pub gemm_w: usize,
    pub gemm_gu: usize,
    pub wide_stage: usize,
}

impl Needs {
    pub fn max(self, o: Needs) -> Needs {
        Needs {
            proj: self.proj.max(o.proj),
            inter: self.inter.max(o.inter),
            shared: self.shared.max(o.shared),
            workspace: self.workspace.max(o.workspace),
            gemm_k: self.gemm_k.max(o.gemm_k),
            gemm_w: self.gemm_w.max(o.gemm_w),
            gemm_gu: self.gemm_gu.max(o.gemm_gu),
            wide_stage: self.wide_stage.max(o.wide_stage),
        }
    }

    /// What a prefill pass's row products `ms` (each with whether it is a SwiGLU) need.
    pub fn products(ms: &[(Matvec, bool)]) -> Needs {
        ms.iter().fold(Needs::default(), |n, &(m, swiglu)| {
            let quantized = !matches!(m.format, WeightFormat::Bf16);
            n.max(Needs {
                gemm_k: m.k,
                gemm_w: if quantized { m.n * m.k } else { 0 },
                gemm_gu: if swiglu { m.n } else { 0 },
                ..Needs::default()
            })
        })
    }
}

/// An ffn's activations for `rows` rows (a decode step's, or a prefill pass's), `k` = top-k + 1
/// slots a row for an MoE: router logits `[rows, E + 1]`, routed ids and weights `[rows, k]`,
/// shared-expert gates `[rows]`, hidden activations `[rows, inter]` (all slots of a row), expert
/// outputs `[rows, k, H]`, the shared expert's hidden `[rows, shared]` and output `[rows, H]`
/// when it runs apart, and the (row, slot) pairs grouped by expert (`order`, `tiles`,
/// `n_tiles`: see `prefill::moe_group`).
pub(crate) struct FfnBufs {
    pub router: DevBuf<f32>,
    pub ids: DevBuf<i32>,
    pub weights: DevBuf<f32>,
    pub sg: DevBuf<f32>,
    pub h: DevBuf<f32>,
    pub y: DevBuf<f32>,
    pub hs: DevBuf<f32>,
    pub ys: DevBuf<f32>,
    pub order: DevBuf<i32>,
    pub tiles: DevBuf<i32>,
    pub n_tiles: DevBuf<i32>,
}

impl FfnBufs {
    /// Buffers for `rows` rows of config `c`'s shape, with the layers' `needs`.
    pub fn new(g: &Gpu, c: &ModelConfig, needs: Needs, rows: usize) -> Result<FfnBufs> {
        let (r, h, k) = (rows, c.hidden_size, c.experts_per_token + 1);
        Ok(FfnBufs {
            router: g.zeros(r * (c.num_experts + 1))?,
            ids: g.zeros(r * k)?,
            weights: g.zeros(r * k)?,
            sg: g.zeros(r)?,
            h: g.zeros(r * needs.inter)?,
            y: g.zeros(r * k * h)?,
            hs: g.zeros(r * needs.shared)?,
            ys: g.zeros(r * h)?,
            order: g.zeros(r * k)?,
            tiles: g.zeros(3 * pf::max_tiles(r * k, c.num_experts + 1, pf::TILE_CORES))?,
            n_tiles: g.zeros(1)?,
        })
    }
}

/// Rows that GPUs sum with all-reduces: in memory of their own, or at an offset of the
/// communicator's symmetric window (`comm::Comm::window`), where NCCL's symmetric kernels take
/// them.
pub(crate) enum Rows {
    Own(DevBuf<f32>),
    Window(u64),
}

impl Rows {
    /// `n` zeroed floats: at `window + offset` when a window is given and holds them, else
    /// in memory of their own.
    fn new(g: &Gpu, n: usize, window: Option<u64>, offset: usize) -> Result<Rows> {
        match window {
            Some(w) if offset + 4 * n <= WINDOW_BYTES => {
                let at = w + offset as u64;
                // SAFETY: the window holds [offset, offset + 4n) (checked above).
                unsafe { g.zero_raw(at, 4 * n) }?;
                Ok(Rows::Window(at))
            }
            _ => Ok(Rows::Own(g.zeros(n)?)),
        }
    }

    /// Device address of element 0.
    pub(crate) fn ptr(&self) -> u64 {
        match self {
            Rows::Own(b) => b.ptr(),
            Rows::Window(at) => *at,
        }
    }
}

/// Activations of a step, `rows` rows each (steps run one at a time on one stream).
pub(crate) struct Scratch {
    /// The residual rows and a layer's output rows, which several GPUs all-reduce.
    pub(crate) x: Rows,
    pub(crate) normed: DevBuf<f32>,
    pub(crate) delta: Rows,
    pub(crate) proj: DevBuf<f32>,
    pub(crate) mixed: DevBuf<f32>,
    pub(crate) mix_out: DevBuf<f32>,
    pub(crate) q: DevBuf<f32>,
    pub(crate) part_o: DevBuf<f32>,
    pub(crate) part_ml: DevBuf<f32>,
    pub(crate) ffn: FfnBufs,
    /// The wide-form products' workspace: staged inputs and partial sums (`rows · WIDE_PART_PER_ROW`
    /// words).
    pub(crate) part: DevBuf<f32>,
    pub(crate) logits: DevBuf<f32>,
    /// A one-row lm_head's largest logit and its index per block (`VecIo::best`), at most one
    /// block per 16 rows.
    pub(crate) best: DevBuf<f32>,
}

impl Scratch {
    /// Buffers for `rows` rows; `x` and `delta` in `window` (several GPUs' symmetric window)
    /// when it holds them.
    pub(crate) fn new(
        g: &Gpu,
        c: &ModelConfig,
        (needs, rows): (Needs, usize),
        window: Option<u64>,
    ) -> Result<Scratch> {
        let h = c.hidden_size;
        let qd = c.num_heads * c.head_dim;
        let r = rows;
        Ok(Scratch {
            x: Rows::new(g, r * h, window, 0)?,
            normed: g.zeros(r * h)?,
            delta: Rows::new(g, r * h, window, 4 * r * h)?,
            proj: g.zeros(r * needs.proj)?,
            mixed: g.zeros(r * c.conv_dim())?,
            mix_out: g.zeros(r * qd.max(c.linear_value_size()))?,
            q: g.zeros(r * qd)?,
            part_o: g.zeros(r * c.num_heads * ATTN_SPLITS * c.head_dim)?,
            part_ml: g.zeros(r * c.num_heads * ATTN_SPLITS * 2)?,
            ffn: FfnBufs::new(g, c, needs, r)?,
            part: g.zeros(r * WIDE_PART_PER_ROW)?,
            logits: g.zeros(r * c.vocab_size)?,
            best: g.zeros(2 * c.vocab_size.div_ceil(16))?,
        })
    }
}

/// Tokens of the longest pass whose expert products may take the wide kernels
/// (`dispatch::prefill_wide_tile`).
fn wide_tokens(c: &ModelConfig) -> usize {
    deltamoe_compute::cuda::dispatch::prefill_wide_max_tokens(c.experts_per_token, c.num_experts)
}

/// Activations of one pass of up to `rows` tokens.
pub(crate) struct PrefillScratch {
    pub(crate) rows: usize,
    pub(crate) tok: DevBuf<i32>,
    pub(crate) slots: DevBuf<i32>,
    pub(crate) x: DevBuf<f32>,
    pub(crate) normed: DevBuf<f32>,
    pub(crate) delta: DevBuf<f32>,
    pub(crate) proj: DevBuf<f32>,
    pub(crate) mixed: DevBuf<f32>,
    pub(crate) core: DevBuf<f32>,
    pub(crate) mix_out: DevBuf<f32>,
    pub(crate) q: DevBuf<f32>,
    pub(crate) qb: DevBuf<u16>,
    pub(crate) kb: DevBuf<u16>,
    pub(crate) vb: DevBuf<u16>,
    pub(crate) gate: DevBuf<f32>,
    pub(crate) beta: DevBuf<f32>,
    pub(crate) ws: DevBuf<u8>,
    /// bf16 products: input rows `[rows, gemm_k]`, dequantized weights `[gemm_w]`, SwiGLU
    /// products `[rows, gemm_gu]` (f32), grouped experts' hidden rows `[rows, inter]`.
    pub(crate) xb: DevBuf<u16>,
    pub(crate) wb: DevBuf<u16>,
    pub(crate) gu: DevBuf<f32>,
    pub(crate) hb: DevBuf<u16>,
    /// bf16 copies of an attention layer's K and V rows for its flash attention, grown to the
    /// sequence's length as passes need (`GpuModel::prefill`).
    pub(crate) kvb: DevBuf<u16>,
    /// The wide kernels' staged inputs for the expert products of passes short enough to take
    /// them (`dispatch::prefill_wide_tile`).
    pub(crate) stage: DevBuf<f32>,
    pub(crate) ffn: FfnBufs,
    pub(crate) logits: DevBuf<f32>,
}

impl PrefillScratch {
    pub(crate) fn new(
        g: &Gpu,
        c: &ModelConfig,
        needs: Needs,
        rows: usize,
    ) -> Result<PrefillScratch> {
        let r = rows;
        let h = c.hidden_size;
        let proj = needs.proj;
        let ws = needs.workspace.max(1);
        let (qd, vd, kd) = (
            c.num_heads * c.head_dim,
            c.linear_value_size(),
            c.linear_k_heads * c.linear_k_dim,
        );
        Ok(PrefillScratch {
            rows,
            tok: g.zeros(r)?,
            slots: g.zeros(r)?,
            x: g.zeros(r * h)?,
            normed: g.zeros(r * h)?,
            delta: g.zeros(r * h)?,
            proj: g.zeros(r * proj)?,
            mixed: g.zeros(r * c.conv_dim())?,
            core: g.zeros(r * vd)?,
            mix_out: g.zeros(r * qd.max(vd))?,
            q: g.zeros(r * qd)?,
            qb: g.zeros(r * kd)?,
            kb: g.zeros(r * kd)?,
            vb: g.zeros(r * vd)?,
            gate: g.zeros(r * c.linear_v_heads)?,
            beta: g.zeros(r * c.linear_v_heads)?,
            ws: g.zeros(ws)?,
            xb: g.zeros((r * needs.gemm_k.max(h)).max(1))?,
            wb: g.zeros(needs.gemm_w.max(1))?,
            gu: g.zeros((r * needs.gemm_gu).max(1))?,
            hb: g.zeros((r * needs.inter).max(1))?,
            kvb: g.zeros(1)?,
            stage: g.zeros((r.min(wide_tokens(c)) * needs.wide_stage).max(1))?,
            ffn: FfnBufs::new(g, c, needs, r)?,
            logits: g.zeros(LOGIT_ROWS * c.vocab_size)?,
        })
    }
}
