//! MLX affine-quantized weights.
//!
//! Format (the one `mlx.core.quantize` writes and mlx-lm checkpoints store): a linear weight
//! `W: [out, in]` is cut into groups of `group_size` (32, 64 or 128; 16 for GGUF's Q6_K)
//! consecutive weights along the input dim. Each group `g` of row `r` has one `scale[r, g]` and
//! one `bias[r, g]` in the model dtype (bf16/f16/f32), and each weight is an unsigned `bits`-bit
//! integer `q` with
//!
//! ```text
//! w[r, k] = q[r, k] · scale[r, k / group_size] + bias[r, k / group_size]
//! ```
//!
//! Layout: `words: u32 [out, in·bits/32]`, `scales`, `biases: [out, in/group_size]`, all
//! row-major. The q values of a row form one little-endian bit stream, value `k` at bit
//! `k·bits`, i.e. LSB first: for 2/4/8 bits word `j` holds values `j·(32/bits) ..` with value
//! `i` of the word at bits `i·bits ..`; 3, 5 and 6 bits pack across word boundaries (a group of
//! 32 values fills exactly `bits` words). Stacked experts (`[E, out, ...]`) are views of one
//! mapping, one [`AffineWeight`] per expert, no copies.
//!
//! Words are read as native `u32`, which equals the file's little-endian layout on every host
//! this engine targets (x86-64, aarch64). Mapped words need not be 4-byte aligned (mlx-lm does
//! not pad its safetensors headers, so whole shards can sit at an odd offset): they stay mapped,
//! and a misaligned row is copied into a small scratch buffer when a kernel reads it.

use std::borrow::Cow;

use std::sync::Arc;

use memmap2::Mmap;

use crate::tensor::Tensor;

/// Bit widths of the affine format.
pub const SUPPORTED_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
/// Group sizes of the affine format (16: GGUF's Q6_K sub-blocks; MLX writes 32, 64 or 128).
pub const SUPPORTED_GROUP_SIZES: [usize; 4] = [16, 32, 64, 128];

/// A quantized weight that cannot be built as asked. Messages are one line; the caller adds the
/// tensor or file name.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("bits {0} is not supported (use 2, 3, 4, 5, 6 or 8)")]
    Bits(u32),
    #[error("group size {0} is not supported (use 32, 64 or 128)")]
    GroupSize(usize),
    #[error("input dim {inp} is not a multiple of the group size {group_size}")]
    Indivisible { inp: usize, group_size: usize },
    #[error("{what} has {found} elements but [{out}, {inp}] at {bits} bits, group {group_size} needs {expected}")]
    Len {
        what: &'static str,
        found: usize,
        expected: usize,
        out: usize,
        inp: usize,
        bits: u32,
        group_size: usize,
    },
    #[error("scales are {scales} but biases are {biases}; both must have the model dtype")]
    DTypeMismatch { scales: String, biases: String },
    #[error("weight has a non-finite value at row {row}, column {col}")]
    NonFinite { row: usize, col: usize },
}

/// Check a (bits, group size) pair.
pub fn check_params(bits: u32, group_size: usize) -> Result<(), QuantError> {
    if !SUPPORTED_BITS.contains(&bits) {
        return Err(QuantError::Bits(bits));
    }
    // A group fills whole words (16 values at 3 or 5 bits would not).
    if !SUPPORTED_GROUP_SIZES.contains(&group_size)
        || !(group_size * bits as usize).is_multiple_of(32)
    {
        return Err(QuantError::GroupSize(group_size));
    }
    Ok(())
}

#[derive(Clone, Debug)]
enum WordStorage {
    /// A mapped file, any alignment.
    Mapped(Arc<Mmap>),
    Owned(Arc<Vec<u32>>),
}

/// Packed `u32` words, memory-mapped or owned. `offset` counts bytes for `Mapped`, words for
/// `Owned`; `len` counts words.
#[derive(Clone, Debug)]
pub struct PackedWords {
    storage: WordStorage,
    offset: usize,
    len: usize,
}

impl PackedWords {
    /// `len` words of a mapped file from `byte_offset` (any alignment); `None` when out of range.
    pub fn from_mmap(map: Arc<Mmap>, byte_offset: usize, len: usize) -> Option<PackedWords> {
        let end = byte_offset.checked_add(len.checked_mul(4)?)?;
        if end > map.len() {
            return None;
        }
        Some(PackedWords {
            storage: WordStorage::Mapped(map),
            offset: byte_offset,
            len,
        })
    }

    pub fn from_vec(words: Vec<u32>) -> PackedWords {
        let len = words.len();
        PackedWords {
            storage: WordStorage::Owned(Arc::new(words)),
            offset: 0,
            len,
        }
    }

