//! GGUF tensor types and their dequantization to f32, from the ggml block layouts. Each block
//! type packs `block` consecutive values of a row into `bytes` bytes; a row of `n` values is
//! `n / block` blocks. The arithmetic is that of gguf-py's reference dequantizers (f16 and bf16
//! fields widened to f32, then single f32 multiplies and adds in the order they use, no fused
//! multiply-adds), so the values are bit for bit theirs.

use half::f16;

/// A GGUF tensor type this reader takes (`ggml_type` ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
}

/// The 16 values of a 4-bit non-linear code (IQ4_NL, IQ4_XS).
pub(super) const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Values of a k-quant super-block.
const QK_K: usize = 256;

impl BlockType {
    /// The type of `ggml_type` id `id`, or None for one this reader does not take.
    pub fn from_id(id: u32) -> Option<BlockType> {
        use BlockType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            20 => IQ4NL,
            23 => IQ4XS,
            30 => BF16,
            _ => return None,
        })
    }

    /// ggml's name of a type id (for messages about ones this reader does not take).
    pub fn id_name(id: u32) -> &'static str {
        const NAMES: [&str; 31] = [
            "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
            "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
            "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
            "BF16",
        ];
        NAMES.get(id as usize).copied().unwrap_or("unknown")
    }

    /// ggml's name of the type (`Q4_K`).
    pub fn name(self) -> &'static str {
        use BlockType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            BF16 => "BF16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            IQ4NL => "IQ4_NL",
            IQ4XS => "IQ4_XS",
        }
    }

    /// Values a block holds.
    pub fn block(self) -> usize {
        use BlockType::*;
        match self {
            F32 | F16 | BF16 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4NL => 32,
            Q4K | Q5K | Q6K | IQ4XS => QK_K,
        }
    }

    /// Bytes a block takes.
    pub fn bytes(self) -> usize {
        use BlockType::*;
        match self {
            F32 => 4,
            F16 | BF16 => 2,
            Q4_0 | IQ4NL => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q4K => 144,
            Q5K => 176,
            Q6K => 210,
            IQ4XS => 136,
        }
    }

    /// Bytes of `n` values (`n` a multiple of [`Self::block`]).
    pub fn size_of(self, n: usize) -> usize {
        n / self.block() * self.bytes()
    }

    /// Dequantizes whole blocks `data` into `out` (`out.len()` = blocks · [`Self::block`]).
    pub fn dequantize(self, data: &[u8], out: &mut [f32]) {
        let (b, nb) = (self.block(), self.bytes());
        for (blk, o) in data.chunks_exact(nb).zip(out.chunks_exact_mut(b)) {
            self.dequantize_block(blk, o);
        }
    }

    fn dequantize_block(self, x: &[u8], o: &mut [f32]) {
        use BlockType::*;
        match self {
            F32 => o[0] = f32::from_le_bytes([x[0], x[1], x[2], x[3]]),
            F16 => o[0] = half16(x, 0),
            BF16 => o[0] = f32::from_bits((u16::from_le_bytes([x[0], x[1]]) as u32) << 16),
            Q8_0 => {
                let d = half16(x, 0);
                for (v, &q) in o.iter_mut().zip(&x[2..34]) {
                    *v = q as i8 as f32 * d;
                }
            }
            Q4_0 | IQ4NL => {
                let d = half16(x, 0);
                for (l, v) in o.iter_mut().enumerate() {
                    let q = nibble(x[2 + l % 16], l / 16);
                    let q = match self {
                        Q4_0 => q as i8 - 8,
                        _ => IQ4_VALUES[q as usize],
                    };
                    *v = d * q as f32;
                }
            }
            Q4_1 => {
                let (d, m) = (half16(x, 0), half16(x, 2));
                for (l, v) in o.iter_mut().enumerate() {
                    *v = d * nibble(x[4 + l % 16], l / 16) as f32 + m;
                }
            }
            Q5_0 | Q5_1 => {
                let at = if self == Q5_0 { 2 } else { 4 };
                let qh = u32::from_le_bytes([x[at], x[at + 1], x[at + 2], x[at + 3]]);
                let d = half16(x, 0);
                for (l, v) in o.iter_mut().enumerate() {
                    let q = nibble(x[at + 4 + l % 16], l / 16) | (((qh >> l) & 1) as u8) << 4;
                    *v = match self {
                        Q5_0 => d * (q as i8 - 16) as f32,
                        _ => d * q as f32 + half16(x, 2),
                    };
                }
            }
            Q4K | Q5K => k_quant(self, x, o),
            Q6K => q6_k(x, o),
            IQ4XS => iq4_xs(x, o),
        }
    }
}

/// The f16 at byte `at`, as f32.
pub(super) fn half16(x: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([x[at], x[at + 1]])).to_f32()
}

/// Low (`hi` 0) or high (1) nibble of `b`.
pub(super) fn nibble(b: u8, hi: usize) -> u8 {
    (b >> (4 * hi)) & 0x0F
}

