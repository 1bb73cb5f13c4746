//! CUDA backend: context and stream, device buffers, and the kernel registry.
//!
//! The CUDA driver and NVRTC are loaded at run time (cudarc with dynamic loading), so building
//! needs no CUDA toolkit and a machine without a driver still runs everything on the CPU;
//! [`Gpu::new`] then fails with a one-line error instead of panicking. Kernels are the `.cu`
//! files in `crates/compute/kernels/`, compiled by NVRTC for the device's compute capability and
//! cached on disk (see [`kernels`]). Launch wrappers are in [`ops`].

pub mod attention;
pub mod comm;
pub mod dispatch;
pub mod gdn;
pub mod gdn_chunk;
pub mod gemm;
pub mod host;
pub mod kernels;
pub mod launch;
pub mod moe;
mod nvrtc;
pub mod ops;
pub mod prefill;
pub mod vec;
pub mod wide;

use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    ValidAsZeroBits,
};

pub use kernels::Kernels;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no usable CUDA device: {0}")]
    Unavailable(String),
    #[error("CUDA driver error in {what}: {msg}")]
    Driver { what: String, msg: String },
    #[error("compiling kernel file {file} with NVRTC failed: {log}")]
    Compile { file: String, log: String },
    #[error("{0}")]
    Unsupported(String),
    /// Every reserved slot is in use.
    #[error("{0}")]
    Full(String),
    /// Device memory ran out (see [`out_of_memory`]).
    #[error("{0}")]
    OutOfMemory(String),
}

/// The message of a device allocation of `bytes` that did not fit, with the device's free and
/// total memory at that point.
pub fn out_of_memory(bytes: usize, (free, total): (usize, usize)) -> String {
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    format!(
        "out of GPU memory: {:.2} GiB asked for, {:.2} of {:.2} GiB free",
        gib(bytes),
        gib(free),
        gib(total)
    )
}

pub type Result<T> = std::result::Result<T, CudaError>;

pub(crate) fn driver_err(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver {
        what: what.to_string(),
        msg: e.to_string(),
    }
}

/// A device, its stream and its compiled kernels. All work goes on one stream, in order.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    name: String,
    compute_capability: (i32, i32),
    multiprocessors: usize,
    /// Launch with programmatic dependent launch (see [`launch`]).
    pdl: std::sync::atomic::AtomicBool,
    /// cuBLASLt, created on first use (or why it could not be).
    blas: std::sync::OnceLock<std::result::Result<gemm::Blas, String>>,
}

/// A device allocation of `len` elements with its raw address cached for kernel arguments.
pub struct DevBuf<T> {
    slice: CudaSlice<T>,
    ptr: u64,
}

impl<T> DevBuf<T> {
    /// Device address of element 0 (for kernel arguments).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Device address of element `i`.
    pub fn at(&self, i: usize) -> u64 {
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    pub fn len(&self) -> usize {
        self.slice.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }
}

/// Let `f`, the kernel `name` of either build ([`Kernels::affine`]), take `bytes` of dynamic
/// shared memory (above the default 48 KB).
pub(crate) fn raise_smem_of(f: &CudaFunction, name: &str, bytes: usize) -> Result<()> {
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(driver_err(name))
}

/// Why CUDA cannot be used here, or `None` when a driver, NVRTC and a device are present.
pub fn unavailable_reason() -> Option<String> {
    // SAFETY: only tries to dlopen the libraries; no CUDA call is made.
    let (driver, nvrtc) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    };
    if !driver {
        return Some("the CUDA driver library (libcuda.so) was not found".into());
    }
    if !nvrtc {
        return Some(
            "the NVRTC library (libnvrtc.so) was not found; install the CUDA runtime compiler"
                .into(),
        );
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("the CUDA driver reports no devices".into()),
        Err(e) => Some(format!("the CUDA driver failed to start: {e}")),
    }
}