    /// An owned copy of little-endian bytes (used when a mapped region is misaligned).
    pub fn from_le_bytes(bytes: &[u8]) -> PackedWords {
        PackedWords::from_vec(
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        )
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Words `start..start + n` as a slice: borrowed when the storage is aligned, else copied
    /// into `scratch`. Panics when out of range.
    pub fn range<'a>(&'a self, start: usize, n: usize, scratch: &'a mut Vec<u32>) -> &'a [u32] {
        assert!(start + n <= self.len, "PackedWords::range out of range");
        match &self.storage {
            WordStorage::Owned(v) => &v[self.offset + start..self.offset + start + n],
            WordStorage::Mapped(m) => {
                let bytes = &m[self.offset + 4 * start..self.offset + 4 * (start + n)];
                match bytemuck::try_cast_slice(bytes) {
                    Ok(words) => words,
                    Err(_) => {
                        scratch.clear();
                        scratch.extend(
                            bytes
                                .chunks_exact(4)
                                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                        );
                        scratch
                    }
                }
            }
        }
    }

    /// All words: borrowed when aligned, else a copy.
    pub fn to_slice(&self) -> Cow<'_, [u32]> {
        match &self.storage {
            WordStorage::Owned(v) => Cow::Borrowed(&v[self.offset..self.offset + self.len]),
            WordStorage::Mapped(m) => {
                let bytes = &m[self.offset..self.offset + 4 * self.len];
                match bytemuck::try_cast_slice(bytes) {
                    Ok(words) => Cow::Borrowed(words),
                    Err(_) => Cow::Owned(
                        bytes
                            .chunks_exact(4)
                            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect(),
                    ),
                }
            }
        }
    }

    /// Words `start..start + len`, sharing the storage. Panics when out of range (a caller bug:
    /// shapes are validated at load).
    pub fn slice(&self, start: usize, len: usize) -> PackedWords {
        assert!(start + len <= self.len, "PackedWords::slice out of range");
        let unit = match self.storage {
            WordStorage::Mapped(_) => 4,
            WordStorage::Owned(_) => 1,
        };
        PackedWords {
            storage: self.storage.clone(),
            offset: self.offset + unit * start,
            len,
        }
    }
}

/// An affine-quantized `[out, in]` matrix (see the module doc for the format).
#[derive(Clone, Debug)]
pub struct AffineWeight {
    bits: u32,
    group_size: usize,
    out: usize,
    inp: usize,
    words: PackedWords,
    scales: Tensor,
    biases: Tensor,
    /// Set by GPTQ/AWQ loaders: every scale is exact in f16 and every bias is `−z·scale` for an
    /// integer zero point `z` in `0..2^bits` (so a device may hold f16 scales and zero points).
    zero_points: bool,
}

impl AffineWeight {
    /// Assemble and validate: `words` holds `out · in·bits/32` words, `scales` and `biases`
    /// `out · in/group_size` elements each, in the same dtype (their shapes are not looked at,
    /// so stacked-expert views can be passed reshaped or not).
    pub fn new(
        bits: u32,
        group_size: usize,
        out: usize,
        inp: usize,
        words: PackedWords,
        scales: Tensor,
        biases: Tensor,
    ) -> Result<AffineWeight, QuantError> {
        check_params(bits, group_size)?;
        if !inp.is_multiple_of(group_size) {
            return Err(QuantError::Indivisible { inp, group_size });
        }
        let len_err = |what, found, expected| QuantError::Len {
            what,
            found,
            expected,
            out,
            inp,
            bits,
            group_size,
        };
        let n_words = out * inp * bits as usize / 32;
        if words.len() != n_words {
            return Err(len_err("weight", words.len(), n_words));
        }
        let n_groups = out * inp / group_size;
        if scales.len() != n_groups {
            return Err(len_err("scales", scales.len(), n_groups));
        }
        if biases.len() != n_groups {
            return Err(len_err("biases", biases.len(), n_groups));
        }
        if scales.dtype() != biases.dtype() {
            return Err(QuantError::DTypeMismatch {
                scales: scales.dtype().to_string(),
                biases: biases.dtype().to_string(),
            });
        }
        Ok(AffineWeight {
            bits,
            group_size,
            out,
            inp,
            words,
            scales,
            biases,
            zero_points: false,
        })
    }

    /// Marks the parameters as GPTQ/AWQ's: f16-exact scales and biases `−z·scale` with integer
    /// zero points `z` (the caller's guarantee; see [`AffineWeight::zero_point`]).
    pub fn with_zero_points(mut self) -> AffineWeight {
        self.zero_points = true;
        self
    }

