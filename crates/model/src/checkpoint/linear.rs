//! A linear layer's weights as loaded: `W: [out, in]` dense in its checkpoint dtype, MLX
//! affine-quantized ([`AffineWeight`], chosen at load when `{prefix}.scales` exists; see
//! [`crate::quant`]; GPTQ/AWQ `{prefix}.qweight` is repacked into it, see [`crate::gptq`]) or fine-grained FP8 ([`Fp8Weight`], when `{prefix}.weight_scale_inv`
//! exists; see [`crate::fp8`]), and an optional bias. This enum is the weight formats' seam on the host:
//! the CPU's products dispatch on it (`crate::layers::linear`), the GPU upload converts each
//! variant to its device format (`crate::gpu`).

use std::borrow::Cow;

use deltamoe_compute::dtype::f32_to_bf16;
use deltamoe_compute::{AffineWeight, DType, Fp8Weight, Tensor};

use crate::error::Result;
use crate::fp8::load_fp8;
use crate::gptq::load_gptq;
use crate::quant::load_affine;
use crate::weights::WeightStore;

/// A `[out, in]` weight matrix: dense, affine-quantized or FP8.
#[derive(Clone, Debug)]
pub enum LinearWeight {
    Dense(Tensor),
    /// Boxed: keeps `LinearWeight` (and every layer holding several) the size of a `Tensor`.
    Affine(Box<AffineWeight>),
    Fp8(Box<Fp8Weight>),
}

impl From<Tensor> for LinearWeight {
    fn from(t: Tensor) -> Self {
        LinearWeight::Dense(t)
    }
}

impl From<AffineWeight> for LinearWeight {
    fn from(w: AffineWeight) -> Self {
        LinearWeight::Affine(Box::new(w))
    }
}

impl From<Fp8Weight> for LinearWeight {
    fn from(w: Fp8Weight) -> Self {
        LinearWeight::Fp8(Box::new(w))
    }
}

impl LinearWeight {
    /// `{prefix}.weight` as `[out, inp]`: GPTQ/AWQ repacked to affine when `{prefix}.qweight`
    /// exists, affine when `{prefix}.scales` does, FP8 when `{prefix}.weight_scale_inv` does,
    /// else dense.
    pub fn load(store: &WeightStore, prefix: &str, out: usize, inp: usize) -> Result<Self> {
        if let Some(w) = load_gptq(store, prefix, out, inp)? {
            return Ok(w.into());
        }
        if let Some(mut w) = load_affine(store, prefix, &[], out, inp)? {
            return Ok(w.remove(0).into());
        }
        if let Some(mut w) = load_fp8(store, prefix, &[], out, inp)? {
            return Ok(w.remove(0).into());
        }
        Ok(LinearWeight::Dense(
            store.get(&format!("{prefix}.weight"), &[out, inp])?,
        ))
    }

    /// Stacked experts `{prefix}.weight` `[n, out, inp]` (dense, or quantized with
    /// `{prefix}.scales`), one view per expert, no copies.
    pub fn load_stacked(
        store: &WeightStore,
        prefix: &str,
        n: usize,
        out: usize,
        inp: usize,
    ) -> Result<Vec<Self>> {
        if let Some(ws) = load_affine(store, prefix, &[n], out, inp)? {
            return Ok(ws.into_iter().map(LinearWeight::from).collect());
        }
        if let Some(ws) = load_fp8(store, prefix, &[n], out, inp)? {
            return Ok(ws.into_iter().map(LinearWeight::from).collect());
        }
        let t = store.get(&format!("{prefix}.weight"), &[n, out, inp])?;
        Ok((0..n)
            .map(|e| LinearWeight::Dense(t.narrow(e, 1).reshape(vec![out, inp])))
            .collect())
    }

    pub fn out_features(&self) -> usize {
        match self {
            LinearWeight::Dense(t) => t.shape()[0],
            LinearWeight::Affine(w) => w.out_features(),
            LinearWeight::Fp8(w) => w.out_features(),
        }
    }

