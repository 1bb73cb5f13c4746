//! Routed experts with a shared expert on the GPU: the router `[experts | shared gate]` and its
//! top-k, each row's picked experts' SwiGLU and down products (all rows' picks in one launch
//! each; grouped by expert in prefill), the shared expert (stacked as one more expert when it has
//! their shape and format, so it runs in the same launches) and the weighted combine. With
//! offload the expert stacks are the device cache and `offload` says where every expert lives
//! (see [`crate::gpu::offload`]).
use std::any::Any;
use std::ops::Range;

use deltamoe_compute::cuda::dispatch;
use deltamoe_compute::cuda::gemm::{self, TILE_GEMM};
use deltamoe_compute::cuda::ops::{self, Route, Slots};
use deltamoe_compute::cuda::prefill::{self as pf, Grouped};
use deltamoe_compute::cuda::vec::{self, VecIo};
use deltamoe_compute::cuda::wide;
use deltamoe_compute::cuda::{CudaError, DevBuf, Gpu, Result};

use super::{
    expected_distinct, gate_up, pass_mv, Ffn, FfnBufs, FfnIo, FfnMade, Needs, Pass, PrefillGemm,
    Stager, Step,
};
use crate::checkpoint::{LinearWeight, Moe};
use crate::config::ModelConfig;
use crate::gpu::format::{DevFormat, DevMat, Fmt};
use crate::gpu::host_store::{Dest, ExpertSource, Held, LayerExperts, Pending};
use crate::gpu::random::{Filler, SeededExperts};
use crate::gpu::shard::{held_share, Shard};

pub(crate) struct MoeFfn {
    pub router: DevMat,
    /// Routed experts stacked `[E (+1), …]` (with offload: the cache `[slots (+1), …]`).
    pub experts_gu: DevMat,
    pub experts_down: DevMat,
    /// The shared expert's `[gate | up]` and down when it could not be stacked as expert E.
    pub shared: Option<(DevMat, DevMat)>,
    pub offload: Option<Box<LayerExperts>>,
    /// Routed experts, picks per row, and whether the picks' weights are renormalized.
    pub experts: usize,
    top_k: usize,
    renorm: bool,
    /// Routed experts in the stacks: all of them, or this GPU's share.
    held: usize,
    /// With several GPUs, where each routed expert is here (see [`crate::gpu::shard`]).
    part: Option<ExpertPart>,
}

/// An MoE layer's share of the routed experts on one GPU of several.
struct ExpertPart {
    /// Each routed expert's index in the stacks, −1 for other GPUs' ones.
    loc: DevBuf<i32>,
    /// Whether this GPU adds the shared expert (one of them does).
    shared_here: bool,
}

impl ExpertPart {
    fn new(g: &Gpu, s: &Shard, experts: usize) -> Result<ExpertPart> {
        Ok(ExpertPart {
            loc: g.upload(&s.locations(experts))?,
            shared_here: s.lead(),
        })
    }
}

/// The buffers of an MoE layer's end (device addresses; see [`MoeFfn::tail`]).
struct Tail {
    normed: u64,
    hs: u64,
    ys: u64,
    sg: u64,
    y: u64,
    weights: u64,
    delta: u64,
}

/// Where an MoE layer's end writes: `delta` (None), or the residual `x` it joins, with the
/// norm after the layer applied into `normed` when `scale` is set.
struct NextNorm {
    x: u64,
    scale: Option<u64>,
}

