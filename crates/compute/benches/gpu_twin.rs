//! Single-thread throughput of the GPU-twin expert kernels (`cpu::gpu_twin`) at Qwen3.5-MoE
//! expert shapes, 4-bit group 64 (and bf16, hot only):
//!
//!     cargo bench -p deltamoe-compute --bench gpu_twin
//!
//! GB/s = bytes of words, scales and biases per second on one thread (callers split rows over
//! threads). "hot" repeats one matrix (cache-resident where it fits); "cold" cycles through
//! enough experts to exceed the last-level cache, as decode does. Harness-less: prints a table.

use std::hint::black_box;
use std::time::Instant;

use deltamoe_compute::cpu::gpu_twin::{matvec_rows, swiglu_rows, TwinInput, TwinMat};
use deltamoe_compute::cuda::ops::AffineParams;
use deltamoe_compute::dtype::f32_to_bf16;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One random 4-bit group-64 matrix `[n, k]`: words, bf16 scales, bf16 biases.
struct Expert {
    words: Vec<u32>,
    scales: Vec<u16>,
    biases: Vec<u16>,
}

const BITS: u32 = 4;
const GROUP: usize = 64;

impl Expert {
    fn new(n: usize, k: usize, seed: u64) -> Expert {
        let words = (0..n * k / 8)
            .map(|i| splitmix(seed ^ i as u64) as u32)
            .collect();
        let half = |s: u64| {
            (0..n * k / GROUP)
                .map(|i| {
                    let u = (splitmix(s ^ i as u64) >> 40) as f32 / (1u64 << 24) as f32;
                    f32_to_bf16((u - 0.5) * 0.01)
                })
                .collect()
        };
        Expert {
            words,
            scales: half(seed + 1),
            biases: half(seed + 2),
        }
    }

    fn view(&self) -> TwinMat<'_> {
        TwinMat::Affine {
            words: &self.words,
            scales: &self.scales,
            biases: &self.biases,
            bits: BITS,
            group: GROUP,
            params: AffineParams::Bf16,
        }
    }

    fn bytes(&self) -> usize {
        self.words.len() * 4 + (self.scales.len() + self.biases.len()) * 2
    }
}

/// Least seconds of `f` over `reps` runs after one warm-up (the least disturbed run: this
/// measures the code, not the neighbours of a shared machine).
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[0]
}

fn main() {
    println!(
        "{:<40} {:>8} {:>10} {:>8}",
        "one thread, 4-bit g64", "MB", "us", "GB/s"
    );
    let row = |name: &str, bytes: usize, s: f64| {
        println!(
            "{name:<40} {:>8.2} {:>10.1} {:>8.2}",
            bytes as f64 / 1e6,
            s * 1e6,
            bytes as f64 / s / 1e9
        );
    };
    // (name, rows N, K, SwiGLU): gate/up [2I, K] → h [I]; down [N, K] → y [N].
    for (name, n, k, swiglu) in [
        ("swiglu_rows [1024, 2048] (I 512)", 1024, 2048, true),
        ("swiglu_rows [2048, 2048] (I 1024)", 2048, 2048, true),
        ("matvec_rows [2048, 512]", 2048, 512, false),
        ("matvec_rows [2048, 1024]", 2048, 1024, false),
    ] {
        let experts: Vec<Expert> = (0..600_000_000 / (n * k / 2))
            .map(|e| Expert::new(n, k, 1000 * e as u64))
            .collect();
        let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.01).sin()).collect();
        let xin = TwinInput::new(&x, &experts[0].view()).expect("valid input");
        let out = if swiglu { n / 2 } else { n };
        let mut y = vec![0.0f32; out];
        let mut run = |e: &Expert| {
            let m = e.view();
            let r = if swiglu {
                swiglu_rows(&m, n / 2, black_box(&xin), 0..out, &mut y)
            } else {
                matvec_rows(&m, black_box(&xin), 0..out, &mut y)
            };
            r.expect("valid shapes");
        };
        let hot = time(100, || run(&experts[0]));
        row(&format!("{name} hot"), experts[0].bytes(), hot);
        let mut e = 0;
        let cold = time(50, || {
            for _ in 0..8 {
                e = (e + 97) % experts.len();
                run(&experts[e]);
            }
        }) / 8.0;
        row(
            &format!("{name} cold ({})", experts.len()),
            experts[0].bytes(),
            cold,
        );
        let prep = time(100, || {
            black_box(TwinInput::new(black_box(&x), &experts[0].view()).expect("valid input"));
        });
        println!("  TwinInput::new for K {k}: {:.2} us", prep * 1e6);
    }
    // bf16 (hot): K % 8 = 0 takes the transposing path.
    for (name, n, k, swiglu) in [
        ("bf16 swiglu_rows [1024, 2048] hot", 1024, 2048, true),
        ("bf16 matvec_rows [2048, 512] hot", 2048, 512, false),
    ] {
        let w: Vec<u16> = (0..n * k)
            .map(|i| f32_to_bf16((splitmix(i as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5))
            .collect();
        let m = TwinMat::Bf16(&w);
        let x: Vec<f32> = (0..k).map(|i| (i as f32 * 0.01).sin()).collect();
        let xin = TwinInput::new(&x, &m).expect("valid input");
        let out = if swiglu { n / 2 } else { n };
        let mut y = vec![0.0f32; out];
        let s = time(100, || {
            let r = if swiglu {
                swiglu_rows(&m, n / 2, black_box(&xin), 0..out, &mut y)
            } else {
                matvec_rows(&m, black_box(&xin), 0..out, &mut y)
            };
            r.expect("valid shapes");
        });
        row(name, w.len() * 2, s);
    }
}
