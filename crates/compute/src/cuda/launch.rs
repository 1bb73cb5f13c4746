//! Kernel launches through `cuLaunchKernelEx`, with programmatic dependent launch (PDL) on
//! sm_90+ while [`Gpu::set_pdl`] is on: a kernel may then start launching while the one before
//! it in the stream finishes (every kernel begins with `pdl_entry()`, which waits for its
//! predecessor's completion before touching memory), which hides most of the launch gap between
//! the many short kernels of a decode step. Inside a captured graph the edges stay programmatic.

use std::ffi::c_void;
use std::marker::PhantomData;

use cudarc::driver::sys::{self, CUlaunchAttributeID, CUlaunchAttribute_st, CUlaunchConfig_st};
use cudarc::driver::{CudaFunction, DeviceRepr, DriverError, LaunchConfig};

use super::Gpu;

/// The arguments of one launch: pointers to values that outlive the builder.
pub struct Launch<'a> {
    gpu: &'a Gpu,
    func: sys::CUfunction,
    args: Vec<*mut c_void>,
    cluster: u32,
    _args: PhantomData<&'a ()>,
}

impl<'a> Launch<'a> {
    /// Push the next kernel argument (the value, not a copy, is read at launch).
    pub fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push(v as *const T as *mut c_void);
        self
    }

    /// Group the blocks into clusters of `x` consecutive blocks along x (sm_90+; the grid's x
    /// dimension a multiple of `x`), whose shared memories the blocks may read (`mapa`).
    pub fn cluster(&mut self, x: u32) -> &mut Self {
        self.cluster = x;
        self
    }

    /// Launch on the GPU's stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's parameters in number, order and type, and every
    /// buffer the kernel touches must be valid for the accesses the grid makes.
    pub unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<(), DriverError> {
        self.gpu.ctx.bind_to_thread()?;
        let mut attrs: [CUlaunchAttribute_st; 2] = std::mem::zeroed();
        let mut n = 0;
        let pdl = self.gpu.pdl_active();
        if pdl {
            attrs[n].id =
                CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if self.cluster > 1 {
            attrs[n].id = CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = self.cluster;
            attrs[n].value.clusterDim.y = 1;
            attrs[n].value.clusterDim.z = 1;
            n += 1;
        }
        let config = CUlaunchConfig_st {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.gpu.stream.cu_stream(),
            attrs: if n > 0 {
                attrs.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            },
            numAttrs: n as u32,
        };
        sys::cuLaunchKernelEx(
            &config,
            self.func,
            self.args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }
}

impl Gpu {
    /// A launch of `func` on this GPU's stream.
    pub fn launch_builder<'a>(&'a self, func: &CudaFunction) -> Launch<'a> {
        Launch {
            gpu: self,
            func: func.cu_function(),
            args: Vec::with_capacity(24),
            cluster: 1,
            _args: PhantomData,
        }
    }

    /// Launch the following kernels with programmatic dependent launch (used on sm_90+ only).
    pub fn set_pdl(&self, on: bool) {
        self.pdl.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn pdl_active(&self) -> bool {
        self.compute_capability.0 >= 9 && self.pdl.load(std::sync::atomic::Ordering::Relaxed)
    }
}