impl MoeFfn {
    /// A loaded MoE layer (number `layer`) on the device; with `offload` its expert stacks start
    /// empty and the routed experts are returned to be placed; with `shard` only this GPU's
    /// share of them is uploaded (or placed).
    pub fn upload<'a>(
        g: &Gpu,
        m: &'a Moe,
        (layer, hidden): (usize, usize),
        offload: bool,
        shard: Option<&Shard>,
    ) -> Result<FfnMade<'a>> {
        let (e, i) = (m.experts.len(), m.experts[0].gate.out_features());
        check(e, m.top_k)?;
        let si = m.shared.gate.out_features();
        let stacked = si == i && m.shared.gate.weight.stored_alike(&m.experts[0].gate.weight);
        let held = share(shard, e)?;
        let mlps = m.experts[held.own.clone()]
            .iter()
            .chain(stacked.then_some(&m.shared));
        let gu: Vec<&LinearWeight> = mlps.clone().flat_map(gate_up).collect();
        let down: Vec<&LinearWeight> = mlps.map(|x| &x.down.weight).collect();
        let shared = match stacked {
            true => None,
            false => Some((
                DevMat::stack(g, &gate_up(&m.shared), 2 * si, hidden, None)?,
                DevMat::of(g, &m.shared.down)?,
            )),
        };
        let router_parts = [&m.router.weight, &m.shared_gate.weight];
        let router = DevMat::stack(g, &router_parts, e + 1, hidden, None)?;
        let (gu_fmt, down_fmt) = (
            Fmt::new(2 * i, hidden, DevFormat::of(&gu)),
            Fmt::new(hidden, i, DevFormat::of(&down)),
        );
        let experts = if offload {
            let src = LoadedExperts {
                gu,
                down,
                formats: (gu_fmt, down_fmt),
            };
            placed_later(g, (layer, held.clone(), stacked), Box::new(src))?
        } else {
            let gu_mat = DevMat::stack(g, &gu, 2 * i, hidden, None)?;
            (gu_mat, DevMat::stack(g, &down, hidden, i, None)?, None)
        };
        let routing = (e, m.top_k, m.norm_topk_prob);
        let part = shard.map(|s| ExpertPart::new(g, s, e)).transpose()?;
        Ok(made(router, experts, shared, routing, (held.len(), part)))
    }

    /// Random weights of config `c`'s shape for MoE layer `layer` (the experts made where they
    /// are placed when `offload`).
    pub fn random<'a>(
        f: &mut Filler,
        c: &ModelConfig,
        layer: usize,
        offload: bool,
        shard: Option<&Shard>,
    ) -> Result<FfnMade<'a>> {
        let (h, e, n, sn) = (
            c.hidden_size,
            c.num_experts,
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size,
        );
        check(e, c.experts_per_token)?;
        let held = share(shard, e)?;
        // As on upload: a shared expert of the experts' shape and format is stacked as expert E.
        let stacked = sn == n && f.shared_like_routed();
        let shared = match stacked {
            true => None,
            false => Some((f.mats(1, 2 * sn, h)?, f.mats(1, h, sn)?)),
        };
        let router = f.router(e + 1, h)?;
        let experts = if offload {
            let src = SeededExperts::new(f, ((2 * n, h), (h, n)), held.clone());
            placed_later(f.g, (layer, held.clone(), stacked), Box::new(src))?
        } else {
            // This GPU's share and the shared expert, of the stack one GPU would hold.
            let parts = [held.own.clone(), e..e + stacked as usize];
            (
                f.expert_mats_of(&parts, 2 * n, h)?,
                f.expert_mats_of(&parts, h, n)?,
                None,
            )
        };
        let routing = (e, c.experts_per_token, c.norm_topk_prob);
        let part = shard.map(|s| ExpertPart::new(f.g, s, e)).transpose()?;
        Ok(made(router, experts, shared, routing, (held.len(), part)))
    }

    /// `ffn` as a routed-experts block, when it is one (expert residency reaches into it).
    pub fn of(ffn: &dyn Ffn) -> Option<&MoeFfn> {
        (ffn as &dyn Any).downcast_ref()
    }

    pub fn of_mut(ffn: &mut dyn Ffn) -> Option<&mut MoeFfn> {
        (ffn as &mut dyn Any).downcast_mut()
    }

    /// Expert slots per row: the picks and the stacked shared expert.
    pub fn per_row(&self) -> usize {
        self.top_k + self.shared.is_none() as usize
    }

    /// `f` summed over the matrices one token multiplies here: the router, each of its expert
    /// slots (on one GPU of several, its share of the picks on average) and the shared expert
    /// when it runs apart.
    fn per_token(&self, f: impl Fn(&DevMat) -> usize) -> usize {
        let experts = f(&self.experts_gu) + f(&self.experts_down);
        let here = self.shared_here() as usize;
        let shared = here * self.shared.as_ref().map_or(0, |(gu, d)| f(gu) + f(d));
        let slots =
            self.top_k as f64 * self.share() + (here * self.shared.is_none() as usize) as f64;
        f(&self.router) + (slots * experts as f64).round() as usize + shared
    }

    /// The fraction of the routed experts held here.
    fn share(&self) -> f64 {
        self.held as f64 / self.experts as f64
    }

    /// The router's top-k as uploaded (every expert held at its own index, or this GPU's share
    /// at theirs).
    fn route(&self) -> Route {
        Route {
            experts: self.experts,
            top_k: self.top_k,
            renorm: self.renorm,
            shared_gate: true,
            shared_slot: self.shared.is_none().then_some(self.held),
            loc: self.part.as_ref().map_or(0, |p| p.loc.ptr()),
            host_take: 0,
            far_from: 0,
            shared_here: self.shared_here(),
        }
    }

    /// Whether this GPU adds the shared expert.
    fn shared_here(&self) -> bool {
        self.part.as_ref().is_none_or(|p| p.shared_here)
    }

    /// Words per token of the wide kernels' staged inputs: its `[gate | up]` input or the
    /// hidden rows of its slots, whichever is larger.
    fn wide_stage_words(&self) -> usize {
        let (gu, dn) = (self.experts_gu.mv(), self.experts_down.mv());
        let down = self.per_row() * dispatch::wide_staged_words(&dn, 1);
        dispatch::wide_staged_words(&gu, 1).max(down)
    }

    /// The tile of a decode step of `rows` rows whose expert products run grouped by expert
    /// (see `dispatch::grouped_decode_tile`); None with offloaded experts, which run per slot.
    fn grouped_decode(&self, rows: usize) -> Option<usize> {
        let (gu, down) = (self.experts_gu.mv(), self.experts_down.mv());
        let strides = (self.router.k, self.experts_gu.n / 2);
        let routing = (rows, self.top_k, self.experts);
        self.offload
            .is_none()
            .then(|| dispatch::grouped_decode_tile(&gu, &down, strides, routing))?
    }

    /// The expert products of `rows` rows (routed `ids`, inputs `x`, `h` floats apart) grouped
    /// by expert in tiles of `tile` pairs: hidden rows into `fb.h`, outputs into `fb.y`; `ws`
    /// (address, words) holds the wide kernels' staged inputs.
    fn grouped_products(
        &self,
        g: &Gpu,
        fb: &FfnBufs,
        (ids, x, h): (u64, u64, usize),
        (rows, tile): (usize, usize),
        ws: (u64, usize),
    ) -> Result<()> {
        let (gr, down) = self.group(g, fb, (ids, rows), (tile, h))?;
        // Blocks for the tiles expected: the distinct experts picked (a tenth more), the shared
        // expert's; a block takes any tiles beyond.
        let distinct = expected_distinct(self.experts, self.top_k, rows) * 1.1;
        let shared = self.shared.is_none() as usize * rows.div_ceil(tile);
        let blocks = distinct.ceil() as usize + shared + 1;
        let (gu, dn) = (self.experts_gu.mv(), self.experts_down.mv());
        // The wide kernels stream each expert's weights through shared memory; split-K takes
        // the matrices they do not.
        let run = |m, io, gr, swiglu, x_rows| match dispatch::wide_takes(&m) {
            true => wide::grouped(g, m, io, gr, swiglu, blocks, (x_rows, ws)),
            false => pf::grouped_split(g, m, io, gr, swiglu, blocks),
        };
        run(gu, (x, fb.h.ptr()), gr, true, rows)?;
        run(
            dn,
            (fb.h.ptr(), fb.y.ptr()),
            down,
            false,
            rows * self.per_row(),
        )
    }

    /// The (row, slot) pairs of `rows` rows (routed `ids`) sorted by expert in tiles of `tile`
    /// (`fb.order`, `fb.tiles`, `fb.n_tiles`), and how the `[gate | up]` products (inputs `h`
    /// floats apart, one a row) and the down products (the hidden rows, one a pair) read them.
    fn group(
        &self,
        g: &Gpu,
        fb: &FfnBufs,
        (ids, rows): (u64, usize),
        (tile, h): (usize, usize),
    ) -> Result<(Grouped, Grouped)> {
        let per_row = self.per_row();
        let (pairs, stacked) = (rows * per_row, self.held + self.shared.is_none() as usize);
        let (order, tiles, n_tiles) = (fb.order.ptr(), fb.tiles.ptr(), fb.n_tiles.ptr());
        pf::moe_group(g, ids, pairs, stacked, tile, order, tiles, n_tiles)?;
        let gate_up = Grouped {
            order,
            tiles,
            n_tiles,
            tile,
            max_tiles: pf::max_tiles(pairs, stacked, tile),
            x_stride: h,
            x_div: per_row,
        };
        let down = Grouped {
            x_stride: self.experts_gu.n / 2,
            x_div: 1,
            ..gate_up
        };
        Ok((gate_up, down))
    }

    /// The layer's end for `rows` rows: the shared expert when it runs apart (SwiGLU of
    /// `normed` into `hs`, down into `ys`; `ws` the products' workspace, see `Slots::with_ws`),
    /// then `delta = Σ_k w_k y_k (+ sg · ys)`; with `next`, that sum joins the residual `next.x`
    /// instead and `normed` gets the next norm of it.
    fn tail(
        &self,
        g: &Gpu,
        (m, normed, delta): (&FfnBufs, u64, u64),
        (rows, ws): (usize, (u64, usize)),
        next: Option<NextNorm>,
        eps: f32,
    ) -> Result<()> {
        let (per_row, h) = (self.per_row(), self.router.k);
        let t = Tail {
            normed,
            hs: m.hs.ptr(),
            ys: m.ys.ptr(),
            sg: m.sg.ptr(),
            y: m.y.ptr(),
            weights: m.weights.ptr(),
            delta,
        };
        let (ys, sg) = match &self.shared {
            Some((gu, down)) if self.shared_here() => {
                let slots = |k| Slots::rows(rows, k).with_ws(ws.0, ws.1);
                ops::matvec_swiglu(g, gu.mv(), t.normed, t.hs, slots(h))?;
                ops::matvec(g, down.mv(), t.hs, t.ys, slots(down.k))?;
                (t.ys, t.sg)
            }
            _ => (0, 0),
        };
        let (w, y) = (t.weights, t.y);
        match next {
            Some(NextNorm { x, scale: Some(sc) }) => {
                ops::moe_combine_norm(g, y, w, ys, sg, x, sc, t.normed, per_row, h, rows, eps)
            }
            Some(NextNorm { x, scale: None }) => {
                ops::moe_combine(g, y, w, ys, sg, x, per_row, h, rows, true)
            }
            None => ops::moe_combine(g, y, w, ys, sg, t.delta, per_row, h, rows, false),
        }
    }
}

