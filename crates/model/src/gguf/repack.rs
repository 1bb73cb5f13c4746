//! GGUF block types whose values are an affine function of an integer code per group, taken
//! apart into the engine's affine form (`w = q·scale + bias` per group, [`AffineWeight`]) with
//! the same values:
//!
//! | type | bits | group | scale | bias |
//! |---|---|---|---|---|
//! | Q8_0 | 8 | 32 | d | −128·d (code q + 128) |
//! | Q4_0 / Q5_0 | 4 / 5 | 32 | d | −8·d / −16·d |
//! | Q4_1 / Q5_1 | 4 / 5 | 32 | d | m |
//! | Q4_K / Q5_K | 4 / 5 | 32 (sub-block) | d·sc | −dmin·m |
//! | Q6_K | 6 | 16 (sub-block) | d·sc | −32·d·sc |
//! | IQ4_NL | 8 | 32 | d | −128·d (code table[q] + 128) |
//! | IQ4_XS | 8 | 32 (sub-block) | d·(sc − 32) | −128·d·(sc − 32) (code table[q] + 128) |
//!
//! Scales and biases are f32 and every one is exact (an f16 times a code of at most 8 bits).
//! Each value `q·scale + bias` is then gguf-py's value: the product is exact and the one
//! rounding is the sum's, as in its `d·q − m` (Q6_K's `(d·sc)·(q − 32)` and IQ4_XS's
//! `(d·(sc − 32))·table[q]` are exact products where the affine form may round `q·scale` of 25
//! bits before the sum). IQ4's codes go through their 16-value table into 8-bit codes: twice
//! their bits, half of bf16's. Q8_0, Q4_0, Q5_0 and IQ4_NL are marked as zero-point form (f16
//! scale d, integer zero point), which the GPU holds exactly.

use deltamoe_compute::quant::pack_row;
use deltamoe_compute::{AffineWeight, PackedWords, QuantError, Tensor};
use rayon::prelude::*;

use super::blocks::{half16, iq4_xs_scale, nibble, scale_min, IQ4_VALUES};
use super::BlockType;

/// The affine form of a block type: bits, group size, and the zero point when the bias is
/// `−z·d` for the block's f16 scale `d`.
pub fn affine_form(t: BlockType) -> Option<(u32, usize, Option<u8>)> {
    use BlockType::*;
    Some(match t {
        Q8_0 => (8, 32, Some(128)),
        Q4_0 => (4, 32, Some(8)),
        Q5_0 => (5, 32, Some(16)),
        Q4_1 => (4, 32, None),
        Q5_1 => (5, 32, None),
        Q4K => (4, 32, None),
        Q5K => (5, 32, None),
        Q6K => (6, 16, None),
        IQ4NL => (8, 32, Some(128)),
        IQ4XS => (8, 32, None),
        F32 | F16 | BF16 => return None,
    })
}

/// A tensor of an affine block type, taken apart: one code per value and one scale and bias
/// per group, in the tensor's order.
pub struct Groups {
    pub bits: u32,
    pub group: usize,
    pub zero_point: bool,
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

impl Groups {
    /// The `n` values of `data` (whole blocks of type `t`), or `None` when `t` is not affine.
    pub fn of(t: BlockType, data: &[u8], n: usize) -> Option<Groups> {
        let (bits, group, zero) = affine_form(t)?;
        let (per, bytes) = (t.block(), t.bytes());
        let gpb = per / group;
        let mut codes = vec![0u8; n];
        let mut scales = vec![0.0f32; n / group];
        let mut biases = vec![0.0f32; n / group];
        codes
            .par_chunks_mut(per)
            .zip(scales.par_chunks_mut(gpb))
            .zip(biases.par_chunks_mut(gpb))
            .zip(data.par_chunks_exact(bytes))
            .for_each(|(((q, s), b), x)| block(t, x, q, s, b));
        Some(Groups {
            bits,
            group,
            zero_point: zero.is_some(),
            codes,
            scales,
            biases,
        })
    }

