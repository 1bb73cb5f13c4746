//! Quantized matvec throughput on the CPU against this machine's memory bandwidth.
//!
//!     cargo bench -p deltamoe-compute --bench quant_matvec
//!     RAYON_NUM_THREADS=1 cargo bench -p deltamoe-compute --bench quant_matvec
//!
//! Bandwidth is measured in the same run: a 1 GiB `memcpy` (`copy_from_slice`, one thread and
//! split over the rayon threads; reported as bytes copied per second, i.e. half the read+write
//! traffic) and a parallel read-only sum over 1 GiB. Kernels: `qmatmul` with one token at real
//! Qwen3.5-MoE shapes, 4-bit group 64 (also 2 and 8 bits for the lm_head), GB/s = bytes of words,
//! scales and biases per second. "hot" repeats one matrix (cache-resident when it fits); "cold"
//! cycles through 1024 distinct expert matrices (600 MB; decode touches different experts every
//! token), more than any last-level cache. The bf16 dense `matmul` of the lm_head is there for comparison.
//! Harness-less bench (no criterion): prints a table.

use std::hint::black_box;
use std::time::Instant;

use deltamoe_compute::cpu::{matmul, qmatmul};
use deltamoe_compute::dtype::f32_to_bf16;
use deltamoe_compute::quant::{AffineWeight, PackedWords};
use deltamoe_compute::{DType, Tensor};
use rayon::prelude::*;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A random quantized `[out, inp]` matrix (random words, small bf16 scales and biases).
fn random_weight(out: usize, inp: usize, bits: u32, gs: usize, seed: u64) -> AffineWeight {
    let n_words = out * inp * bits as usize / 32;
    let words: Vec<u32> = (0..n_words)
        .into_par_iter()
        .map(|i| splitmix(seed ^ i as u64) as u32)
        .collect();
    let g = out * inp / gs;
    let half = |k: u64| -> Vec<u16> {
        (0..g)
            .into_par_iter()
            .map(|i| {
                f32_to_bf16(
                    ((splitmix(k ^ i as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.01,
                )
            })
            .collect()
    };
    AffineWeight::new(
        bits,
        gs,
        out,
        inp,
        PackedWords::from_vec(words),
        Tensor::from_half_bits(DType::BF16, vec![out, inp / gs], half(seed + 1)),
        Tensor::from_half_bits(DType::BF16, vec![out, inp / gs], half(seed + 2)),
    )
    .expect("valid shapes")
}

/// Median seconds of `f` over `reps` runs after one warm-up.
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
    v[v.len() / 2]
}

fn gbs(bytes: usize, s: f64) -> f64 {
    bytes as f64 / s / 1e9
}

fn main() {
    let threads = rayon::current_num_threads();
    println!("threads {threads}");

    // Memory bandwidth.
    let n = 1usize << 30;
    let src: Vec<u8> = (0..n).into_par_iter().map(|i| i as u8).collect();
    let mut dst = vec![0u8; n];
    let one = time(5, || dst.copy_from_slice(black_box(&src)));
    let chunk = n / threads.max(1);
    let par = time(5, || {
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s))
    });
    // A fresh Vec of this size is 8-aligned; an empty view (read 0 GB/s) would show otherwise.
    let words: &[u64] = bytemuck::try_cast_slice(&src).unwrap_or(&[]);
    let read = time(5, || {
        black_box(
            words
                .par_iter()
                .fold(|| 0u64, |a, &b| a ^ b)
                .reduce(|| 0, |a, b| a ^ b),
        );
    });
    println!(
        "memcpy 1 GiB: 1 thread {:.1} GB/s, {threads} threads {:.1} GB/s (bytes copied/s); parallel read {:.1} GB/s",
        gbs(n, one),
        gbs(n, par),
        gbs(n, read)
    );
    drop((src, dst));

    println!(
        "{:<34} {:>6} {:>10} {:>10} {:>9}",
        "matvec (1 token)", "bits", "MB", "us", "GB/s"
    );
    let row = |name: &str, bits: u32, bytes: usize, s: f64| {
        println!(
            "{name:<34} {bits:>6} {:>10.2} {:>10.1} {:>9.1}",
            bytes as f64 / 1e6,
            s * 1e6,
            gbs(bytes, s)
        );
    };
    // Experts: gate/up [2048 -> 512], down [512 -> 2048].
    for (name, out, inp) in [
        ("expert [2048->512]", 512, 2048),
        ("expert [512->2048]", 2048, 512),
    ] {
        let n_exp = 1024; // 600 MB: more than any last-level cache
        let ws: Vec<AffineWeight> = (0..n_exp)
            .map(|e| random_weight(out, inp, 4, 64, 100 + e as u64))
            .collect();
        let x: Vec<f32> = (0..inp).map(|i| (i as f32 * 0.01).sin()).collect();
        let mut y = vec![0.0f32; out];
        let hot = time(200, || qmatmul(black_box(&x), 1, &ws[0], &mut y));
        row(&format!("{name} hot"), 4, ws[0].nbytes(), hot);
        let mut e = 0;
        let cold = time(200, || {
            for _ in 0..16 {
                e = (e + 97) % n_exp;
                qmatmul(black_box(&x), 1, &ws[e], &mut y);
            }
        }) / 16.0;
        row(
            &format!("{name} cold ({n_exp} experts)"),
            4,
            ws[0].nbytes(),
            cold,
        );
    }
    // lm_head [2048 -> 248320].
    let (out, inp) = (248_320, 2048);
    let x: Vec<f32> = (0..inp).map(|i| (i as f32 * 0.01).cos()).collect();
    let mut y = vec![0.0f32; out];
    for bits in [4, 2, 8] {
        let w = random_weight(out, inp, bits, 64, 7);
        let s = time(10, || qmatmul(black_box(&x), 1, &w, &mut y));
        row("lm_head [2048->248320]", bits, w.nbytes(), s);
    }
    let dense = Tensor::from_half_bits(
        DType::BF16,
        vec![out, inp],
        (0..out * inp)
            .into_par_iter()
            .map(|i| f32_to_bf16((splitmix(i as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5))
            .collect(),
    );
    let s = time(10, || matmul(black_box(&x), 1, &dense, &mut y));
    row("lm_head [2048->248320] bf16 dense", 16, dense.nbytes(), s);
}