/// Expert stacks and, when the experts are placed later, where they come from.
type Experts<'a> = (DevMat, DevMat, Option<Pending<'a>>);

/// Empty device stacks in `src`'s formats for MoE layer `layer` (`experts` routed ones, the shared
/// one `stacked` after them), its experts to be placed from `src`.
fn placed_later<'a>(
    g: &Gpu,
    (layer, held, stacked): (usize, Held, bool),
    src: Box<dyn ExpertSource + 'a>,
) -> Result<Experts<'a>> {
    let (fg, fd) = src.formats();
    let stacks = (fg.device_stack(g, 0)?, fd.device_stack(g, 0)?);
    let p = Pending::new(layer, held, stacked, src);
    Ok((stacks.0, stacks.1, Some(p)))
}

/// The block of `router`, `experts` and `shared`, routing to `top_k` of `e` experts
/// (`renorm`: the picks' weights renormalized), `held` of them in the stacks (`part` says which).
fn made<'a>(
    router: DevMat,
    (experts_gu, experts_down, pending): Experts<'a>,
    shared: Option<(DevMat, DevMat)>,
    (e, top_k, renorm): (usize, usize, bool),
    (held, part): (usize, Option<ExpertPart>),
) -> FfnMade<'a> {
    let ffn = MoeFfn {
        router,
        experts_gu,
        experts_down,
        shared,
        offload: None,
        experts: e,
        top_k,
        renorm,
        held,
        part,
    };
    (Box::new(ffn), pending)
}