    /// As an affine weight of `rows` rows (`codes.len() / rows` values each, whole groups).
    pub fn into_weight(self, rows: usize) -> Result<AffineWeight, QuantError> {
        let cols = self.codes.len() / rows;
        let wpr = cols * self.bits as usize / 32;
        let mut words = vec![0u32; rows * wpr];
        words
            .par_chunks_mut(wpr.max(1))
            .zip(self.codes.par_chunks(cols.max(1)))
            .for_each(|(w, q)| pack_row(q, self.bits, w));
        let shape = vec![rows, cols / self.group];
        let w = AffineWeight::new(
            self.bits,
            self.group,
            rows,
            cols,
            PackedWords::from_vec(words),
            Tensor::from_f32(shape.clone(), self.scales),
            Tensor::from_f32(shape, self.biases),
        )?;
        Ok(match self.zero_point {
            true => w.with_zero_points(),
            false => w,
        })
    }
}

/// One block `x` of type `t`: its codes into `q`, its groups' scales and biases into `s`, `b`
/// (the layouts are those [`BlockType::dequantize`] reads).
fn block(t: BlockType, x: &[u8], q: &mut [u8], s: &mut [f32], b: &mut [f32]) {
    use BlockType::*;
    match t {
        Q8_0 => {
            s[0] = half16(x, 0);
            b[0] = -128.0 * s[0];
            for (c, &v) in q.iter_mut().zip(&x[2..34]) {
                *c = (v as i8 as i16 + 128) as u8;
            }
        }
        Q4_0 | Q4_1 => {
            let at = if t == Q4_0 { 2 } else { 4 };
            s[0] = half16(x, 0);
            b[0] = if t == Q4_0 { -8.0 * s[0] } else { half16(x, 2) };
            for (l, c) in q.iter_mut().enumerate() {
                *c = nibble(x[at + l % 16], l / 16);
            }
        }
        Q5_0 | Q5_1 => {
            let at = if t == Q5_0 { 2 } else { 4 };
            let qh = u32::from_le_bytes([x[at], x[at + 1], x[at + 2], x[at + 3]]);
            s[0] = half16(x, 0);
            b[0] = if t == Q5_0 {
                -16.0 * s[0]
            } else {
                half16(x, 2)
            };
            for (l, c) in q.iter_mut().enumerate() {
                *c = nibble(x[at + 4 + l % 16], l / 16) | (((qh >> l) & 1) as u8) << 4;
            }
        }
        Q4K | Q5K => {
            let (d, dmin) = (half16(x, 0), half16(x, 2));
            let (qh, qs) = match t {
                Q5K => (Some(&x[16..48]), &x[48..176]),
                _ => (None, &x[16..144]),
            };
            for j in 0..8 {
                let (sc, m) = scale_min(&x[4..16], j);
                s[j] = d * sc as f32;
                b[j] = -(dmin * m as f32);
                for l in 0..32 {
                    let mut c = nibble(qs[32 * (j / 2) + l], j % 2);
                    if let Some(qh) = qh {
                        c |= ((qh[l] >> j) & 1) << 4;
                    }
                    q[32 * j + l] = c;
                }
            }
        }
        Q6K => {
            let (ql, qh, sc) = (&x[..128], &x[128..192], &x[192..208]);
            let d = half16(x, 208);
            for (g, (sg, bg)) in s.iter_mut().zip(b.iter_mut()).enumerate() {
                *sg = d * sc[g] as i8 as f32;
                *bg = -32.0 * *sg;
            }
            for g in 0..8 {
                for l in 0..32 {
                    let lo = nibble(ql[64 * (g / 4) + 32 * (g % 2) + l], (g / 2) % 2);
                    let hi = (qh[32 * (g / 4) + l] >> (2 * (g % 4))) & 3;
                    q[32 * g + l] = lo | hi << 4;
                }
            }
        }
        IQ4NL => {
            s[0] = half16(x, 0);
            b[0] = -128.0 * s[0];
            for (l, c) in q.iter_mut().enumerate() {
                *c = iq4_code(nibble(x[2 + l % 16], l / 16));
            }
        }
        IQ4XS => {
            let qs = &x[8..136];
            for j in 0..8 {
                s[j] = iq4_xs_scale(x, j);
                b[j] = -128.0 * s[j];
                for l in 0..32 {
                    q[32 * j + l] = iq4_code(nibble(qs[16 * j + l % 16], l / 16));
                }
            }
        }
        F32 | F16 | BF16 => unreachable!("not an affine block type"),
    }
}

/// IQ4's 4-bit code `q` as the 8-bit code of the same value with zero point 128.
fn iq4_code(q: u8) -> u8 {
    (IQ4_VALUES[q as usize] as i16 + 128) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use rand::{Rng, SeedableRng};

    /// Random blocks of `t` with finite f16 fields (scales drawn small and positive or negative).
    fn random_blocks(t: BlockType, n: usize, rng: &mut impl Rng) -> Vec<u8> {
        let mut data: Vec<u8> = (0..t.size_of(n)).map(|_| rng.random()).collect();
        let halves: &[usize] = match t {
            BlockType::Q4_0 | BlockType::Q5_0 => &[0],
            BlockType::Q4_1 | BlockType::Q5_1 | BlockType::Q4K | BlockType::Q5K => &[0, 2],
            BlockType::Q8_0 | BlockType::IQ4NL | BlockType::IQ4XS => &[0],
            _ => &[208],
        };
        for blk in data.chunks_exact_mut(t.bytes()) {
            for &at in halves {
                let v = f16::from_f32(rng.random_range(-0.05..0.05)).to_bits();
                blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        data
    }

    #[test]
    fn affine_groups_give_the_dequantized_values() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for t in [
            BlockType::Q8_0,
            BlockType::Q4_0,
            BlockType::Q4_1,
            BlockType::Q5_0,
            BlockType::Q5_1,
            BlockType::Q4K,
            BlockType::Q5K,
            BlockType::Q6K,
            BlockType::IQ4NL,
            BlockType::IQ4XS,
        ] {
            let (rows, cols) = (3, 2 * 256);
            let data = random_blocks(t, rows * cols, &mut rng);
            let mut want = vec![0.0f32; rows * cols];
            t.dequantize(&data, &mut want);
            let w = Groups::of(t, &data, rows * cols)
                .unwrap()
                .into_weight(rows)
                .unwrap();
            let got = w.dequantize();
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                let tol = if matches!(t, BlockType::Q6K | BlockType::IQ4XS) {
                    e.abs() * 1e-7
                } else {
                    0.0
                };
                assert!((g - e).abs() <= tol, "{t:?} value {i}: {g} vs {e}");
            }
            let zero = matches!(
                t,
                BlockType::Q8_0 | BlockType::Q4_0 | BlockType::Q5_0 | BlockType::IQ4NL
            );
            assert_eq!(w.has_zero_points(), zero, "{t:?}");
        }
        assert!(Groups::of(BlockType::BF16, &[], 0).is_none());
    }
}
