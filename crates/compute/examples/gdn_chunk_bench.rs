//! Times the chunked gated delta rule prefill (`cuda::gdn_chunk`) at Qwen3.5 shapes: 16 key
//! heads, 32 or 64 value heads, head dim 128, T = 4k / 16k / 64k tokens, bf16 q/k/v (the kernels
//! normalise q and k), f32 g/beta/state/out. Prints the median milliseconds per call of the
//! whole forward and of each launch, from CUDA events around each of N calls after a warm-up.
//! `scripts/bench_gdn_fla.py` times flash-linear-attention at the same shapes.
//!
//!     cargo run --release -p deltamoe-compute --example gdn_chunk_bench [-- --dump DIR] [--only T,HV]
//!
//! `--dump DIR` also runs the `--only` shape (default T = 4096, Hv = 32) on device-generated
//! inputs and writes them with the outputs as raw little-endian files (q, k, v: bf16 bits; g,
//! beta, h0, out, ht: f32; the shape in shape.txt) for the script's cross-check against
//! flash-linear-attention.

use std::error::Error;

use deltamoe_compute::cuda::gdn_chunk::{
    default_tile, gdn_chunk_forward, gdn_chunk_prep, gdn_chunk_state, workspace_bytes,
    GdnChunkBufs, GdnChunkDims, StateTile,
};
use deltamoe_compute::cuda::{ops, DevBuf, Gpu};

const HK: usize = 16;
const D: usize = 128;
const WARMUP: usize = 3;
const REPS: usize = 20;

struct Bufs {
    q: DevBuf<u16>,
    k: DevBuf<u16>,
    v: DevBuf<u16>,
    g: DevBuf<f32>,
    beta: DevBuf<f32>,
    state: DevBuf<f32>,
    out: DevBuf<f32>,
    ws: DevBuf<u8>,
}

impl Bufs {
    fn new(gpu: &Gpu, d: GdnChunkDims, seed: u64) -> Result<Bufs, Box<dyn Error>> {
        let b = Bufs {
            q: gpu.zeros(d.t * d.hk * d.dk)?,
            k: gpu.zeros(d.t * d.hk * d.dk)?,
            v: gpu.zeros(d.t * d.hv * d.dv)?,
            g: gpu.zeros(d.t * d.hv)?,
            beta: gpu.zeros(d.t * d.hv)?,
            state: gpu.zeros(d.hv * d.dk * d.dv)?,
            out: gpu.zeros(d.t * d.hv * d.dv)?,
            ws: gpu.zeros(workspace_bytes(d))?,
        };
        ops::fill_uniform(
            gpu,
            b.q.ptr(),
            b.q.len(),
            deltamoe_compute::DType::BF16,
            seed,
            -1.0,
            1.0,
        )?;
        ops::fill_uniform(
            gpu,
            b.k.ptr(),
            b.k.len(),
            deltamoe_compute::DType::BF16,
            seed + 1,
            -1.0,
            1.0,
        )?;
        ops::fill_uniform(
            gpu,
            b.v.ptr(),
            b.v.len(),
            deltamoe_compute::DType::BF16,
            seed + 2,
            -1.0,
            1.0,
        )?;
        ops::fill_uniform(
            gpu,
            b.g.ptr(),
            b.g.len(),
            deltamoe_compute::DType::F32,
            seed + 3,
            -0.7,
            -0.01,
        )?;
        ops::fill_uniform(
            gpu,
            b.beta.ptr(),
            b.beta.len(),
            deltamoe_compute::DType::F32,
            seed + 4,
            0.0,
            1.0,
        )?;
        ops::fill_uniform(
            gpu,
            b.state.ptr(),
            b.state.len(),
            deltamoe_compute::DType::F32,
            seed + 5,
            -0.5,
            0.5,
        )?;
        Ok(b)
    }

    fn ptrs(&self) -> GdnChunkBufs {
        GdnChunkBufs {
            q: self.q.ptr(),
            k: self.k.ptr(),
            v: self.v.ptr(),
            g: self.g.ptr(),
            beta: self.beta.ptr(),
            state: self.state.ptr(),
            out: self.out.ptr(),
            workspace: self.ws.ptr(),
        }
    }
}