/// The routed experts of `experts` held here: all, or this GPU's share.
fn share(shard: Option<&Shard>, experts: usize) -> Result<Held> {
    let own = match shard {
        Some(s) => held_share(experts, s.rank(), s.world()).map_err(CudaError::Unsupported)?,
        None => 0..experts,
    };
    Ok(Held {
        own,
        total: experts,
    })
}

/// The expert counts the CUDA router takes.
fn check(experts: usize, top_k: usize) -> Result<()> {
    if experts > 1024 || top_k > 32 {
        return Err(CudaError::Unsupported(format!(
            "{experts} experts / top-{top_k} exceed the CUDA router limits (1024 / 32)"
        )));
    }
    Ok(())
}

impl Ffn for MoeFfn {
    fn needs(&self) -> Needs {
        Needs {
            proj: 0,
            // Room for the shared expert stacked as one more slot.
            inter: self.experts_gu.n / 2 * (self.top_k + 1),
            shared: self.shared.as_ref().map_or(0, |(gu, _)| gu.n / 2),
            workspace: 0,
            wide_stage: self.wide_stage_words(),
            ..Needs::products(&[(self.router.mv(), false)])
        }
    }

    fn bytes_per_token(&self) -> usize {
        self.per_token(DevMat::bytes)
    }

