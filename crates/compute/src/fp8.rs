//! Fine-grained FP8 weights, as Qwen's official `*-FP8` checkpoints store them.
//!
//! Format: a linear weight `W: [out, in]` is stored as one float8 e4m3 byte per weight
//! (`weight`, row-major) and a grid of scales `s: [⌈out/bn⌉, ⌈in/bk⌉]` (`weight_scale_inv`, any
//! float dtype; blocks of `bn × bk` = 128 × 128 in every checkpoint seen), with
//!
//! ```text
//! w[r, k] = e4m3(code[r, k]) · s[r / bn, k / bk]      (one f32 rounding)
//! ```
//!
//! Blocks at the right and bottom edges are partial. e4m3 (OCP FP8, the "fn" variant torch
//! calls `float8_e4m3fn`): sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
//! `S.1111.111` is NaN, largest finite 448, subnormals `m/8 · 2^-6`. Every e4m3 value is exact
//! in f32, bf16 and f16.
//!
//! A weight may be a row range of a larger matrix (the gate and up halves of a fused `[2I, H]`
//! expert): it keeps the index of its first row in the scale grid, so that block rows stay
//! where the checkpoint put them.

use std::sync::{Arc, OnceLock};

use memmap2::Mmap;

use crate::dtype::DType;

/// A weight that cannot be built as asked. Messages are one line; the caller adds the tensor
/// or file name.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Fp8Error {
    #[error("block size {0:?} is not supported (each side 1..=4096)")]
    Block([usize; 2]),
    #[error(
        "{what} has {found} elements but [{out}, {inp}] in blocks of {block:?} needs {expected}"
    )]
    Len {
        what: &'static str,
        found: usize,
        expected: usize,
        out: usize,
        inp: usize,
        block: [usize; 2],
    },
    #[error("scale at block ({row}, {col}) is {value}; scales must be finite")]
    Scale { row: usize, col: usize, value: f32 },
}

/// The e4m3 byte `b` as f32 (exact; NaN for `0x7f` and `0xff`).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xf, b & 7);
    if e == 15 && m == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m as f32 / 8.0 * (2.0f32).powi(-6)
    } else {
        (1.0 + m as f32 / 8.0) * (2.0f32).powi(e as i32 - 7)
    };
    sign * mag
}

/// All 256 e4m3 values, indexed by byte.
pub fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: OnceLock<[f32; 256]> = OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)))
}

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// `x` (|x| ≤ 448 after the caller's clamp; larger saturates) as the e4m3 byte nearest to it,
/// ties to the even code (round to nearest even, as torch's cast); NaN to 0x7f.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs().min(E4M3_MAX);
    // Non-negative finite codes 0x00..=0x7e increase with the code: the first not below `a`.
    let table = e4m3_table();
    let hi = table[..0x7f].partition_point(|&v| v < a);
    if hi == 0 || table[hi] == a {
        return sign | hi as u8;
    }
    let (lo_v, hi_v) = (table[hi - 1], table[hi]);
    let up = match (a - lo_v).partial_cmp(&(hi_v - a)) {
        Some(std::cmp::Ordering::Less) => false,
        Some(std::cmp::Ordering::Greater) => true,
        _ => hi % 2 == 0,
    };
    sign | if up { hi as u8 } else { hi as u8 - 1 }
}

/// A `[rows, cols]` block of rows (`w`, rows starting on a block row) quantized as Qwen's FP8
/// checkpoints are: per block of `block` the scale `s = amax / 448` (1 for an all-zero block),
/// codes `e4m3(clamp(w / s, ±448))`. Returns the codes `[rows, cols]` and the scales
/// `[⌈rows/bn⌉, ⌈cols/bk⌉]`.
pub fn quantize_blocks(w: &[f32], cols: usize, block: [usize; 2]) -> (Vec<u8>, Vec<f32>) {
    let rows = w.len() / cols.max(1);
    let (gr, gc) = (blocks(rows, block[0]), blocks(cols, block[1]));
    let mut scales = vec![0f32; gr * gc];
    for (i, s) in scales.iter_mut().enumerate() {
        let (r0, c0) = ((i / gc) * block[0], (i % gc) * block[1]);
        let amax = (r0..(r0 + block[0]).min(rows))
            .flat_map(|r| &w[r * cols + c0..r * cols + (c0 + block[1]).min(cols)])
            .fold(0f32, |m, v| m.max(v.abs()));
        *s = if amax == 0.0 { 1.0 } else { amax / E4M3_MAX };
    }
    let codes = w
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let s = scales[(i / cols / block[0]) * gc + (i % cols) / block[1]];
            f32_to_e4m3((v / s).clamp(-E4M3_MAX, E4M3_MAX))
        })
        .collect();
    (codes, scales)
}

