//! The host threads that compute experts for a decode step ([`super::host_experts`]): every
//! thread of rayon's pool stays awake for the whole step and spins between layers, because a
//! layer's host work is a few tens of microseconds and waking sleeping threads for each layer
//! would cost as much.
//!
//! The step is a sequence of rounds, one per offloaded MoE layer. In round r the leader (pool
//! thread 0) waits for the round's [`Job`] (the GPU's hand-off) and publishes it; then every
//! thread takes pieces of output rows ([`piece_rows`]: about [`PIECE_BYTES`] of weights, so
//! that a single expert keeps every thread busy), first of the experts' SwiGLU, then — once
//! all of those are done — of their down projections, which land in the job's output slots;
//! the leader finishes the round (the answer to the GPU) once every piece is done. Before each
//! of the two, the threads prepare the experts' inputs once each (one piece per expert), for
//! every thread's use. Pieces write disjoint rows, so no locks; counters hand them out.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use deltamoe_compute::cpu::gpu_twin::{self, TwinError, TwinInput};

use super::host_store::LayerExperts;

/// Most output rows per piece of host work.
pub(super) const PIECE_ROWS: usize = 64;

/// Weight bytes a piece of host work aims at: an expert of Qwen3.6-35B-A3B at 4 bits (1.8 MB)
/// makes 36 SwiGLU and 32 down pieces, more than a host has threads.
const PIECE_BYTES: usize = 32 << 10;

/// Output rows per piece when each output reads `out_bytes` of weights: 1 to [`PIECE_ROWS`].
fn piece_rows(out_bytes: usize) -> usize {
    (PIECE_BYTES / out_bytes.max(1)).clamp(1, PIECE_ROWS)
}

/// One round's work: expert `experts[t]` on input `xs[t]`, its output written at
/// `out + slots[t]·hidden`.
pub(super) struct Job<'a> {
    pub lx: &'a LayerExperts,
    pub experts: Vec<usize>,
    pub xs: Vec<&'a [f32]>,
    pub slots: Vec<usize>,
}

/// Where jobs write their outputs: `len` floats from `ptr`, written in disjoint rows.
#[derive(Clone, Copy)]
pub(super) struct Out {
    pub ptr: *mut f32,
    pub len: usize,
}

// SAFETY: the threads of a round write disjoint rows of the buffer (one piece each), and the
// buffer outlives the rounds (the caller's contract on `run_rounds`).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

/// Pieces of one phase of a round, handed out by a counter.
#[derive(Default)]
struct Phase {
    claimed: AtomicUsize,
    done: AtomicUsize,
}

impl Phase {
    /// Take pieces of `0..n` and run `f` on each until none is left, then wait until every
    /// thread's pieces are done. Returns `f`'s first error (its piece still counts as done).
    fn run(
        &self,
        n: usize,
        mut f: impl FnMut(usize) -> Result<(), TwinError>,
    ) -> Result<(), TwinError> {
        let mut first = Ok(());
        loop {
            let i = self.claimed.fetch_add(1, Ordering::Relaxed);
            if i >= n {
                break;
            }
            let r = f(i);
            if first.is_ok() {
                first = r;
            }
            self.done.fetch_add(1, Ordering::Release);
        }
        while self.done.load(Ordering::Acquire) < n {
            std::hint::spin_loop();
        }
        first
    }
}

/// One round's shared state.
#[derive(Default)]
struct Round<'a> {
    job: OnceLock<Option<Job<'a>>>,
    gu_in: Phase,
    gu: Phase,
    down_in: Phase,
    down: Phase,
    /// The SwiGLU outputs `[tasks, inter]` (f32 bits).
    h: OnceLock<Vec<AtomicU32>>,
    /// Each task's prepared inputs: of the SwiGLU, of the down projection.
    x_gu: OnceLock<Vec<OnceLock<TwinInput>>>,
    x_down: OnceLock<Vec<OnceLock<TwinInput>>>,
}

/// Piece i of `tasks` outputs of `width` rows each, `rows` rows a piece: (task, first row,
/// rows).
fn piece(i: usize, width: usize, rows: usize) -> (usize, usize, usize) {
    let per = width.div_ceil(rows);
    let (t, j) = (i / per, i % per);
    let r0 = j * rows;
    (t, r0, rows.min(width - r0))
}

/// Pieces of `tasks` outputs of `width` rows, `rows` rows a piece.
fn pieces(tasks: usize, width: usize, rows: usize) -> usize {
    tasks * width.div_ceil(rows)
}

/// Run `rounds` rounds on every thread of rayon's pool. `next(r)` (called by the leader; it may
/// wait) gives round r's job, None to stop early; `finish(r)` runs on the leader once round r's
/// outputs are all written. Returns the seconds each round took from its job to its finish.
/// `out` must hold every slot a job names and stay valid until this returns.
pub(super) fn run_rounds<'a>(
    rounds: usize,
    out: Out,
    next: impl Fn(usize) -> Option<Job<'a>> + Sync,
    finish: impl Fn(usize) + Sync,
) -> Result<Vec<f64>, TwinError> {
    let state: Vec<Round<'a>> = (0..rounds).map(|_| Round::default()).collect();
    let error: Mutex<Option<TwinError>> = Mutex::new(None);
    let failed = AtomicBool::new(false);
    let fail = |e: TwinError| {
        failed.store(true, Ordering::Relaxed);
        if let Ok(mut slot) = error.lock() {
            slot.get_or_insert(e);
        }
    };
    let times = rayon::broadcast(|ctx| {
        let leader = ctx.index() == 0;
        let mut times = Vec::new();
        for (r, round) in state.iter().enumerate() {
            let t0 = leader.then(|| {
                let job = next(r);
                let t = Instant::now();
                if let Some(j) = &job {
                    let (inter, tasks) = (j.lx.gu.fmt().n / 2, j.experts.len());
                    let h = (0..tasks * inter).map(|_| AtomicU32::new(0));
                    let _ = round.h.set(h.collect());
                    let _ = round
                        .x_gu
                        .set((0..tasks).map(|_| OnceLock::new()).collect());
                    let _ = round
                        .x_down
                        .set((0..tasks).map(|_| OnceLock::new()).collect());
                }
                let _ = round.job.set(job);
                t
            });
            let job = loop {
                if let Some(j) = round.job.get() {
                    break j;
                }
                std::hint::spin_loop();
            };
            let Some(job) = job else { break };
            if !job.experts.is_empty() && !failed.load(Ordering::Relaxed) {
                if let Err(e) = work(job, round, out) {
                    fail(e);
                }
            }
            if let Some(t0) = t0 {
                times.push(t0.elapsed().as_secs_f64());
                finish(r);
            }
        }
        times
    });
    if let Some(e) = error.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok(times.into_iter().next().unwrap_or_default())
}

