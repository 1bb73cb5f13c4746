//! NVRTC: one kernel file compiled for the device's real architecture (`sm_90`, ...) into a
//! cubin, cached on disk under `$XDG_CACHE_HOME/deltamoe/kernels` (or `~/.cache/...`), keyed by a
//! hash of the source, the architecture, the options and the NVRTC version.
//!
//! A cubin, not PTX: NVRTC then assembles the machine code in the thread that compiles the file,
//! so the files of a build are assembled in parallel, and a cached cubin loads without the
//! driver's PTX JIT, which assembles one module at a time as it is loaded, on every start where the
//! driver's own cache does not hold it.

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::{result, sys};

use super::{CudaError, Result};

/// FNV-1a, 64 bit: a stable hash for cache keys.
pub(super) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        h = (h ^ 0xff).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn cache_dir() -> PathBuf {
    crate::cache::dir().join("kernels")
}

fn nvrtc_version() -> String {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints; the library was found by `unavailable_reason`.
    unsafe {
        sys::nvrtcVersion(&mut major, &mut minor);
    }
    format!("{major}.{minor}")
}

/// The cubin of `file` (source `src`, already prefixed with common.cuh) for `arch` (`sm_90`,
/// ...) with `defines`, from the cache or freshly compiled (and then cached; a cache that cannot
/// be written is skipped).
pub(super) fn cubin(file: &str, src: &str, arch: &str, defines: &[&str]) -> Result<Vec<u8>> {
    let opts: Vec<String> = ["--std=c++17"]
        .iter()
        .chain(defines)
        .map(|s| s.to_string())
        .chain(std::iter::once(format!("--gpu-architecture={arch}")))
        .collect();
    let key = fnv1a(&[
        src.as_bytes(),
        arch.as_bytes(),
        opts.join(" ").as_bytes(),
        nvrtc_version().as_bytes(),
    ]);
    let cached = cache_dir().join(format!("{}-{key:016x}.cubin", file.trim_end_matches(".cu")));
    if let Ok(image) = std::fs::read(&cached) {
        return Ok(image);
    }
    let image = compile(file, src, &opts).map_err(|log| CudaError::Compile {
        file: file.to_string(),
        log: log.replace('\n', " | "),
    })?;
    // Written aside and renamed into place: another process or GPU thread may read it meanwhile.
    if let Some(dir) = cached.parent() {
        let tmp = cached.with_extension(format!(
            "{}.{:?}.tmp",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::create_dir_all(dir)
            .and_then(|_| std::fs::write(&tmp, &image))
            .and_then(|_| std::fs::rename(&tmp, &cached));
    }
    Ok(image)
}

/// NVRTC on `src` with `opts`: the cubin, or the compile log.
fn compile(file: &str, src: &str, opts: &[String]) -> std::result::Result<Vec<u8>, String> {
    let c_src = CString::new(src).map_err(|e| e.to_string())?;
    let c_name = CString::new(file).map_err(|e| e.to_string())?;
    let prog = result::create_program(&c_src, Some(&c_name)).map_err(|e| e.to_string())?;
    // SAFETY: `prog` was created above from `c_src` and `c_name`, which outlive it, and is
    // destroyed once below, after its last use.
    let out = unsafe {
        match result::compile_program(prog, opts) {
            Ok(()) => image(prog).map_err(|e| e.to_string()),
            Err(e) => Err(log(prog).unwrap_or_else(|| e.to_string())),
        }
    };
    // SAFETY: as above; nothing uses `prog` after this.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// The cubin of a compiled program.
///
/// # Safety
/// `prog` must be a live program compiled for a real architecture.
unsafe fn image(prog: sys::nvrtcProgram) -> std::result::Result<Vec<u8>, result::NvrtcError> {
    let mut size = 0usize;
    sys::nvrtcGetCUBINSize(prog, &mut size).result()?;
    let mut out = vec![0u8; size];
    sys::nvrtcGetCUBIN(prog, out.as_mut_ptr() as *mut c_char).result()?;
    Ok(out)
}

/// The compile log of a program, if NVRTC gives one.
///
/// # Safety
/// `prog` must be a live program.
unsafe fn log(prog: sys::nvrtcProgram) -> Option<String> {
    let raw = result::get_program_log(prog).ok()?;
    let text = CStr::from_bytes_until_nul(std::slice::from_raw_parts(
        raw.as_ptr() as *const u8,
        raw.len(),
    ))
    .ok()?;
    Some(text.to_string_lossy().trim().to_string())
}

#[cfg(test)]
mod tests {
    #[test]
    fn cache_key_changes_with_any_part() {
        let a = super::fnv1a(&[b"src", b"sm_90"]);
        assert_ne!(a, super::fnv1a(&[b"src", b"sm_80"]));
        assert_ne!(a, super::fnv1a(&[b"srcc", b"m_90"]));
        assert_eq!(a, super::fnv1a(&[b"src", b"sm_90"]));
    }
}
