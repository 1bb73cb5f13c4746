//! A linear layer's weights as loaded: `W: [out, in]` either dense in its checkpoint dtype or
//! MLX affine-quantized ([`AffineWeight`], chosen at load when `{prefix}.scales` exists; see
//! [`crate::quant`]), and an optional bias. This enum is the weight formats' seam on the host:
//! the CPU's products dispatch on it (`crate::layers::linear`), the GPU upload converts each
//! variant to its device format (`crate::gpu`).

use std::borrow::Cow;

use deltamoe_compute::dtype::f32_to_bf16;
use deltamoe_compute::{AffineWeight, DType, Tensor};

use crate::error::Result;
use crate::quant::load_affine;
use crate::weights::WeightStore;

/// A `[out, in]` weight matrix: dense or affine-quantized.
#[derive(Clone, Debug)]
pub enum LinearWeight {
    Dense(Tensor),
    /// Boxed: keeps `LinearWeight` (and every layer holding several) the size of a `Tensor`.
    Affine(Box<AffineWeight>),
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

impl LinearWeight {
    /// `{prefix}.weight` as `[out, inp]`: quantized when `{prefix}.scales` exists, else dense.
    pub fn load(store: &WeightStore, prefix: &str, out: usize, inp: usize) -> Result<Self> {
        match load_affine(store, prefix, &[], out, inp)? {
            Some(mut w) => Ok(LinearWeight::Affine(Box::new(w.remove(0)))),
            None => Ok(LinearWeight::Dense(
                store.get(&format!("{prefix}.weight"), &[out, inp])?,
            )),
        }
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
        let t = store.get(&format!("{prefix}.weight"), &[n, out, inp])?;
        Ok((0..n)
            .map(|e| LinearWeight::Dense(t.narrow(e, 1).reshape(vec![out, inp])))
            .collect())
    }

    pub fn out_features(&self) -> usize {
        match self {
            LinearWeight::Dense(t) => t.shape()[0],
            LinearWeight::Affine(w) => w.out_features(),
        }
    }

    pub fn in_features(&self) -> usize {
        match self {
            LinearWeight::Dense(t) => t.shape()[1],
            LinearWeight::Affine(w) => w.in_features(),
        }
    }

    /// Logical shape `[out, in]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.out_features(), self.in_features()]
    }

    /// Bytes held (packed words, scales and biases for quantized weights).
    pub fn nbytes(&self) -> usize {
        match self {
            LinearWeight::Dense(t) => t.nbytes(),
            LinearWeight::Affine(w) => w.nbytes(),
        }
    }

    pub fn as_dense(&self) -> Option<&Tensor> {
        match self {
            LinearWeight::Dense(t) => Some(t),
            LinearWeight::Affine(_) => None,
        }
    }

    pub fn as_affine(&self) -> Option<&AffineWeight> {
        match self {
            LinearWeight::Dense(_) => None,
            LinearWeight::Affine(w) => Some(w.as_ref()),
        }
    }

    /// The dense tensor, or for a quantized weight a bf16 copy of its dequantized values (for
    /// backends without quantized kernels).
    pub fn to_dense(&self) -> Cow<'_, Tensor> {
        match self {
            LinearWeight::Dense(t) => Cow::Borrowed(t),
            LinearWeight::Affine(w) => Cow::Owned(Tensor::from_half_bits(
                DType::BF16,
                vec![w.out_features(), w.in_features()],
                w.dequantize().iter().map(|&v| f32_to_bf16(v)).collect(),
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
