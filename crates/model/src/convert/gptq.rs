//! `convert --gptq`: an HF checkpoint to a GPTQ int4 one (v1 `checkpoint_format` "gptq", sym,
//! desc_act false), the layout AutoGPTQ / GPTQModel write and the engines that read GPTQ load
//! (format in [`crate::gptq`]).
//!
//! The weights are rounded to nearest (no Hessian-based error correction: this writes the
//! format, it does not reproduce GPTQ's algorithm). Per group of `G` inputs of a row, with
//! `a = max|w|`: `s = 2a/15` rounded to f16, `q = clamp(round_half_even(w/s) + 8, 0, 15)`, zero
//! point 8 (stored as 7), so `w ≈ (q − 8)·s` — GPTQ's symmetric quantizer. The same modules are
//! quantized as by `--fp8` (the router, shared-expert gate, GDN `a`/`b`, embeddings and lm_head
//! are kept); a linear whose input dim is not a multiple of `G` (or output dim of 8) stays as
//! stored, as GPTQ tools skip it.

use half::f16;
use serde_json::{json, Value};

use super::{Job, Part, Plan};

/// GPTQ's 4-bit symmetric zero point.
const ZERO: u32 = 8;

/// One matrix in GPTQ's packed layout (4 bits, `[out, inp]` logical).
#[derive(Clone, Debug, PartialEq)]
pub struct GptqPacked {
    /// `[inp/8, out]`: value k of column n at bits `4·(k % 8)` of row `k / 8`.
    pub qweight: Vec<u32>,
    /// `[inp/G, out/8]`, each nibble the zero point minus one.
    pub qzeros: Vec<u32>,
    /// `[inp/G, out]` f16 bits.
    pub scales: Vec<u16>,
    /// `[inp]`: `k / G`.
    pub g_idx: Vec<u32>,
}

/// Quantize `w` (`[out, inp]` row-major) with groups of `g` (`inp % g == 0`, `out % 8 == 0`).
pub fn quantize_gptq(w: &[f32], out: usize, inp: usize, g: usize) -> GptqPacked {
    let groups = inp / g;
    let mut p = GptqPacked {
        qweight: vec![0; inp / 8 * out],
        qzeros: vec![(ZERO - 1) * 0x1111_1111; groups * out / 8],
        scales: vec![0; groups * out],
        g_idx: (0..inp).map(|k| (k / g) as u32).collect(),
    };
    for n in 0..out {
        let row = &w[n * inp..(n + 1) * inp];
        for (gi, grp) in row.chunks_exact(g).enumerate() {
            let amax = grp.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let s = f16::from_f32(2.0 * amax / 15.0);
            p.scales[gi * out + n] = s.to_bits();
            let s = s.to_f32();
            for (j, &v) in grp.iter().enumerate() {
                let q = match s > 0.0 {
                    true => ((v / s).round_ties_even() + ZERO as f32).clamp(0.0, 15.0) as u32,
                    false => ZERO,
                };
                let k = gi * g + j;
                p.qweight[k / 8 * out + n] |= q << (4 * (k % 8));
            }
        }
    }
    p
}

impl Plan {
    pub(super) fn add_gptq(&mut self, module: &str, part: Part, [out, inp]: [usize; 2], g: usize) {
        self.quantized += 1;
        let qweight = self.push(format!("{module}.qweight"), "I32", vec![inp / 8, out]);
        let qzeros = self.push(format!("{module}.qzeros"), "I32", vec![inp / g, out / 8]);
        let scales = self.push(format!("{module}.scales"), "F16", vec![inp / g, out]);
        let g_idx = self.push(format!("{module}.g_idx"), "I32", vec![inp]);
        self.jobs.push(Job::Gptq {
            part,
            cols: inp,
            group: g,
            out: [qweight, qzeros, scales, g_idx],
        });
    }
}

/// Whether GPTQ can hold an `[out, inp]` matrix with groups of `g`.
pub(super) fn fits(out: usize, inp: usize, g: usize) -> bool {
    inp.is_multiple_of(g) && out.is_multiple_of(8)
}

/// The `quantization_config` of a GPTQ conversion with groups of `g`.
pub(crate) fn gptq_config(g: usize) -> Value {
    json!({
        "quant_method": "gptq",
        "bits": 4,
        "group_size": g,
        "sym": true,
        "desc_act": false,
        "checkpoint_format": "gptq",
        "lm_head": false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_as_gptq_with_zero_point_eight_stored_as_seven() {
        // One row of 8 columns per output; output n's group max is n + 1.
        let (out, inp) = (8, 32);
        let w: Vec<f32> = (0..out * inp)
            .map(|i| {
                let (n, k) = (i / inp, i % inp);
                (n + 1) as f32 * if k == 0 { 1.0 } else { -0.5 }
            })
            .collect();
        let p = quantize_gptq(&w, out, inp, 32);
        assert_eq!(p.qzeros, vec![0x7777_7777]);
        assert_eq!(p.g_idx.len(), 32);
        for n in 0..out {
            let s = f16::from_bits(p.scales[n]).to_f32();
            assert_eq!(s, f16::from_f32(2.0 * (n + 1) as f32 / 15.0).to_f32());
            // k = 0: +amax → round(7.5) = 8 → 16, clamped to 15.
            assert_eq!(p.qweight[n] & 15, 15);
            let q1 = (p.qweight[n] >> 4) & 15;
            let want = ((-0.5 * (n + 1) as f32 / s).round_ties_even() + 8.0) as u32;
            assert_eq!(q1, want);
        }
        assert!(fits(8, 32, 32) && !fits(4, 32, 32) && !fits(8, 48, 32));
    }
}