impl Gpu {
    /// Open device `ordinal`, compile (or load from the cache) every kernel.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        if let Some(why) = unavailable_reason() {
            return Err(CudaError::Unavailable(why));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver_err("opening the device"))?;
        // One stream, ordered work: cudarc's cross-stream event tracking is not needed and would
        // add events to captured graphs.
        // SAFETY: called before any allocation or launch on this context.
        unsafe { ctx.disable_event_tracking() };
        // A created stream, not the legacy default one, so that decode steps can be captured.
        let stream = ctx.new_stream().map_err(driver_err("creating a stream"))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(driver_err("reading the compute capability"))?;
        let name = ctx.name().map_err(driver_err("reading the device name"))?;
        let multiprocessors =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(driver_err("reading the multiprocessor count"))? as usize;
        let kernels = Kernels::load(&ctx, compute_capability)?;
        Ok(Gpu {
            ctx,
            stream,
            kernels,
            name,
            compute_capability,
            multiprocessors,
            pdl: std::sync::atomic::AtomicBool::new(false),
            blas: std::sync::OnceLock::new(),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Streaming multiprocessors of the device (132 on an H100 SXM or H200).
    pub fn multiprocessors(&self) -> usize {
        self.multiprocessors
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Let kernel `name` (of the default build) take `bytes` of dynamic shared memory (above the
    /// default 48 KB).
    pub(crate) fn raise_smem(&self, name: &str, bytes: usize) -> Result<()> {
        raise_smem_of(self.kernels.get(name), name, bytes)
    }

    /// cuBLASLt on this device's stream, created on first use.
    pub fn blas(&self) -> Result<&gemm::Blas> {
        self.blas
            .get_or_init(|| gemm::Blas::new(self).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| CudaError::Unavailable(e.clone()))
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(driver_err("reading memory info"))
    }

    fn wrap<T>(&self, slice: CudaSlice<T>) -> DevBuf<T> {
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(&self.stream);
            ptr
        };
        DevBuf { slice, ptr }
    }

    /// `n` zeroed elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<DevBuf<T>> {
        let s = self.stream.alloc_zeros::<T>(n.max(1)).map_err(|e| {
            self.alloc_err(e, n.max(1) * size_of::<T>(), "allocating device memory")
        })?;
        Ok(self.wrap(s))
    }

    /// A failed allocation of `bytes` as an error: [`CudaError::OutOfMemory`] with the numbers
    /// when the device ran out, else the driver's error during `what`.
    fn alloc_err(&self, e: cudarc::driver::DriverError, bytes: usize, what: &str) -> CudaError {
        use cudarc::driver::sys::CUresult;
        match (e.0, self.mem_info()) {
            (CUresult::CUDA_ERROR_OUT_OF_MEMORY, Ok(mem)) => {
                CudaError::OutOfMemory(out_of_memory(bytes, mem))
            }
            _ => driver_err(what)(e),
        }
    }

    /// A device copy of `data`.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<DevBuf<T>> {
        let s = self
            .stream
            .clone_htod(data)
            .map_err(|e| self.alloc_err(e, size_of_val(data), "copying to the device"))?;
        Ok(self.wrap(s))
    }

    /// Overwrite the start of `dst` with `data`.
    pub fn write<T: DeviceRepr>(&self, dst: &mut DevBuf<T>, data: &[T]) -> Result<()> {
        self.write_at(dst, 0, data)
    }

    /// Overwrite `dst[at..at + data.len()]` with `data`.
    pub fn write_at<T: DeviceRepr>(
        &self,
        dst: &mut DevBuf<T>,
        at: usize,
        data: &[T],
    ) -> Result<()> {
        let mut view = dst.slice.slice_mut(at..at + data.len());
        self.stream
            .memcpy_htod(data, &mut view)
            .map_err(driver_err("copying to the device"))
    }

    /// Zero `dst[at..at + n]`.
    pub fn zero_range<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        dst: &mut DevBuf<T>,
        at: usize,
        n: usize,
    ) -> Result<()> {
        let mut view = dst.slice.slice_mut(at..at + n);
        self.stream
            .memset_zeros(&mut view)
            .map_err(driver_err("zeroing device memory"))
    }

    /// Zero `bytes` bytes at device address `at` (in stream order; captured as a memset).
    ///
    /// # Safety
    /// `at..at + bytes` lies in one allocation on this device.
    pub unsafe fn zero_raw(&self, at: u64, bytes: usize) -> Result<()> {
        cudarc::driver::result::memset_d8_async(at, 0, bytes, self.stream.cu_stream())
            .map_err(driver_err("zeroing device memory"))
    }

    /// Copy `src[from..from + n]` to `dst[to..to + n]` on the device (in stream order).
    pub fn copy<T: DeviceRepr>(
        &self,
        src: &DevBuf<T>,
        from: usize,
        dst: &mut DevBuf<T>,
        to: usize,
        n: usize,
    ) -> Result<()> {
        let view = src.slice.slice(from..from + n);
        let mut out = dst.slice.slice_mut(to..to + n);
        self.stream
            .memcpy_dtod(&view, &mut out)
            .map_err(driver_err("copying on the device"))
    }

    /// Copy the first `n` elements of `src` to the host (waits for the stream).
    pub fn read<T: DeviceRepr + Default + Clone>(
        &self,
        src: &DevBuf<T>,
        n: usize,
    ) -> Result<Vec<T>> {
        self.read_at(src, 0, n)
    }

    /// Copy `src[at..at + n]` to the host (waits for the stream).
    pub fn read_at<T: DeviceRepr + Default + Clone>(
        &self,
        src: &DevBuf<T>,
        at: usize,
        n: usize,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::default(); n];
        let view = src.slice.slice(at..at + n);
        self.stream
            .memcpy_dtoh(&view, &mut out)
            .map_err(driver_err("copying from the device"))?;
        self.sync()?;
        Ok(out)
    }

    /// Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), from `reps`
    /// copies of a `bytes`-sized buffer: the HBM ceiling benchmarks compare against.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64> {
        let a: DevBuf<u8> = self.zeros(bytes)?;
        let mut b: DevBuf<u8> = self.zeros(bytes)?;
        let copy = |b: &mut DevBuf<u8>| {
            self.stream
                .memcpy_dtod(&a.slice, &mut b.slice)
                .map_err(driver_err("copying on the device"))
        };
        copy(&mut b)?;
        self.sync()?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            copy(&mut b)?;
        }
        self.sync()?;
        Ok(2.0 * bytes as f64 * reps as f64 / t0.elapsed().as_secs_f64())
    }

    /// A device timer event (see [`Gpu::mark`], [`Gpu::elapsed_ms`]).
    pub fn timer(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver_err("creating an event"))
    }

    /// Record `ev` at the current point of the stream.
    pub fn mark(&self, ev: &CudaEvent) -> Result<()> {
        ev.record(&self.stream)
            .map_err(driver_err("recording an event"))
    }

    /// Milliseconds between two recorded events (after they completed).
    pub fn elapsed_ms(&self, a: &CudaEvent, b: &CudaEvent) -> Result<f32> {
        a.elapsed_ms(b)
            .map_err(driver_err("reading an event timer"))
    }

    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver_err("synchronizing the stream"))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn out_of_memory_says_what_was_asked_and_what_is_free() {
        let gib = 1usize << 30;
        let m = super::out_of_memory(3 * gib / 2, (gib / 4, 80 * gib));
        assert_eq!(
            m,
            "out of GPU memory: 1.50 GiB asked for, 0.25 of 80.00 GiB free"
        );
    }
}