/// Task `t`'s prepared input, once its phase's preparation is done.
fn input(inputs: &[OnceLock<TwinInput>], t: usize) -> Result<&TwinInput, TwinError> {
    inputs
        .get(t)
        .and_then(OnceLock::get)
        .ok_or_else(|| TwinError::Shape(format!("host expert task {t} has no prepared input")))
}

/// This thread's share of a round: input and SwiGLU pieces, then (after all threads' are done)
/// input and down pieces.
fn work(job: &Job, round: &Round, out: Out) -> Result<(), TwinError> {
    let (lx, tasks) = (job.lx, job.experts.len());
    let (inter, hidden) = (lx.gu.fmt().n / 2, lx.gu.fmt().k);
    let h = round.h.get().map(Vec::as_slice).unwrap_or(&[]);
    let x_gu = round.x_gu.get().map(Vec::as_slice).unwrap_or(&[]);
    let x_down = round.x_down.get().map(Vec::as_slice).unwrap_or(&[]);
    let (gu_rows, down_rows) = (
        piece_rows(2 * lx.gu.row_bytes()),
        piece_rows(lx.down.row_bytes()),
    );
    round.gu_in.run(tasks, |t| {
        let x = TwinInput::new(job.xs[t], &lx.gu.twin(job.experts[t])?)?;
        let _ = x_gu[t].set(x);
        Ok(())
    })?;
    round.gu.run(pieces(tasks, inter, gu_rows), |i| {
        let (t, r0, n) = piece(i, inter, gu_rows);
        let m = lx.gu.twin(job.experts[t])?;
        let mut o = [0f32; PIECE_ROWS];
        gpu_twin::swiglu_rows(&m, inter, input(x_gu, t)?, r0..r0 + n, &mut o[..n])?;
        for (j, v) in o[..n].iter().enumerate() {
            h[t * inter + r0 + j].store(v.to_bits(), Ordering::Relaxed);
        }
        Ok(())
    })?;
    round.down_in.run(tasks, |t| {
        let ht: Vec<f32> = h[t * inter..(t + 1) * inter]
            .iter()
            .map(|v| f32::from_bits(v.load(Ordering::Relaxed)))
            .collect();
        let _ = x_down[t].set(TwinInput::new(&ht, &lx.down.twin(job.experts[t])?)?);
        Ok(())
    })?;
    round.down.run(pieces(tasks, hidden, down_rows), |i| {
        let (t, r0, n) = piece(i, hidden, down_rows);
        let m = lx.down.twin(job.experts[t])?;
        let at = job.slots[t] * hidden + r0;
        if at + n > out.len {
            return Err(TwinError::Shape(format!(
                "host expert output slot {} past the mailbox",
                job.slots[t]
            )));
        }
        // SAFETY: rows at..at + n of `out` (in bounds, checked above) belong to this piece
        // alone: pieces cover disjoint rows of disjoint slots, and the buffer outlives the round.
        let o = unsafe { std::slice::from_raw_parts_mut(out.ptr.add(at), n) };
        gpu_twin::matvec_rows(&m, input(x_down, t)?, r0..r0 + n, o)
    })
}

#[cfg(test)]
mod tests {
    use super::{piece, piece_rows, pieces, PIECE_ROWS};

    #[test]
    fn pieces_cover_every_row_once() {
        for rows in [1usize, 7, 16, PIECE_ROWS] {
            for width in [1usize, 63, 64, 65, 150, 2048] {
                let mut seen = vec![0u8; 3 * width];
                for i in 0..pieces(3, width, rows) {
                    let (t, r0, n) = piece(i, width, rows);
                    assert!((1..=rows).contains(&n));
                    for r in r0..r0 + n {
                        seen[t * width + r] += 1;
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "{width} by {rows}");
            }
        }
    }

    #[test]
    fn one_expert_makes_pieces_for_many_threads() {
        // Qwen3.6-35B-A3B at 4 bits, group 64: a gate + up output reads 2 × 1152 bytes, a down
        // row 288; 512 and 2048 outputs.
        let (gu, down) = (piece_rows(2 * 1152), piece_rows(288));
        assert!(pieces(1, 512, gu) >= 32 && pieces(1, 2048, down) >= 32);
        // bf16 rows of 4096 values (a gate + up output reads 16 KiB): two outputs a piece; an
        // output past 32 KiB: one.
        assert_eq!(piece_rows(2 * 8192), 2);
        assert_eq!(piece_rows(1 << 20), 1);
        assert_eq!(piece_rows(1), PIECE_ROWS);
    }
}
