//! Expert parallel over the GPUs of one process: each GPU holds every weight but the routed
//! experts, of which it holds a contiguous share ([`expert_share`]), and runs the whole step on
//! the same inputs. Its router picks the same experts as every other GPU's; it computes the
//! picks it holds (the others get id −1 and weight 0 from the router, see moe.cu) and the first
//! GPU adds the shared expert; one all-reduce (sum) per MoE layer then gives every GPU the
//! layer's whole output (see `layers::moe`). Sequence state is the same on every GPU.

use std::ops::Range;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use deltamoe_compute::cuda::comm::Comm;
use deltamoe_compute::cuda::{CudaError, Gpu, Result};

use super::layers::moe::MoeFfn;
use super::GpuModel;

/// This GPU's place among the GPUs that run one model.
pub struct Shard {
    comm: Comm,
    heads: bool,
}

impl Shard {
    /// A place that divides the routed experts only.
    pub fn new(comm: Comm) -> Shard {
        Shard { comm, heads: false }
    }

    /// This place, the token mixers' heads divided too when `on` (tensor parallel, see
    /// `checkpoint::heads`): each GPU's mixer output is then a partial sum, added up by one
    /// all-reduce per mixer.
    pub fn with_heads(self, on: bool) -> Shard {
        Shard { heads: on, ..self }
    }

    /// Whether the mixers' heads are divided among the GPUs.
    pub fn heads(&self) -> bool {
        self.heads
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world()
    }

    /// The communicator's symmetric window, where a step keeps the rows it all-reduces.
    pub fn window(&self) -> Option<u64> {
        self.comm.window()
    }

    /// Whether this GPU runs the parts that one GPU runs for all (the shared expert).
    pub fn lead(&self) -> bool {
        self.rank() == 0
    }

    /// The routed experts of `experts` this GPU holds.
    pub fn experts(&self, experts: usize) -> Range<usize> {
        expert_share(experts, self.rank(), self.world())
    }

    /// Where each of `experts` routed experts is in this GPU's stack, −1 for other GPUs' ones.
    pub fn locations(&self, experts: usize) -> Vec<i32> {
        let own = self.experts(experts);
        (0..experts)
            .map(|e| match own.contains(&e) {
                true => (e - own.start) as i32,
                false => -1,
            })
            .collect()
    }

    /// `x[0..n]` (f32 at a device address on `g`) summed over the GPUs, in place, in stream
    /// order.
    pub(crate) fn all_reduce(&self, g: &Gpu, x: u64, n: usize) -> Result<()> {
        // SAFETY: the callers pass scratch buffers of at least n f32, and every GPU runs the
        // same layers in the same order, so the collectives meet.
        unsafe { self.comm.all_reduce_sum(g, x, n) }
    }
}

impl GpuModel {
    /// Seconds a decode step of `rows` rows spends in its all-reduces alone (one per MoE
    /// layer, and with the heads divided one per mixer and one per dense MLP), on the rows a step
    /// reduces (in the symmetric window when there is one), timed over `reps` replays of a graph
    /// of just those; None on one GPU. Every GPU calls it at the same time, between steps.
    pub fn comm_seconds(&self, rows: usize, reps: usize) -> Result<Option<f64>> {
        let Some(shard) = &self.shard else {
            return Ok(None);
        };
        let g = &self.gpu;
        let layers = self.layers.iter();
        let moe = layers.filter(|l| MoeFfn::of(&*l.ffn).is_some()).count();
        let dense = self.layers.len() - moe;
        let reduces = match shard.heads() {
            true => moe + self.layers.len() + dense,
            false => moe,
        };
        let n = rows * self.hidden;
        let own = match rows <= self.rows {
            true => None,
            false => Some(g.zeros::<f32>(n)?),
        };
        let x = own.as_ref().map_or(self.scratch.x.ptr(), |b| b.ptr());
        let stream = g.stream();
        let capture = |e| CudaError::Unsupported(format!("graph capture: {e}"));
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(capture)?;
        let r = (0..reduces).try_for_each(|_| shard.all_reduce(g, x, n));
        let graph = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(capture)?;
        r?;
        let Some(graph) = graph else {
            return Ok(Some(0.0));
        };
        let launch = || graph.launch().map_err(capture);
        launch()?;
        let (a, b) = (g.timer()?, g.timer()?);
        g.mark(&a)?;
        (0..reps).try_for_each(|_| launch())?;
        g.mark(&b)?;
        g.sync()?;
        Ok(Some(
            g.elapsed_ms(&a, &b)? as f64 / 1e3 / reps.max(1) as f64,
        ))
    }
}

/// The routed experts GPU `rank` of `world` holds of `experts`: contiguous shares, the first
/// `experts % world` GPUs one more.
pub fn expert_share(experts: usize, rank: usize, world: usize) -> Range<usize> {
    let (base, extra) = (experts / world, experts % world);
    let start = rank * base + rank.min(extra);
    start..start + base + (rank < extra) as usize
}

/// [`expert_share`] when every GPU gets at least one expert, else why not.
pub(crate) fn held_share(
    experts: usize,
    rank: usize,
    world: usize,
) -> std::result::Result<Range<usize>, String> {
    match experts >= world {
        true => Ok(expert_share(experts, rank, world)),
        false => Err(format!(
            "{experts} routed experts cannot be divided among {world} GPUs: name at most {experts}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::{expert_share, held_share};

    #[test]
    fn every_gpu_holds_an_expert_or_the_split_is_refused() {
        assert_eq!(held_share(8, 1, 2), Ok(4..8));
        assert_eq!(held_share(4, 3, 4), Ok(3..4));
        let e = held_share(3, 0, 4).unwrap_err();
        assert!(
            e.contains("3 routed experts") && e.contains("4 GPUs"),
            "{e}"
        );
    }

    #[test]
    fn shares_cover_the_experts_once_in_order() {
        for (e, w) in [(256, 2), (512, 4), (10, 3), (3, 4), (1, 1)] {
            let shares: Vec<_> = (0..w).map(|r| expert_share(e, r, w)).collect();
            assert_eq!(shares[0].start, 0);
            assert_eq!(shares[w - 1].end, e);
            for p in shares.windows(2) {
                assert_eq!(p[0].end, p[1].start);
                assert!(p[0].len() >= p[1].len() && p[0].len() - p[1].len() <= 1);
            }
        }
        assert_eq!(expert_share(10, 2, 3), 7..10);
    }
}