    /// Whether the parameters are zero-point form ([`AffineWeight::with_zero_points`]).
    pub fn has_zero_points(&self) -> bool {
        self.zero_points
    }

    /// The integer zero point of a group of a zero-point weight: `−bias / scale` (0 for a zero
    /// scale, whose group is all zeros).
    pub fn zero_point(scale: f32, bias: f32) -> f32 {
        if scale == 0.0 {
            0.0
        } else {
            -bias / scale
        }
    }

    pub fn bits(&self) -> u32 {
        self.bits
    }

    pub fn group_size(&self) -> usize {
        self.group_size
    }

    /// Rows (`out`).
    pub fn out_features(&self) -> usize {
        self.out
    }

    /// Columns (`in`), in weights, not words.
    pub fn in_features(&self) -> usize {
        self.inp
    }

    pub fn words_per_row(&self) -> usize {
        self.inp * self.bits as usize / 32
    }

    pub fn groups_per_row(&self) -> usize {
        self.inp / self.group_size
    }

    /// All packed words, `[out, words_per_row]` (a copy only for a misaligned mapping).
    pub fn words(&self) -> Cow<'_, [u32]> {
        self.words.to_slice()
    }

    /// The packed words of row `r`: borrowed, or copied into `scratch` when misaligned.
    #[inline]
    pub fn row_words<'a>(&'a self, r: usize, scratch: &'a mut Vec<u32>) -> &'a [u32] {
        self.rows_words(r, 1, scratch)
    }

    /// The packed words of rows `r0..r0 + n` (borrowed, or copied into `scratch`).
    #[inline]
    pub fn rows_words<'a>(&'a self, r0: usize, n: usize, scratch: &'a mut Vec<u32>) -> &'a [u32] {
        let wpr = self.words_per_row();
        self.words.range(r0 * wpr, n * wpr, scratch)
    }

    pub fn scales(&self) -> &Tensor {
        &self.scales
    }

    pub fn biases(&self) -> &Tensor {
        &self.biases
    }

    /// Bytes of words, scales and biases.
    pub fn nbytes(&self) -> usize {
        self.words.len() * 4 + self.scales.nbytes() + self.biases.nbytes()
    }

    /// Storage bits per weight, scales and biases included.
    pub fn bits_per_weight(&self) -> f64 {
        self.nbytes() as f64 * 8.0 / (self.out * self.inp) as f64
    }

    /// Rows `start..start + n` as their own weight, sharing the storage. Panics when out of range.
    pub fn rows(&self, start: usize, n: usize) -> AffineWeight {
        assert!(start + n <= self.out, "AffineWeight::rows out of range");
        let (wpr, gpr) = (self.words_per_row(), self.groups_per_row());
        let flat = |t: &Tensor| t.reshape(vec![self.out, gpr]).narrow(start, n);
        AffineWeight {
            bits: self.bits,
            group_size: self.group_size,
            out: n,
            inp: self.inp,
            words: self.words.slice(start * wpr, n * wpr),
            scales: flat(&self.scales),
            biases: flat(&self.biases),
            zero_points: self.zero_points,
        }
    }

    /// Scales and biases of row `r` as f32, into `s` and `b` (`groups_per_row` each).
    #[inline]
    pub fn row_params(&self, r: usize, s: &mut [f32], b: &mut [f32]) {
        let gpr = self.groups_per_row();
        self.scales.data().read_f32(r * gpr, s);
        self.biases.data().read_f32(r * gpr, b);
    }

    /// Row `r` as f32 weights, `q·scale + bias`, into `out` (`in` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let gpr = self.groups_per_row();
        let mut s = vec![0.0f32; gpr];
        let mut b = vec![0.0f32; gpr];
        self.row_params(r, &mut s, &mut b);
        let mut scratch = vec![];
        unpack_row(self.row_words(r, &mut scratch), self.bits, out);
        for (g, chunk) in out.chunks_exact_mut(self.group_size).enumerate() {
            for v in chunk.iter_mut() {
                *v = *v * s[g] + b[g];
            }
        }
    }

    /// The whole matrix as f32, `[out, in]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.out * self.inp];
        for (r, row) in out.chunks_exact_mut(self.inp).enumerate() {
            self.dequantize_row(r, row);
        }
        out
    }
}

/// Unpack one row's bit stream into `out.len()` q values as f32 (any supported width).
pub fn unpack_row(words: &[u32], bits: u32, out: &mut [f32]) {
    let mask = (1u64 << bits) - 1;
    for (k, o) in out.iter_mut().enumerate() {
        let bit = k * bits as usize;
        let (w, sh) = (bit / 32, bit % 32);
        let mut v = (words[w] as u64) >> sh;
        if sh + bits as usize > 32 {
            v |= (words[w + 1] as u64) << (32 - sh);
        }
        *o = (v & mask) as f32;
    }
}