    fn bytes_per_step(&self, rows: usize) -> usize {
        let expert = self.experts_gu.bytes() + self.experts_down.bytes();
        let here = self.shared_here() as usize;
        let stacked = here * self.shared.is_none() as usize;
        let routed = expected_distinct(self.experts, self.top_k, rows) * self.share();
        let distinct = routed + stacked as f64;
        let shared = here
            * self
                .shared
                .as_ref()
                .map_or(0, |(gu, d)| gu.bytes() + d.bytes());
        self.router.bytes() + shared + (distinct * expert as f64) as usize
    }

    fn params(&self) -> usize {
        self.per_token(DevMat::params)
    }

    fn normalizes_after(&self) -> bool {
        true
    }

    fn normalizes_input(&self) -> bool {
        vec::takes(&self.router.mv(), &Slots::one())
    }

    /// On one GPU of several, the other GPUs leave the residual to the first (they zero theirs
    /// once the router has read it), each adds its experts' part into it, and the all-reduce
    /// sums the parts; the next norm then runs as its own launch unless the form is fused.
    fn decode(&self, st: &Step, io: &FfnIo) -> Result<()> {
        self.decode_here(st, io)?;
        let Some(shard) = st.shard else {
            return Ok(());
        };
        shard.all_reduce(st.g, st.s.x.ptr(), st.rows() * st.hidden)?;
        match st.fused {
            true => Ok(()),
            false => st.add_norm(0, io.norm_after),
        }
    }

    fn prefill(&self, p: &Pass, stage: &Stager) -> Result<()> {
        self.prefill_here(p, stage)?;
        match p.shard {
            Some(shard) => shard.all_reduce(p.g, p.ps.delta.ptr(), p.t * p.hidden),
            None => Ok(()),
        }
    }
}

impl MoeFfn {
    /// A decode step's experts on this GPU (all of them, or its share): see [`Ffn::decode`].
    fn decode_here(&self, st: &Step, io: &FfnIo) -> Result<()> {
        let (g, s, h, b) = (st.g, st.s, st.hidden, st.rows());
        let fb = &s.ffn;
        let (i_e, per_row) = (self.experts_gu.n / 2, self.per_row());
        let mut route = self.route();
        let (mut far_gu, mut far_down) = (None, None);
        let mailbox = self.offload.as_ref().and(io.mailbox);
        if let Some(lx) = &self.offload {
            route.shared_slot = lx.shared_slot();
            route.loc = lx.loc();
            route.far_from = lx.split();
            if let Some(m) = mailbox {
                route.host_take = m.take;
            }
            (far_gu, far_down) = (Some(lx.far_gu()), Some(lx.far_down()));
        }
        let (ids, n, router) = (io.ids, b * per_row, self.router.mv());
        if st.fused && self.normalizes_input() {
            // The post norm of x, staged by every block; block 0 leaves it in `normed`.
            let vio = VecIo {
                norm: io.post_norm,
                normed: s.normed.ptr(),
                eps: st.eps,
                ..VecIo::default()
            };
            let (x, y) = (s.x.ptr(), fb.router.ptr());
            vec::matvec_rows(g, router, (x, y), b, h, vio)?;
        } else {
            let rows = st.row_slots(h);
            ops::matvec(g, router, s.normed.ptr(), fb.router.ptr(), rows)?;
        }
        let (w, sg) = (fb.weights.ptr(), fb.sg.ptr());
        ops::router_topk(g, fb.router.ptr(), router.n, route, ids, w, sg, b)?;
        st.residual_to_lead()?;
        if let Some(m) = mailbox {
            ops::host_experts_publish(g, m, s.normed.ptr(), ids, per_row, h, b)?;
        }
        let down = self.experts_down.mv();
        if let Some(tile) = self.grouped_decode(b) {
            let ws = st.workspace();
            self.grouped_products(g, fb, (ids, s.normed.ptr(), h), (b, tile), ws)?;
        } else {
            let gu_slots = Slots::experts(n, ids, h, per_row).with_far(far_gu);
            let gu = self.experts_gu.mv();
            ops::matvec_swiglu(g, gu, s.normed.ptr(), fb.h.ptr(), gu_slots)?;
            let down_slots = Slots::experts(n, ids, i_e, 1).with_far(far_down);
            let direct = self.shared.is_none() && mailbox.is_none();
            if st.fused && direct && ops::down_combine_takes(&down, per_row) {
                // The down projections add their weighted sum into the residual themselves.
                let (x, w) = (s.x.ptr(), fb.weights.ptr());
                return ops::moe_down_combine(g, down, fb.h.ptr(), x, w, down_slots, per_row, b);
            }
            ops::matvec(g, down, fb.h.ptr(), fb.y.ptr(), down_slots)?;
        }
        if let Some(m) = mailbox {
            ops::host_experts_wait(g, m, ids, fb.y.ptr(), h, n)?;
        }
        let next = NextNorm {
            x: s.x.ptr(),
            scale: (!st.fused && st.shard.is_none()).then_some(io.norm_after),
        };
        let bufs = (fb, s.normed.ptr(), s.delta.ptr());
        self.tail(g, bufs, (b, st.workspace()), Some(next), st.eps)
    }