    pub fn in_features(&self) -> usize {
        match self {
            LinearWeight::Dense(t) => t.shape()[1],
            LinearWeight::Affine(w) => w.in_features(),
            LinearWeight::Fp8(w) => w.in_features(),
        }
    }

    /// Logical shape `[out, in]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.out_features(), self.in_features()]
    }

    /// Bytes held (codes and scales (and biases) for quantized weights).
    pub fn nbytes(&self) -> usize {
        match self {
            LinearWeight::Dense(t) => t.nbytes(),
            LinearWeight::Affine(w) => w.nbytes(),
            LinearWeight::Fp8(w) => w.nbytes(),
        }
    }

    pub fn as_dense(&self) -> Option<&Tensor> {
        match self {
            LinearWeight::Dense(t) => Some(t),
            _ => None,
        }
    }

    pub fn as_affine(&self) -> Option<&AffineWeight> {
        match self {
            LinearWeight::Affine(w) => Some(w.as_ref()),
            _ => None,
        }
    }

    pub fn as_fp8(&self) -> Option<&Fp8Weight> {
        match self {
            LinearWeight::Fp8(w) => Some(w.as_ref()),
            _ => None,
        }
    }

    /// All values dequantized to f32, `[out, in]` (`None` for a dense weight: read it as is).
    pub fn dequantize(&self) -> Option<Vec<f32>> {
        match self {
            LinearWeight::Dense(_) => None,
            LinearWeight::Affine(w) => Some(w.dequantize()),
            LinearWeight::Fp8(w) => Some(w.dequantize()),
        }
    }

    /// The dense tensor, or for a quantized weight a bf16 copy of its dequantized values (for
    /// backends without quantized kernels).
    pub fn to_dense(&self) -> Cow<'_, Tensor> {
        match (self, self.dequantize()) {
            (LinearWeight::Dense(t), _) => Cow::Borrowed(t),
            (_, v) => Cow::Owned(Tensor::from_half_bits(
                DType::BF16,
                self.shape().to_vec(),
                v.unwrap_or_default()
                    .iter()
                    .map(|&v| f32_to_bf16(v))
                    .collect(),
            )),
        }
    }

    /// Rows in the order of `rows`, as a dense copy (dequantized to bf16 when quantized).
    pub fn gather_rows(&self, rows: &[usize]) -> Tensor {
        self.to_dense().gather_rows(rows)
    }

    /// Row `r` as f32 (an embedding lookup; quantized rows are dequantized).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            LinearWeight::Dense(t) => t.data().read_f32(r * out.len(), out),
            LinearWeight::Affine(w) => w.dequantize_row(r, out),
            LinearWeight::Fp8(w) => w.dequantize_row(r, out),
        }
    }
}

/// A weight that can be read as a dense tensor: a [`Tensor`] itself, or a [`LinearWeight`]
/// (quantized ones dequantized to bf16), for code that uploads dense matrices.
pub trait DenseSource {
    fn dense(&self) -> Cow<'_, Tensor>;
}

impl DenseSource for Tensor {
    fn dense(&self) -> Cow<'_, Tensor> {
        Cow::Borrowed(self)
    }
}

impl DenseSource for LinearWeight {
    fn dense(&self) -> Cow<'_, Tensor> {
        self.to_dense()
    }
}

#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: LinearWeight,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// Load `{prefix}.weight` of shape `[out, inp]` (dense or quantized) and, when `bias`,
    /// `{prefix}.bias`.
    pub fn load(
        store: &WeightStore,
        prefix: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Linear> {
        let weight = LinearWeight::load(store, prefix, out, inp)?;
        let bias = if bias {
            Some(store.vec_f32(&format!("{prefix}.bias"), out)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    pub fn new(weight: impl Into<LinearWeight>) -> Linear {
        Linear {
            weight: weight.into(),
            bias: None,
        }
    }

    pub fn out_features(&self) -> usize {
        self.weight.out_features()
    }
}
