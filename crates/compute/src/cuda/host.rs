//! Pinned host memory the GPU reads directly (mapped into the device's address space): where
//! offloaded expert weights live. Kernels read it over PCIe like device memory (see the far
//! stacks of [`super::ops::Far`]), and copies from it run at the link's full speed.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUstream};
use cudarc::driver::{CudaContext, DeviceRepr};
use rayon::prelude::*;

use super::ops::Slots;
use super::{driver_err, CudaError, DevBuf, Gpu, Result};

/// `len` elements of page-locked host memory, mapped for the device (UVA: one address for
/// host and device).
pub struct HostBuf<T> {
    ptr: *mut T,
    len: usize,
    dev: u64,
    ctx: Arc<CudaContext>,
    _t: PhantomData<T>,
}

// SAFETY: the allocation is owned by this value and freed once, in Drop; access from the host
// goes through &/&mut borrows like a Vec's.
unsafe impl<T: Send> Send for HostBuf<T> {}
// SAFETY: as above; shared borrows only read.
unsafe impl<T: Sync> Sync for HostBuf<T> {}

impl<T: DeviceRepr> HostBuf<T> {
    /// `len` elements of pinned, device-mapped memory with unspecified contents.
    ///
    /// # Safety
    /// Every element must be written before it is read.
    unsafe fn alloc(g: &Gpu, len: usize) -> Result<HostBuf<T>> {
        let bytes = len.max(1) * std::mem::size_of::<T>();
        g.ctx
            .bind_to_thread()
            .map_err(driver_err("binding the context"))?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a fresh allocation of `bytes`, initialised by the caller before any read.
        let raw = unsafe { cudarc::driver::result::malloc_host(bytes, flags) }.map_err(|e| {
            CudaError::Driver {
                what: format!(
                    "pinning {:.1} GiB of host memory for offloaded weights",
                    bytes as f64 / (1u64 << 30) as f64
                ),
                msg: e.to_string(),
            }
        })?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: raw was returned by cuMemHostAlloc with DEVICEMAP.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, raw, 0) }.result();
        if let Err(e) = r {
            // SAFETY: raw came from malloc_host and is not used after this.
            unsafe { cudarc::driver::result::free_host(raw) }.ok();
            return Err(driver_err("mapping pinned host memory")(e));
        }
        Ok(HostBuf {
            ptr: raw as *mut T,
            len,
            dev,
            ctx: g.ctx.clone(),
            _t: PhantomData,
        })
    }

    /// `len` zeroed elements.
    pub fn zeros(g: &Gpu, len: usize) -> Result<HostBuf<T>> {
        // SAFETY: every byte is zeroed below before the buffer is returned.
        let h = unsafe { HostBuf::alloc(g, len) }?;
        let bytes = len.max(1) * std::mem::size_of::<T>();
        // SAFETY: ptr holds `bytes` writable bytes owned by h; all-zero bits are valid for the
        // plain numeric types stored here. Zeroed in parallel: offloaded experts reach hundreds
        // of GB.
        let all = unsafe { std::slice::from_raw_parts_mut(h.ptr as *mut u8, bytes) };
        all.par_chunks_mut(1 << 24).for_each(|c| c.fill(0));
        Ok(h)
    }

    /// A pinned copy of `data` (copied in parallel, written once).
    pub fn from_slice(g: &Gpu, data: &[T]) -> Result<HostBuf<T>>
    where
        T: Copy + Sync,
    {
        // SAFETY: every element is written by the copy below before the buffer is returned.
        let h = unsafe { HostBuf::alloc(g, data.len()) }?;
        let dst = h.ptr as usize;
        let per = ((1usize << 24) / std::mem::size_of::<T>().max(1)).max(1);
        data.par_chunks(per).enumerate().for_each(|(i, c)| {
            // SAFETY: chunk i covers elements i·per .. i·per + c.len() of the allocation, which
            // holds data.len() elements; chunks do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(c.as_ptr(), (dst as *mut T).add(i * per), c.len())
            };
        });
        Ok(h)
    }
}

impl<T> HostBuf<T> {
    /// Device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.dev
    }

    /// Device address of element `i`.
    pub fn at(&self, i: usize) -> u64 {
        self.dev + (i * std::mem::size_of::<T>()) as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: ptr holds len initialised elements (zeroed at allocation) owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as `as_slice`, borrowed uniquely.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T> Drop for HostBuf<T> {
    fn drop(&mut self) {
        // Freeing pinned memory needs the context current; a failure leaks the pages, which
        // is all that can be done in a destructor.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr came from malloc_host and is freed once, here.
            unsafe { cudarc::driver::result::free_host(self.ptr as *mut c_void) }.ok();
        }
    }
}