/// Median milliseconds of `f` over REPS timed calls after WARMUP untimed ones.
fn time_ms(
    gpu: &Gpu,
    mut f: impl FnMut() -> Result<(), Box<dyn Error>>,
) -> Result<f32, Box<dyn Error>> {
    for _ in 0..WARMUP {
        f()?;
    }
    let (a, b) = (gpu.timer()?, gpu.timer()?);
    let mut ms = Vec::with_capacity(REPS);
    for _ in 0..REPS {
        gpu.mark(&a)?;
        f()?;
        gpu.mark(&b)?;
        gpu.sync()?;
        ms.push(gpu.elapsed_ms(&a, &b)?);
    }
    ms.sort_by(|x, y| x.total_cmp(y));
    Ok(ms[REPS / 2])
}

/// Raw little-endian bytes of `data` (both hosts here are little-endian).
fn write_raw<T: bytemuck::Pod>(path: &std::path::Path, data: &[T]) -> Result<(), Box<dyn Error>> {
    std::fs::write(path, bytemuck::cast_slice(data))?;
    Ok(())
}

fn dump(gpu: &Gpu, dir: &std::path::Path, (t, hv): (usize, usize)) -> Result<(), Box<dyn Error>> {
    let d = GdnChunkDims {
        t,
        hk: HK,
        hv,
        dk: D,
        dv: D,
    };
    let b = Bufs::new(gpu, d, 42)?;
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("shape.txt"), format!("{t} {hv}\n"))?;
    write_raw(&dir.join("q.bin"), &gpu.read(&b.q, b.q.len())?)?;
    write_raw(&dir.join("k.bin"), &gpu.read(&b.k, b.k.len())?)?;
    write_raw(&dir.join("v.bin"), &gpu.read(&b.v, b.v.len())?)?;
    write_raw(&dir.join("g.bin"), &gpu.read(&b.g, b.g.len())?)?;
    write_raw(&dir.join("beta.bin"), &gpu.read(&b.beta, b.beta.len())?)?;
    write_raw(&dir.join("h0.bin"), &gpu.read(&b.state, b.state.len())?)?;
    gdn_chunk_forward(gpu, b.ptrs(), d, true)?;
    write_raw(&dir.join("out.bin"), &gpu.read(&b.out, b.out.len())?)?;
    write_raw(&dir.join("ht.bin"), &gpu.read(&b.state, b.state.len())?)?;
    println!(
        "dumped T={} Hk={} Hv={} D={} to {}",
        d.t,
        d.hk,
        d.hv,
        D,
        dir.display()
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().collect();
    let gpu = Gpu::new(0)?;
    println!("device: {}", gpu.name());
    // `--only T,HV`: that one shape (e.g. under a profiler, or for --dump).
    let only: Option<(usize, usize)> = match args.iter().position(|a| a == "--only") {
        Some(i) => {
            let spec = args.get(i + 1).ok_or("--only needs T,HV")?;
            let (t, hv) = spec.split_once(',').ok_or("--only needs T,HV")?;
            Some((t.parse()?, hv.parse()?))
        }
        None => None,
    };
    if let Some(i) = args.iter().position(|a| a == "--dump") {
        let dir = args.get(i + 1).ok_or("--dump needs a directory")?;
        dump(&gpu, std::path::Path::new(dir), only.unwrap_or((4096, 32)))?;
    }
    for hv in [32usize, 64] {
        for t in [4096usize, 16384, 65536] {
            if only.is_some_and(|o| o != (t, hv)) {
                continue;
            }
            let d = GdnChunkDims {
                t,
                hk: HK,
                hv,
                dk: D,
                dv: D,
            };
            let b = Bufs::new(&gpu, d, 7)?;
            let p = b.ptrs();
            let tile = default_tile(&gpu, d);
            let fwd = time_ms(&gpu, || Ok(gdn_chunk_forward(&gpu, p, d, true)?))?;
            let prep = time_ms(&gpu, || Ok(gdn_chunk_prep(&gpu, p, d, true)?))?;
            let s32 = time_ms(&gpu, || Ok(gdn_chunk_state(&gpu, p, d, StateTile::V32)?))?;
            let s64 = time_ms(&gpu, || Ok(gdn_chunk_state(&gpu, p, d, StateTile::V64)?))?;
            println!(
                "ours T={t} Hk={HK} Hv={hv} D={D}: forward {fwd:.3} ms (tile {tile:?}; prep {prep:.3}, state V32 {s32:.3}, state V64 {s64:.3})"
            );
        }
    }
    Ok(())
}
