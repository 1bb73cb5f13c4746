//! The choice of the fused decode form.
//!
//! In the fused form (one row, every mixer projection on the single-row tensor-core kernel) the
//! residual `x` is whole at every sublayer boundary: the input projection normalizes `x` as it
//! stages it and, for a GDN layer, runs the conv step on its output rows; the output projection
//! adds into `x`; the router normalizes `x` for the ffn and leaves that row in `normed` for the
//! experts (a router the kernel does not take, e.g. bf16 or 2-bit, or a dense ffn gets the norm
//! as its own launch); the expert down projections (or, with the shared expert apart or experts
//! on the host, the combine after them) add their weighted sum into `x`. That saves the
//! add+norm, conv and combine launches of every layer. Otherwise the norms run as their own
//! launches on `normed` and each sublayer's output waits in `delta` for the next add+norm.

use deltamoe_compute::cuda::ops::{Matvec, Slots};
use deltamoe_compute::cuda::vec;

/// Whether a step of `rows` rows runs the fused decode form: one row and every mixer input and
/// output projection (`mats`) taken by the single-row kernel.
pub(crate) fn fused_decode(rows: usize, mut mats: impl Iterator<Item = Matvec>) -> bool {
    rows == 1 && mats.all(|m| vec::takes(&m, &Slots::one()))
}

#[cfg(test)]
mod tests {
    use super::fused_decode;
    use deltamoe_compute::cuda::ops::{Matvec, WeightFormat};

    fn mat(n: usize, k: usize, bits: u32) -> Matvec {
        let format = match bits {
            16 => WeightFormat::Bf16,
            _ => WeightFormat::Affine {
                bits,
                group: 64,
                scales: 0,
                biases: 0,
            },
        };
        Matvec {
            w: 0,
            n,
            k,
            bias: 0,
            format,
        }
    }

    #[test]
    fn fused_decode_takes_one_row_of_4_and_8_bit_mixer_projections() {
        let layer = |bits| [mat(12_352, 2048, bits), mat(2048, 4096, bits)];
        assert!(fused_decode(1, layer(4).into_iter()));
        assert!(fused_decode(1, layer(8).into_iter()));
        // Batches, bf16 or 2-bit weights, or inputs past the staging limit (an 8-bit input
        // counts as two digits) do not.
        assert!(!fused_decode(2, layer(4).into_iter()));
        assert!(!fused_decode(1, [mat(2048, 4096, 16)].into_iter()));
        assert!(!fused_decode(1, [mat(2048, 4096, 2)].into_iter()));
        assert!(!fused_decode(1, [mat(2048, 16_384, 4)].into_iter()));
        assert!(!fused_decode(1, [mat(2048, 8192, 8)].into_iter()));
    }
}
