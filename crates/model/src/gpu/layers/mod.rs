//! The GPU model's layers, one type per kind: token mixers ([`gdn::GdnMixer`],
//! [`attention::AttnMixer`]) behind [`Mixer`], feed-forward blocks ([`dense::DenseFfn`],
//! [`moe::MoeFfn`]) behind [`Ffn`], and the embedding and head ([`head::Head`]). Each owns its
//! device weights, its upload and random fill, its decode enqueue (one or many rows) and its
//! prefill pass, and says what sequence state and scratch it needs. The orchestration (scratch,
//! sequence pool, graph capture, expert residency) is [`super::GpuModel`]'s.
//!
//! A decode step hands each layer a [`Step`] (device, scratch, rows, fused form); a prefill pass
//! a [`Pass`]. Sequence state is two f32 arrays per layer in the pool, `[slots, per_slot]` each
//! ([`StateSpec`]): the mixer says how large and how much of them a snapshot copies.

pub(crate) mod attention;
pub(crate) mod bufs;
pub(crate) mod dense;
pub(crate) mod gdn;
pub(crate) mod head;
pub(crate) mod moe;

use std::any::Any;

use deltamoe_compute::cuda::gemm;
use deltamoe_compute::cuda::ops::{self, Batch, Matvec, Slots};
use deltamoe_compute::cuda::vec::{self, VecIo};
use deltamoe_compute::cuda::{DevBuf, Gpu, Result};

pub(crate) use bufs::{FfnBufs, Needs, PrefillScratch, Scratch};

use super::host_store::Pending;
use super::shard::Shard;

/// Sizes of a layer's two state arrays for one sequence slot (f32s), and what a snapshot of a
/// sequence at position `pos` copies of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StateSpec {
    pub per_slot: [usize; 2],
    /// Floats per position when the arrays are indexed by position (KV caches: a snapshot
    /// copies `pos` rows); None when a snapshot copies them whole (recurrent state).
    pub row: Option<usize>,
}

impl StateSpec {
    /// Floats of each array a snapshot at position `pos` copies.
    pub fn snapshot(&self, pos: usize) -> [usize; 2] {
        match self.row {
            Some(r) => [pos * r, pos * r],
            None => self.per_slot,
        }
    }
}

/// One decode step as the layers see it: `bt.rows` rows, each a sequence in the pool slot
/// `bt.slots[row]`, activations in `s`.
pub(crate) struct Step<'a> {
    pub g: &'a Gpu,
    pub s: &'a Scratch,
    pub bt: Batch,
    /// The fused one-row form (see [`super`]'s doc).
    pub fused: bool,
    /// A verify pass of speculative decoding: the rows are consecutive tokens of the one
    /// sequence in slot `bt.slots[0]` (row r at position pos + r), each bitwise its decode step;
    /// GDN layers keep the states after each token but the last (see [`Mixer::decode`]) and
    /// nothing advances the position.
    pub verify: bool,
    pub eps: f32,
    pub hidden: usize,
    /// Positions per slot `[slots]` and the slots' context.
    pub pos: u64,
    pub ctx: usize,
    /// This GPU's share when several run the model (expert parallel).
    pub shard: Option<&'a Shard>,
}