impl Gpu {
    fn raw_stream(&self) -> CUstream {
        self.stream.cu_stream()
    }

    /// Copy `bytes` from device address `src` to `dst` in stream order (either may be pinned
    /// host memory: addresses are unified).
    ///
    /// # Safety
    /// Both ranges must be valid for `bytes` bytes until the copy has run.
    pub unsafe fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        sys::cuMemcpyAsync(dst, src, bytes, self.raw_stream())
            .result()
            .map_err(driver_err("copying weights"))
    }

    /// Copy `rows` rows of `width` floats from `src` (rows `src_stride` floats apart) to `dst`
    /// (rows `dst_stride` floats apart) on the device, in stream order: a strided 2-D copy.
    ///
    /// # Safety
    /// Both regions must be valid device memory for the rows they span until the copy has run.
    pub unsafe fn copy_rows_f32(
        &self,
        (dst, dst_stride): (u64, usize),
        (src, src_stride): (u64, usize),
        width: usize,
        rows: usize,
    ) -> Result<()> {
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE;
        let c = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: device,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: 4 * src_stride,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: device,
            dstHost: std::ptr::null_mut(),
            dstDevice: dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: 4 * dst_stride,
            WidthInBytes: 4 * width,
            Height: rows,
        };
        sys::cuMemcpy2DAsync_v2(&c, self.raw_stream())
            .result()
            .map_err(driver_err("copying rows on the device"))
    }

    /// Set `buf[i] = v` in stream order.
    pub fn set_i32(&self, buf: &DevBuf<i32>, i: usize, v: i32) -> Result<()> {
        if i >= buf.len() {
            return Err(CudaError::Unsupported(format!(
                "set_i32: index {i} past a buffer of {}",
                buf.len()
            )));
        }
        // SAFETY: element i is within the allocation (checked above).
        unsafe { sys::cuMemsetD32Async(buf.at(i), v as u32, 1, self.raw_stream()) }
            .result()
            .map_err(driver_err("writing a device word"))
    }

    /// Copy `src` (device memory) into the pinned buffer `dst` in stream order; the host sees
    /// it after the stream has reached this point (e.g. after [`Gpu::sync`]).
    pub fn download_to(&self, src: &DevBuf<i32>, dst: &HostBuf<i32>, n: usize) -> Result<()> {
        if n > src.len() || n > dst.len() {
            return Err(CudaError::Unsupported(format!(
                "download of {n} elements past a buffer of {} / {}",
                src.len(),
                dst.len()
            )));
        }
        // SAFETY: both ranges hold n i32s (checked above) and outlive the copy (the caller
        // keeps both buffers for the model's lifetime).
        unsafe { self.copy_raw(dst.ptr(), src.ptr(), 4 * n) }
    }

    /// Host-to-device bandwidth in bytes/s from pinned memory: `reps` copies of `bytes`.
    pub fn pcie_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64> {
        let h: HostBuf<u8> = HostBuf::zeros(self, bytes)?;
        let d: DevBuf<u8> = self.zeros(bytes)?;
        // SAFETY: both hold `bytes` bytes and live past the sync below.
        let copy = || unsafe { self.copy_raw(d.ptr(), h.ptr(), bytes) };
        copy()?;
        self.sync()?;
        let t0 = std::time::Instant::now();
        for _ in 0..reps {
            copy()?;
        }
        self.sync()?;
        Ok(bytes as f64 * reps as f64 / t0.elapsed().as_secs_f64())
    }
}

/// A second stack of matrices of the same shape and format as the [`super::ops::Matvec`]'s, e.g. offloaded
/// experts in pinned host memory read over PCIe: slot ids ≥ `split` name its matrix `id − split`.
/// `scales` and `biases` are for affine weights (0 for bf16), holding what the near stack's
/// `AffineParams` say: one launch reads both stacks with the kernel built for those.
#[derive(Clone, Copy, Debug)]
pub struct Far {
    pub w: u64,
    pub scales: u64,
    pub biases: u64,
    pub split: usize,
}

/// The far-stack kernel arguments of a slot set: (w, scales, biases, split); split i32::MAX
/// (never reached) without one.
pub(super) fn far_args(sl: &Slots) -> (u64, u64, u64, i32) {
    match sl.far {
        Some(f) => (f.w, f.scales, f.biases, f.split as i32),
        None => (0, 0, 0, i32::MAX),
    }
}