/// Scale and min of sub-block `j` (0..8) of the 12 packed bytes `s` of Q4_K and Q5_K: 6 bits
/// each, the first four in the low bits of bytes 0..8, the last four split between the nibbles
/// of bytes 8..12 and the top two bits of bytes 0..8.
pub(super) fn scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 0x3F, s[j + 4] & 0x3F)
    } else {
        let i = j - 4;
        let sc = (s[8 + i] & 0x0F) | ((s[i] >> 2) & 0x30);
        let m = (s[8 + i] >> 4) | ((s[i + 4] >> 2) & 0x30);
        (sc, m)
    }
}

/// Q4_K (d, dmin, 12 scale bytes, 128 bytes of nibbles) and Q5_K (the same with 32 bytes of
/// fifth bits before the nibbles): 8 sub-blocks of 32, value = d·sc·q − dmin·m. Nibble bytes
/// 32c..32c + 32 hold sub-block 2c in their low nibbles and 2c + 1 in their high ones; bit s of
/// high-bit byte l is value l of sub-block s.
fn k_quant(t: BlockType, x: &[u8], o: &mut [f32]) {
    let (d, dmin) = (half16(x, 0), half16(x, 2));
    let scales = &x[4..16];
    let (qh, qs) = match t {
        BlockType::Q5K => (Some(&x[16..48]), &x[48..176]),
        _ => (None, &x[16..144]),
    };
    for j in 0..8 {
        let (sc, m) = scale_min(scales, j);
        let (dj, mj) = (d * sc as f32, dmin * m as f32);
        for l in 0..32 {
            let mut q = nibble(qs[32 * (j / 2) + l], j % 2);
            if let Some(qh) = qh {
                q |= ((qh[l] >> j) & 1) << 4;
            }
            o[32 * j + l] = dj * q as f32 - mj;
        }
    }
}

/// Q6_K (128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, d): 16 sub-blocks of
/// 16, value = d·scale·(q − 32). Group g (0..8) of 32 values takes nibble (g / 2) % 2 of low
/// bytes 64(g / 4) + 32(g % 2) + l and bit pair g % 4 of high bytes 32(g / 4) + l.
fn q6_k(x: &[u8], o: &mut [f32]) {
    let (ql, qh, sc) = (&x[..128], &x[128..192], &x[192..208]);
    let d = half16(x, 208);
    for g in 0..8 {
        for l in 0..32 {
            let lo = nibble(ql[64 * (g / 4) + 32 * (g % 2) + l], (g / 2) % 2);
            let hi = (qh[32 * (g / 4) + l] >> (2 * (g % 4))) & 3;
            let q = (lo | hi << 4) as i8 - 32;
            let i = 32 * g + l;
            o[i] = d * sc[i / 16] as i8 as f32 * q as f32;
        }
    }
}

/// IQ4_XS (d, 2 bytes of scale high bits, 4 of scale low nibbles, 128 of codes): 8 sub-blocks of
/// 32, value = d·(scale − 32)·IQ4_VALUES[code]; sub-block j's codes are the low then the high
/// nibbles of bytes 16j..16j + 16.
fn iq4_xs(x: &[u8], o: &mut [f32]) {
    let qs = &x[8..136];
    for j in 0..8 {
        let dl = iq4_xs_scale(x, j);
        for l in 0..32 {
            let q = nibble(qs[16 * j + l % 16], l / 16);
            o[32 * j + l] = dl * IQ4_VALUES[q as usize] as f32;
        }
    }
}

/// The scale `d·(sc − 32)` of sub-block `j` (0..8) of IQ4_XS block `x`: `sc` is 6 bits, the low
/// nibble from bytes 4..8 and the top two bits from the u16 at bytes 2..4.
pub(super) fn iq4_xs_scale(x: &[u8], j: usize) -> f32 {
    let sh = u16::from_le_bytes([x[2], x[3]]);
    let sc = nibble(x[4 + j / 2], j % 2) | (((sh >> (2 * j)) & 3) as u8) << 4;
    half16(x, 0) * (sc as i8 - 32) as f32
}

#[cfg(test)]
mod tests {
    use super::BlockType;

    #[test]
    fn every_type_round_trips_its_id_and_sizes_rows() {
        for id in 0..40 {
            if let Some(t) = BlockType::from_id(id) {
                assert_eq!(t.bytes() % 2, 0, "{t:?}");
                assert_eq!(t.size_of(t.block() * 3), 3 * t.bytes());
            }
        }
        assert_eq!(BlockType::from_id(10), None);
        assert_eq!(BlockType::id_name(10), "Q2_K");
        assert_eq!(BlockType::id_name(99), "unknown");
    }

    #[test]
    fn q8_0_and_q4_0_blocks_decode_by_hand() {
        // d = 0.5 (f16 0x3800).
        let mut b = vec![0x00, 0x38];
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut o = [0.0f32; 32];
        BlockType::Q8_0.dequantize(&b, &mut o);
        assert_eq!(o[0], -8.0);
        assert_eq!(o[31], 7.5);
        let mut b = vec![0x00, 0x38];
        b.extend((0..16).map(|i| (i as u8) | (15 - i as u8) << 4));
        BlockType::Q4_0.dequantize(&b, &mut o);
        assert_eq!((o[0], o[15], o[16], o[31]), (-4.0, 3.5, 3.5, -4.0));
    }
}