impl Step<'_> {
    pub fn rows(&self) -> usize {
        self.bt.rows
    }

    /// The scratch's workspace of the wide product form (staged inputs, partial sums):
    /// address and words.
    pub fn workspace(&self) -> (u64, usize) {
        (self.s.part.ptr(), self.s.part.len())
    }

    /// The step's rows of `x_stride` floats, each through one matrix, with the workspace.
    pub fn row_slots(&self, x_stride: usize) -> Slots {
        let (ws, words) = self.workspace();
        Slots::rows(self.rows(), x_stride).with_ws(ws, words)
    }

    /// On every GPU but the first, zero the residual once it has been read: each GPU then adds
    /// its part of a layer's output into it, and an all-reduce gives every GPU the sum (the
    /// residual plus the whole output).
    pub fn residual_to_lead(&self) -> Result<()> {
        match self.shard {
            // SAFETY: x holds the step's rows of `hidden` floats.
            Some(sh) if !sh.lead() => unsafe {
                self.g
                    .zero_raw(self.s.x.ptr(), self.rows() * self.hidden * 4)
            },
            _ => Ok(()),
        }
    }

    /// `x += delta` (when delta ≠ 0), then `normed = rmsnorm(x) · scale`.
    pub fn add_norm(&self, delta: u64, scale: u64) -> Result<()> {
        let s = self.s;
        ops::add_rmsnorm(
            self.g,
            s.x.ptr(),
            delta,
            scale,
            s.normed.ptr(),
            self.rows(),
            self.hidden,
            self.eps,
        )
    }

    /// A mixer's input projection into `proj`: of `normed`, or in the fused form of the residual
    /// rows with the layer's input norm (`norm`) applied as they are staged, plus `io`'s extras
    /// (a conv step takes one row).
    pub fn input_projection(&self, m: Matvec, norm: u64, io: VecIo) -> Result<()> {
        let s = self.s;
        if self.fused {
            let io = VecIo {
                norm,
                eps: self.eps,
                ..io
            };
            let (x, y) = (s.x.ptr(), s.proj.ptr());
            vec::matvec_rows(self.g, m, (x, y), self.rows(), self.hidden, io)?;
            // With the heads divided, the output projections' partial sums meet in the
            // residual.
            match self.shard.is_some_and(|sh| sh.heads()) {
                true => self.residual_to_lead(),
                false => Ok(()),
            }
        } else {
            let rows = self.row_slots(self.hidden);
            ops::matvec(self.g, m, s.normed.ptr(), s.proj.ptr(), rows)
        }
    }

    /// A mixer's output projection of `mix_out`: added into the residual in the fused form,
    /// else into `delta`; with the heads divided, the GPUs' partial sums are then added up.
    pub fn output_projection(&self, m: Matvec) -> Result<()> {
        let s = self.s;
        let out = if self.fused {
            let io = VecIo {
                accumulate: 1,
                ..VecIo::default()
            };
            let (x, y) = (s.mix_out.ptr(), s.x.ptr());
            vec::matvec_rows(self.g, m, (x, y), self.rows(), m.k, io)?;
            y
        } else {
            let rows = self.row_slots(m.k);
            ops::matvec(self.g, m, s.mix_out.ptr(), s.delta.ptr(), rows)?;
            s.delta.ptr()
        };
        self.sum_parts(out)
    }

    /// With the heads divided, the step's rows at `at` are this GPU's partial sums of a mixer's
    /// or dense MLP's output: the all-reduce adds them up on every GPU.
    pub fn sum_parts(&self, at: u64) -> Result<()> {
        match self.shard.filter(|sh| sh.heads()) {
            Some(sh) => sh.all_reduce(self.g, at, self.rows() * self.hidden),
            None => Ok(()),
        }
    }
}

/// How prefill runs the gated delta rule of GDN layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GdnPrefill {
    /// [`GdnPrefill::Chunked`] for passes of at least [`CHUNKED_MIN_ROWS`] tokens,
    /// [`GdnPrefill::Recurrent`] for shorter ones (see [`gdn_path`]). The default.
    #[default]
    Auto,
    /// f32, token by token inside one launch per layer with the decode kernel's arithmetic: the
    /// state a prefill leaves is the one decode steps would leave.
    Recurrent,
    /// The chunked form on tensor cores (`cuda::gdn_chunk`: q, k, v rounded to bf16, bf16
    /// operands with f32 accumulation): 1.4–2.1× the end-to-end prefill speed at 4k tokens, at
    /// about 3e-3 relative per GDN output (as flash-linear-attention's kernel).
    Chunked,
}

/// Passes from this many tokens on take the chunked delta rule under [`GdnPrefill::Auto`]: one
/// full chunk of 64, below which the recurrence does the same work in fewer launches.
pub const CHUNKED_MIN_ROWS: usize = 64;

/// The delta-rule form a pass of `rows` tokens runs under `mode` (never `Auto`).
pub fn gdn_path(mode: GdnPrefill, rows: usize) -> GdnPrefill {
    match mode {
        GdnPrefill::Auto if rows >= CHUNKED_MIN_ROWS => GdnPrefill::Chunked,
        GdnPrefill::Auto => GdnPrefill::Recurrent,
        m => m,
    }
}

/// How prefill runs its matrix products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillGemm {
    /// bf16 activations and weights (affine weights dequantized to bf16 once), f32
    /// accumulation: dense projections through cuBLASLt (the exact kernels where it does not
    /// load), routed experts through the grouped bf16 kernel. The default.
    #[default]
    Bf16,
    /// The exact kernels of decode: weights as stored, inputs split into bf16 hi + lo (about f32
    /// accuracy), for the f32 oracle tests.
    Exact,
}

/// One prefill pass as the layers see it: `t` tokens of the sequence in pool slot `slot`, which
/// has seen `pos0` tokens before them.
pub(crate) struct Pass<'a> {
    pub g: &'a Gpu,
    pub ps: &'a PrefillScratch,
    pub t: usize,
    pub slot: usize,
    pub pos0: usize,
    pub eps: f32,
    pub hidden: usize,
    pub pos: u64,
    pub ctx: usize,
    pub gdn: GdnPrefill,
    pub gemm: PrefillGemm,
    pub shard: Option<&'a Shard>,
}