#[derive(Clone, Debug)]
enum ByteStorage {
    Mapped(Arc<Mmap>),
    Owned(Arc<Vec<u8>>),
}

/// Bytes of a mapped file or an owned buffer (`offset`, `len` in bytes).
#[derive(Clone, Debug)]
pub struct Bytes {
    storage: ByteStorage,
    offset: usize,
    len: usize,
}

impl Bytes {
    /// `len` bytes of a mapped file from `offset`; `None` when out of range.
    pub fn from_mmap(map: Arc<Mmap>, offset: usize, len: usize) -> Option<Bytes> {
        (offset.checked_add(len)? <= map.len()).then_some(Bytes {
            storage: ByteStorage::Mapped(map),
            offset,
            len,
        })
    }

    pub fn from_vec(v: Vec<u8>) -> Bytes {
        let len = v.len();
        Bytes {
            storage: ByteStorage::Owned(Arc::new(v)),
            offset: 0,
            len,
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        let s: &[u8] = match &self.storage {
            ByteStorage::Mapped(m) => m,
            ByteStorage::Owned(v) => v,
        };
        &s[self.offset..self.offset + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes `start..start + len`, sharing the storage. Panics when out of range.
    pub fn slice(&self, start: usize, len: usize) -> Bytes {
        assert!(start + len <= self.len, "Bytes::slice out of range");
        Bytes {
            storage: self.storage.clone(),
            offset: self.offset + start,
            len,
        }
    }
}

/// A fine-grained FP8 `[out, in]` matrix (see the module doc).
#[derive(Clone, Debug)]
pub struct Fp8Weight {
    out: usize,
    inp: usize,
    block: [usize; 2],
    codes: Bytes,
    /// The scale grid this matrix's rows index, row-major `[grid_rows, grid_cols]`, as f32.
    scales: Arc<Vec<f32>>,
    /// Index of this matrix's row 0 among the rows the grid describes (0 unless a row view).
    row0: usize,
    /// dtype the checkpoint stored the scales in.
    scale_dtype: DType,
}

/// Blocks along `n` values in blocks of `b`.
pub fn blocks(n: usize, b: usize) -> usize {
    n.div_ceil(b)
}

impl Fp8Weight {
    /// Assemble and validate: `codes` holds `out · in` bytes, `scales` the `[⌈out/bn⌉,
    /// ⌈in/bk⌉]` grid as f32 (converted from `scale_dtype`), every scale finite.
    pub fn new(
        out: usize,
        inp: usize,
        block: [usize; 2],
        codes: Bytes,
        scales: Vec<f32>,
        scale_dtype: DType,
    ) -> Result<Fp8Weight, Fp8Error> {
        if block.iter().any(|&b| b == 0 || b > 4096) {
            return Err(Fp8Error::Block(block));
        }
        let len_err = |what, found, expected| Fp8Error::Len {
            what,
            found,
            expected,
            out,
            inp,
            block,
        };
        if codes.len() != out * inp {
            return Err(len_err("weight", codes.len(), out * inp));
        }
        let gc = blocks(inp, block[1]);
        let n_scales = blocks(out, block[0]) * gc;
        if scales.len() != n_scales {
            return Err(len_err("weight_scale_inv", scales.len(), n_scales));
        }
        if let Some(i) = scales.iter().position(|s| !s.is_finite()) {
            return Err(Fp8Error::Scale {
                row: i / gc,
                col: i % gc,
                value: scales[i],
            });
        }
        Ok(Fp8Weight {
            out,
            inp,
            block,
            codes,
            scales: Arc::new(scales),
            row0: 0,
            scale_dtype,
        })
    }

    pub fn out_features(&self) -> usize {
        self.out
    }

    pub fn in_features(&self) -> usize {
        self.inp
    }

    /// `[bn, bk]`: rows and inputs a scale covers.
    pub fn block(&self) -> [usize; 2] {
        self.block
    }

    pub fn scale_dtype(&self) -> DType {
        self.scale_dtype
    }

    /// The e4m3 bytes, `[out, in]` row-major.
    pub fn codes(&self) -> &[u8] {
        self.codes.as_slice()
    }

    /// Scale blocks along a row.
    pub fn grid_cols(&self) -> usize {
        blocks(self.inp, self.block[1])
    }

    /// The scales of row `r`'s block row, one per block of `bk` inputs.
    pub fn row_scales(&self, r: usize) -> &[f32] {
        let gc = self.grid_cols();
        let g = (self.row0 + r) / self.block[0];
        &self.scales[g * gc..(g + 1) * gc]
    }

    /// Row `r` dequantized into `out` (`in` values), as the format's formula rounds it.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let table = e4m3_table();
        let codes = &self.codes()[r * self.inp..(r + 1) * self.inp];
        let bk = self.block[1];
        for ((o, c), s) in out
            .chunks_mut(bk)
            .zip(codes.chunks(bk))
            .zip(self.row_scales(r))
        {
            for (v, &b) in o.iter_mut().zip(c) {
                *v = table[b as usize] * s;
            }
        }
    }

    /// All rows dequantized, `[out, in]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut v = vec![0.0; self.out * self.inp];
        for (r, row) in v.chunks_exact_mut(self.inp.max(1)).enumerate() {
            self.dequantize_row(r, row);
        }
        v
    }

    /// Bytes stored: one a weight plus the scales of the blocks this matrix covers (at the
    /// checkpoint's scale dtype).
    pub fn nbytes(&self) -> usize {
        let rows = blocks(self.row0 % self.block[0] + self.out, self.block[0]);
        self.out * self.inp + rows * self.grid_cols() * self.scale_dtype.size()
    }

    /// Storage bits per weight, scales included.
    pub fn bits_per_weight(&self) -> f64 {
        self.nbytes() as f64 * 8.0 / (self.out * self.inp).max(1) as f64
    }

    /// Rows `start..start + n` as their own weight, sharing codes and scales. Panics when out
    /// of range.
    pub fn rows(&self, start: usize, n: usize) -> Fp8Weight {
        assert!(start + n <= self.out, "Fp8Weight::rows out of range");
        Fp8Weight {
            out: n,
            codes: self.codes.slice(start * self.inp, n * self.inp),
            row0: self.row0 + start,
            ..self.clone()
        }
    }

    /// The scale grid rows this matrix's rows use, from block row `⌊row0 / bn⌋`, and the row
    /// offset of its row 0 inside the first of them: (scales `[rows, grid_cols]`, offset).
    pub fn scale_rows(&self) -> (&[f32], usize) {
        let (bn, gc) = (self.block[0], self.grid_cols());
        let g0 = self.row0 / bn;
        let g1 = blocks(self.row0 + self.out, bn);
        (&self.scales[g0 * gc..g1 * gc], self.row0 % bn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x80), -0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    }

    #[test]
    fn e4m3_encoding_round_trips_and_rounds_to_even() {
        for b in (0u8..=255).filter(|b| b & 0x7f != 0x7f) {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(b)), b, "{b:#04x}");
        }
        // Midway between 1 (0x38) and 1.125 (0x39): to the even code; just above: up.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.0626), 0x39);
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
        assert_eq!(f32_to_e4m3(1e-4), 0x00);
    }

    #[test]
    fn partial_blocks_and_row_views() {
        // [3, 5] in blocks of [2, 4]: grid [2, 2].
        let codes: Vec<u8> = (0..15).map(|i| 0x38 + i as u8).collect();
        let scales = vec![1.0, 2.0, 3.0, 4.0];
        let w = Fp8Weight::new(
            3,
            5,
            [2, 4],
            Bytes::from_vec(codes.clone()),
            scales,
            DType::F32,
        )
        .unwrap();
        let d = w.dequantize();
        for r in 0..3 {
            for k in 0..5 {
                let s = [1.0, 2.0, 3.0, 4.0][(r / 2) * 2 + k / 4];
                assert_eq!(d[r * 5 + k], e4m3_to_f32(codes[r * 5 + k]) * s);
            }
        }
        let v = w.rows(1, 2);
        assert_eq!(v.dequantize(), d[5..].to_vec());
        assert_eq!(v.scale_rows(), (&[1.0, 2.0, 3.0, 4.0][..], 1));
        let e = Fp8Weight::new(
            3,
            5,
            [2, 4],
            Bytes::from_vec(vec![0; 15]),
            vec![1.0; 3],
            DType::F32,
        )
        .unwrap_err();
        assert!(e.to_string().contains("weight_scale_inv has 3"), "{e}");
        let e = Fp8Weight::new(
            1,
            1,
            [1, 1],
            Bytes::from_vec(vec![0]),
            vec![f32::NAN],
            DType::F32,
        )
        .unwrap_err();
        assert!(matches!(e, Fp8Error::Scale { .. }));
    }
}
