//! Collectives between the GPUs of one process through NCCL (loaded at run time, as the driver
//! is): one communicator per GPU, each made on the thread that drives that GPU
//! ([`Comm::join`]), and an in-place f32 sum over the ranks on the GPU's stream, so that a
//! captured decode step holds it like any kernel.
//!
//! Every rank must issue the same collectives in the same order: a rank that stops short
//! leaves the others' kernels waiting on the device.
//!
//! With NCCL 2.27 or later each member also holds a window: [`WINDOW_BYTES`] of NCCL's own
//! device memory that all ranks registered together as symmetric (`ncclCommWindowRegister`),
//! so that an all-reduce of rows kept there takes NCCL's symmetric kernels (each rank reads its
//! peers' rows directly over NVLink) instead of its staged ring.

use cudarc::nccl::{result as nccl, sys};

use super::{CudaError, Gpu, Result};

/// Why NCCL cannot be used here, or None when its library loads.
pub fn unavailable_reason() -> Option<String> {
    // SAFETY: only tries to dlopen the library; no NCCL call is made.
    let present = unsafe { sys::is_culib_present() };
    (!present).then(|| {
        "the NCCL library (libnccl.so) was not found: install NCCL, or put a libnccl.so link to \
         the libnccl.so.2 of pip's nvidia-nccl package on LD_LIBRARY_PATH"
            .into()
    })
}

/// What all ranks of one group share to find each other (made once, by one of them).
#[derive(Clone, Copy)]
pub struct CommId(sys::ncclUniqueId);

impl CommId {
    /// A new group's id.
    pub fn new() -> Result<CommId> {
        if let Some(why) = unavailable_reason() {
            return Err(CudaError::Unavailable(why));
        }
        nccl::get_uniqueid()
            .map(CommId)
            .map_err(nccl_err("making a communicator id"))
    }
}

// SAFETY: the id is 128 plain bytes.
unsafe impl Send for CommId {}

/// Bytes of each member's symmetric window: a decode step's residual and delta rows (2 × rows ×
/// hidden f32) up to 32 MiB; larger steps keep their rows in ordinary memory.
pub const WINDOW_BYTES: usize = 32 << 20;

/// The first NCCL release (2.27, as `ncclGetVersion` codes it) that registers symmetric windows.
const SYMMETRIC_SINCE: i32 = 22700;

/// This GPU's member of a group of `world` ranks.
pub struct Comm {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
    /// The symmetric window's device address (see the module doc), when NCCL registers one.
    window: Option<u64>,
}

impl Comm {
    /// Joins group `id` as `rank` of `world` with `g`: blocks until every rank has joined, so
    /// the ranks call this at the same time, each on its own thread.
    pub fn join(g: &Gpu, id: CommId, rank: usize, world: usize) -> Result<Comm> {
        let bad = |what: &str| CudaError::Unsupported(format!("a communicator's {what}"));
        let nranks = i32::try_from(world).map_err(|_| bad("size"))?;
        let r = i32::try_from(rank)
            .ok()
            .filter(|&r| r < nranks)
            .ok_or_else(|| bad("rank"))?;
        // NCCL takes the device of the calling thread's current context.
        g.ctx
            .bind_to_thread()
            .map_err(super::driver_err("binding the device"))?;
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is written by NCCL; every rank passes the same id and world.
        unsafe { nccl::comm_init_rank(&mut comm, nranks, id.0, r) }
            .map_err(nccl_err("joining the GPUs' communicator"))?;
        let mut c = Comm {
            comm,
            rank,
            world,
            window: None,
        };
        if nccl::get_nccl_version().unwrap_or(0) >= SYMMETRIC_SINCE {
            c.window = Some(c.register_window(g)?);
        }
        Ok(c)
    }

    /// Allocates and registers this member's window, zeroed; every rank calls it (NCCL's
    /// registration is collective), so a failure is the join's.
    fn register_window(&self, g: &Gpu) -> Result<u64> {
        let mut p = std::ptr::null_mut();
        // SAFETY: NCCL writes the address of WINDOW_BYTES of device memory to `p`.
        unsafe { sys::ncclMemAlloc(&mut p, WINDOW_BYTES) }
            .result()
            .map_err(nccl_err("allocating the symmetric window"))?;
        let mut win = std::ptr::null_mut();
        // SAFETY: `p` holds WINDOW_BYTES from ncclMemAlloc; every rank registers the same size.
        let r = unsafe {
            sys::ncclCommWindowRegister(self.comm, p, WINDOW_BYTES, &mut win, WIN_COLL_SYMMETRIC)
        };
        if let Err(e) = r
            .result()
            .map_err(nccl_err("registering the symmetric window"))
        {
            // SAFETY: `p` came from ncclMemAlloc and is not registered.
            unsafe { sys::ncclMemFree(p) };
            return Err(e);
        }
        let at = p as u64;
        // SAFETY: the window holds WINDOW_BYTES.
        unsafe { g.zero_raw(at, WINDOW_BYTES) }?;
        Ok(at)
    }

    /// The device address of this member's symmetric window ([`WINDOW_BYTES`]), if any: rows
    /// an all-reduce sums there are at the same offset on every rank.
    pub fn window(&self) -> Option<u64> {
        self.window
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// `x[0..n] ←` the sum over the ranks of their `x[0..n]` (f32, in place), on `g`'s stream.
    ///
    /// # Safety
    /// `x` is a device address on `g` holding `n` f32, and every rank calls this with the same
    /// `n` in the same position of its stream's work.
    pub unsafe fn all_reduce_sum(&self, g: &Gpu, x: u64, n: usize) -> Result<()> {
        let stream = g.stream().cu_stream();
        let p = x as *mut std::ffi::c_void;
        nccl::all_reduce(
            p,
            p,
            n,
            sys::ncclDataType_t::ncclFloat32,
            sys::ncclRedOp_t::ncclSum,
            self.comm,
            stream as sys::cudaStream_t,
        )
        .map(|_| ())
        .map_err(nccl_err("an all-reduce"))
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: the communicator was made by join and is not used after this. Abort rather
        // than destroy: a peer that failed must not leave this rank waiting. Aborting releases
        // the window's registration, after which its memory is freed.
        let _ = unsafe { nccl::comm_abort(self.comm) };
        if let Some(at) = self.window {
            // SAFETY: the window came from ncclMemAlloc; nothing uses it once the model that
            // holds this member is gone.
            let _ = unsafe { sys::ncclMemFree(at as *mut std::ffi::c_void) };
        }
    }
}

/// `ncclCommWindowRegister`'s flag for a window of symmetric collectives (nccl.h).
const WIN_COLL_SYMMETRIC: i32 = 1;

fn nccl_err(what: &'static str) -> impl Fn(nccl::NcclError) -> CudaError {
    move |e| CudaError::Driver {
        what: what.to_string(),
        msg: format!("NCCL {:?}", e.0),
    }
}