impl Pass<'_> {
    /// With the heads divided, the pass's `delta` rows are this GPU's partial sums of a mixer's
    /// or dense MLP's output: the all-reduce adds them up on every GPU.
    pub fn sum_parts(&self) -> Result<()> {
        match self.shard.filter(|sh| sh.heads()) {
            Some(sh) => sh.all_reduce(self.g, self.ps.delta.ptr(), self.t * self.hidden),
            None => Ok(()),
        }
    }
}

/// `ops::matvec` (or SwiGLU when `swiglu`) over `t` input rows of `xs` floats.
pub(crate) fn rows_mv(
    g: &Gpu,
    m: Matvec,
    (x, y): (u64, u64),
    t: usize,
    xs: usize,
    swiglu: bool,
) -> Result<()> {
    let sl = Slots::rows(t, xs);
    if swiglu {
        ops::matvec_swiglu(g, m, x, y, sl)
    } else {
        ops::matvec(g, m, x, y, sl)
    }
}

/// A prefill pass's product of `t` rows of `xs` floats (SwiGLU when `swiglu`): under
/// [`PrefillGemm::Bf16`] the rows and weights in bf16 through cuBLASLt, f32 out; else, for a
/// matrix the bf16 path does not take (bias, format, shape), or where cuBLASLt does not load,
/// the exact kernels ([`rows_mv`]).
pub(crate) fn pass_mv(
    p: &Pass,
    m: Matvec,
    (x, y): (u64, u64),
    xs: usize,
    swiglu: bool,
) -> Result<()> {
    let (g, ps, t) = (p.g, p.ps, p.t);
    let blas = match p.gemm {
        PrefillGemm::Bf16 if m.bias == 0 && gemm::supported(&m) => g.blas().ok(),
        _ => None,
    };
    let Some(blas) = blas else {
        return rows_mv(g, m, (x, y), t, xs, swiglu);
    };
    gemm::rows_to_bf16(g, x, xs, ps.xb.ptr(), m.k, t)?;
    let w = gemm::weights_bf16(g, &m, &ps.wb)?;
    let out = if swiglu { ps.gu.ptr() } else { y };
    blas.gemm(g, w, ps.xb.ptr(), out, (m.n, m.k, t))?;
    if swiglu {
        gemm::swiglu_rows(g, out, y, m.n / 2, t)?;
    }
    Ok(())
}

/// The base addresses of a layer's two state arrays in the pool.
pub(crate) type State = [u64; 2];

/// Address of slot `slot`'s part of a state array of `per_slot` floats a slot.
pub(crate) fn slot_at(base: u64, slot: usize, per_slot: usize) -> u64 {
    base + (slot * per_slot * 4) as u64
}

/// A token mixer on the GPU (Gated DeltaNet, gated attention).
pub(crate) trait Mixer {
    /// "gdn" or "attention".
    fn kind(&self) -> &'static str;
    /// Its input and output projections (the fused form needs both taken by the one-row kernel).
    fn projections(&self) -> [Matvec; 2];
    /// Whether its decode can take the fused form at all (a GDN layer whose `[b | a]` rows are
    /// stored apart cannot: the fused input projection has no place for their product).
    fn fusable(&self) -> bool {
        true
    }
    /// Scratch it needs, for prefill passes of `rows` tokens.
    fn needs(&self, rows: usize) -> Needs;
    /// Its state per sequence slot at context `ctx`.
    fn state(&self, ctx: usize) -> StateSpec;
    /// Bytes one decode step reads at context `ctx` (weights, state read and written).
    fn bytes_per_token(&self, ctx: usize) -> usize;
    /// Bytes of its weights (read once per step, whatever the rows).
    fn weight_bytes(&self) -> usize;
    /// Weights one token multiplies.
    fn params(&self) -> usize;
    /// Enqueue a decode step: from `normed` (or the residual, fused, with the input norm
    /// `norm`) to `delta` (or added into the residual, fused). A verify pass ([`Step::verify`])
    /// leaves the states after each of its tokens but the last in `saved` (its state arrays for
    /// one sequence, [`Mixer::saved_floats`] floats a token).
    fn decode(&self, st: &Step, state: State, saved: State, norm: u64) -> Result<()>;
    /// Floats of its two state arrays a verify pass keeps per token: a recurrent state's whole
    /// slot; nothing for KV caches, whose rows past the kept tokens are simply not advanced.
    fn saved_floats(&self, ctx: usize) -> [usize; 2] {
        let spec = self.state(ctx);
        match spec.row {
            Some(_) => [0, 0],
            None => spec.per_slot,
        }
    }
    /// A prefill pass: `normed` rows to `delta` rows, advancing the slot's state.
    fn prefill(&self, p: &Pass, state: State) -> Result<()>;
}