/// Pack q values (each `< 2^bits`) of one row into its bit stream; `words.len()` must be
/// `q.len()·bits/32`.
pub fn pack_row(q: &[u8], bits: u32, words: &mut [u32]) {
    // Codes stream into a 64-bit accumulator; each full 32 bits leave as a word.
    let (mut acc, mut held, mut out) = (0u64, 0u32, words.iter_mut());
    for &v in q {
        acc |= (v as u64) << held;
        held += bits;
        if held >= 32 {
            if let Some(w) = out.next() {
                *w = acc as u32;
            }
            acc >>= 32;
            held -= 32;
        }
    }
    if let (Some(w), true) = (out.next(), held > 0) {
        *w = acc as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn pack_unpack_round_trip_every_width() {
        for bits in SUPPORTED_BITS {
            let q: Vec<u8> = (0..64).map(|i| ((i * 7 + 3) % (1 << bits)) as u8).collect();
            let mut words = vec![0u32; 64 * bits as usize / 32];
            pack_row(&q, bits, &mut words);
            let mut back = vec![0.0f32; 64];
            unpack_row(&words, bits, &mut back);
            let back: Vec<u8> = back.iter().map(|&v| v as u8).collect();
            assert_eq!(back, q, "bits {bits}");
        }
        // LSB first: value 0 of a 4-bit row sits in the low nibble of word 0.
        let mut w = [0u32; 4];
        pack_row(
            &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0],
            4,
            &mut w[..2],
        );
        assert_eq!(w[0], 0x8765_4321);
    }

    #[test]
    fn misaligned_mapped_words_read_like_owned_ones() {
        let words: Vec<u32> = (0..24u32).map(|i| i.wrapping_mul(0x9E37_79B9)).collect();
        let path = std::env::temp_dir().join(format!("deltamoe-words-{}", std::process::id()));
        let mut bytes = vec![0xAAu8; 2];
        bytes.extend(words.iter().flat_map(|w| w.to_le_bytes()));
        std::fs::write(&path, &bytes).unwrap();
        let map = Arc::new(unsafe { Mmap::map(&std::fs::File::open(&path).unwrap()) }.unwrap());
        std::fs::remove_file(&path).unwrap();
        let mapped = PackedWords::from_mmap(map, 2, 24).unwrap();
        assert!(PackedWords::from_mmap(mapped_map(&mapped), 4, 24).is_none());
        assert_eq!(mapped.to_slice().as_ref(), &words[..]);
        let mut scratch = vec![];
        assert_eq!(
            mapped.slice(8, 16).range(4, 8, &mut scratch),
            &words[12..20]
        );
        let s = Tensor::from_f32(vec![3, 2], vec![0.5; 6]);
        let a = AffineWeight::new(4, 32, 3, 64, mapped, s.clone(), s.clone()).unwrap();
        let b =
            AffineWeight::new(4, 32, 3, 64, PackedWords::from_vec(words), s.clone(), s).unwrap();
        assert_eq!(a.dequantize(), b.dequantize());
        assert_eq!(
            a.rows(1, 2).row_words(1, &mut scratch),
            b.rows(2, 1).row_words(0, &mut vec![])
        );
    }

    fn mapped_map(w: &PackedWords) -> Arc<Mmap> {
        match &w.storage {
            WordStorage::Mapped(m) => m.clone(),
            WordStorage::Owned(_) => unreachable!(),
        }
    }

    #[test]
    fn shapes_are_checked() {
        let s = Tensor::from_f32(vec![2, 2], vec![1.0; 4]);
        let words = PackedWords::from_vec(vec![0; 2 * 8]);
        let ok = AffineWeight::new(4, 32, 2, 64, words.clone(), s.clone(), s.clone()).unwrap();
        assert_eq!(ok.words_per_row(), 8);
        assert_eq!(ok.rows(1, 1).words().len(), 8);
        let e = AffineWeight::new(8, 32, 2, 64, words.clone(), s.clone(), s.clone()).unwrap_err();
        assert!(e.to_string().contains("weight has 16 elements"), "{e}");
        let e = AffineWeight::new(4, 48, 2, 96, words.clone(), s.clone(), s.clone()).unwrap_err();
        assert_eq!(e, QuantError::GroupSize(48));
        let h = Tensor::from_half_bits(DType::BF16, vec![2, 2], vec![0; 4]);
        let e = AffineWeight::new(4, 32, 2, 64, words, s, h).unwrap_err();
        assert!(e.to_string().contains("biases are BF16"), "{e}");
    }
}