    /// A prefill pass's experts on this GPU into `delta`: see [`Ffn::prefill`].
    fn prefill_here(&self, p: &Pass, stage: &Stager) -> Result<()> {
        let (g, ps, t, h) = (p.g, p.ps, p.t, p.hidden);
        let fb = &ps.ffn;
        let (i_e, ks) = (self.experts_gu.n / 2, self.per_row());
        let (ids, pairs, router) = (fb.ids.ptr(), t * ks, self.router.mv());
        pass_mv(p, router, (ps.normed.ptr(), fb.router.ptr()), h, false)?;
        let (w, sg) = (fb.weights.ptr(), fb.sg.ptr());
        ops::router_topk(g, fb.router.ptr(), router.n, self.route(), ids, w, sg, t)?;
        let (gu, dn) = match self.offload {
            Some(_) => stage(&fb.ids, pairs)?,
            None => (self.experts_gu.mv(), self.experts_down.mv()),
        };
        let bf16 = p.gemm == PrefillGemm::Bf16;
        let (room, routing) = (t * self.wide_stage_words(), (t, self.top_k, self.experts));
        let wide = dispatch::prefill_wide_tile(&gu, &dn, (h, i_e), routing)
            .filter(|_| self.offload.is_none() && ps.stage.len() >= room);
        if let Some(tile) = wide {
            let ws = (ps.stage.ptr(), ps.stage.len());
            self.grouped_products(g, fb, (ids, ps.normed.ptr(), h), (t, tile), ws)?;
        } else if let Some(tile) = dispatch::grouped_tile(&gu, &dn, h, i_e, bf16) {
            let (gr, down) = self.group(g, fb, (ids, t), (tile, h))?;
            if tile == TILE_GEMM {
                gemm::rows_to_bf16(g, ps.normed.ptr(), h, ps.xb.ptr(), h, t)?;
                gemm::grouped_gemm(g, gu, ps.xb.ptr(), ps.hb.ptr(), gr, true)?;
                gemm::grouped_gemm(g, dn, ps.hb.ptr(), fb.y.ptr(), down, false)?;
            } else {
                pf::grouped_swiglu(g, gu, ps.normed.ptr(), fb.h.ptr(), gr)?;
                pf::grouped_matvec(g, dn, fb.h.ptr(), fb.y.ptr(), down)?;
            }
        } else {
            let gu_slots = Slots::experts(pairs, ids, h, ks);
            ops::matvec_swiglu(g, gu, ps.normed.ptr(), fb.h.ptr(), gu_slots)?;
            let down_slots = Slots::experts(pairs, ids, i_e, 1);
            ops::matvec(g, dn, fb.h.ptr(), fb.y.ptr(), down_slots)?;
        }
        self.tail(
            g,
            (fb, ps.normed.ptr(), ps.delta.ptr()),
            (t, (0, 0)),
            None,
            p.eps,
        )
    }
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
            let data = fmt.format.arrays(&parts[e * per..(e + 1) * per]);
            let at = (to.at + j) as u64;
            for (src, &(d, bytes)) in data.iter().zip(to.arrays) {
                // SAFETY: `src` is one matrix's array (`bytes` bytes, the format's size) and
                // `to` holds matrix at; a copy from pageable memory returns once the source
                // has been read.
                unsafe { g.copy_raw(d + at * bytes as u64, src.as_ptr() as u64, bytes)? };
            }
        }
        Ok(())
    }
}
