//! Collectives between the GPUs of one process through NCCL (loaded at run time, as the driver
//! is): one communicator per GPU, each made on the thread that drives that GPU
//! ([`Comm::join`]), and an in-place f32 sum over the ranks on the GPU's stream, so that a
//! captured decode step holds it like any kernel.
//!
//! Every rank must issue the same collectives in the same order: a rank that stops short
//! leaves the others' kernels waiting on the device.

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

/// This GPU's member of a group of `world` ranks.
pub struct Comm {
    comm: sys::ncclComm_t,
    rank: usize,
    world: usize,
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
        Ok(Comm { comm, rank, world })
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
        // than destroy: a peer that failed must not leave this rank waiting.
        let _ = unsafe { nccl::comm_abort(self.comm) };
    }
}

// SAFETY: an NCCL communicator may be used from any one thread at a time.
unsafe impl Send for Comm {}

fn nccl_err(what: &'static str) -> impl Fn(nccl::NcclError) -> CudaError {
    move |e| CudaError::Driver {
        what: what.to_string(),
        msg: format!("NCCL {:?}", e.0),
    }
}