/// A feed-forward block on the GPU (dense SwiGLU MLP, routed experts with a shared expert).
pub(crate) trait Ffn: Any {
    /// Scratch it needs per row.
    fn needs(&self) -> Needs;
    /// Bytes one decode step reads.
    fn bytes_per_token(&self) -> usize;
    /// Bytes a step of `rows` rows must read at least: each weight it touches once (routed
    /// experts as many as uniform routing touches on average, [`expected_distinct`]).
    fn bytes_per_step(&self, rows: usize) -> usize;
    /// Weights one token multiplies.
    fn params(&self) -> usize;
    /// Whether it joins its output to the residual and applies the next norm itself (the
    /// next sublayer then finds `normed` ready).
    fn normalizes_after(&self) -> bool;
    /// In the fused form, whether it normalizes the residual for itself (else the post norm
    /// runs as its own launch).
    fn normalizes_input(&self) -> bool;
    /// Enqueue a decode step on `normed` (see [`FfnIo`]).
    fn decode(&self, st: &Step, io: &FfnIo) -> Result<()>;
    /// A prefill pass: `normed` rows to `delta` rows.
    fn prefill(&self, p: &Pass, stage: &Stager) -> Result<()>;
}

/// Copies the experts a prefill pass's routed ids (`pairs` of them at the buffer) use into a
/// staging stack and returns its `[gate | up]` and down products (offloaded experts only).
pub(crate) type Stager<'a> = dyn Fn(&DevBuf<i32>, usize) -> Result<(Matvec, Matvec)> + 'a;

/// What a decode step's ffn gets from the model around it (device addresses).
pub(crate) struct FfnIo {
    /// The layer's post norm (the router applies it in the fused form).
    pub post_norm: u64,
    /// The norm after the layer: the next layer's input norm, or the final norm.
    pub norm_after: u64,
    /// Where the routed ids go (the offload log, or the scratch).
    pub ids: u64,
    /// The host experts' mailbox when this step hands experts to the host.
    pub mailbox: Option<ops::Mailbox>,
}

/// One decoder layer: `x += mixer(norm(x))`, `x += ffn(norm(x))`.
pub(crate) struct GpuLayer {
    pub input_norm: DevBuf<f32>,
    pub mixer: Box<dyn Mixer>,
    pub post_norm: DevBuf<f32>,
    pub ffn: Box<dyn Ffn>,
}

/// Distinct experts `rows` rows touch on average when each picks `top_k` of `experts` uniformly:
/// `E·(1 − (1 − k/E)^rows)`.
pub(crate) fn expected_distinct(experts: usize, top_k: usize, rows: usize) -> f64 {
    let e = experts.max(1) as f64;
    e * (1.0 - (1.0 - top_k as f64 / e).powi(rows as i32))
}

/// What every layer needs, together, for passes of `rows` rows.
pub(crate) fn needs(layers: &[GpuLayer], rows: usize) -> Needs {
    layers.iter().fold(Needs::default(), |n, l| {
        let [inp, out] = l.mixer.projections();
        let products = Needs::products(&[(inp, false), (out, false)]);
        n.max(l.mixer.needs(rows)).max(l.ffn.needs()).max(products)
    })
}

/// `[gate | up]` rows of an MLP (one matrix on the device).
pub(crate) fn gate_up(m: &crate::checkpoint::Mlp) -> [&crate::checkpoint::LinearWeight; 2] {
    [&m.gate.weight, &m.up.weight]
}

/// A layer's ffn as made, with the routed experts still to be placed when they are offloaded.
pub(crate) type FfnMade<'a> = (Box<dyn Ffn>, Option<Pending<'a>>);

#[cfg(test)]
mod tests {
    use super::{gdn_path, GdnPrefill, CHUNKED_MIN_ROWS};

    #[test]
    fn one_row_touches_its_picks_and_many_rows_touch_every_expert() {
        use super::expected_distinct;
        assert!((expected_distinct(256, 8, 1) - 8.0).abs() < 1e-9);
        let d32 = expected_distinct(256, 8, 32);
        assert!((162.0..165.0).contains(&d32), "{d32}");
        assert!(expected_distinct(256, 8, 1024) > 255.99);
    }

    #[test]
    fn auto_takes_the_chunked_rule_from_one_full_chunk() {
        let auto = GdnPrefill::Auto;
        assert_eq!(gdn_path(auto, 1), GdnPrefill::Recurrent);
        assert_eq!(gdn_path(auto, CHUNKED_MIN_ROWS - 1), GdnPrefill::Recurrent);
        assert_eq!(gdn_path(auto, CHUNKED_MIN_ROWS), GdnPrefill::Chunked);
        assert_eq!(gdn_path(auto, 4096), GdnPrefill::Chunked);
        assert_eq!(gdn_path(GdnPrefill::Recurrent, 4096), GdnPrefill::Recurrent);
        assert_eq!(gdn_path(GdnPrefill::Chunked, 3), GdnPrefill::Chunked);
    }
}
