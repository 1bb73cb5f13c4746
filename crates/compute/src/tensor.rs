//! Weight tensors: a dtype, a shape and storage that is either a memory-mapped file region or an
//! owned buffer. Views along the first dimension ([`Tensor::narrow`]) share the storage, so a
//! fused expert tensor `[E, 2I, H]` yields each expert's gate and up matrices without copies.

use std::sync::Arc;

use half::{bf16, f16};
use memmap2::Mmap;

use crate::dtype::{bf16_to_f32, DType};

#[derive(Clone, Debug)]
enum Storage {
    /// Bytes of a memory-mapped file; the region is aligned for the dtype (checked at creation).
    Mapped(Arc<Mmap>),
    F32(Arc<Vec<f32>>),
    Half(Arc<Vec<u16>>),
}

/// A weight tensor. `offset` and `len` count elements within the storage (bytes for `Mapped`
/// are `offset * dtype.size()`).
#[derive(Clone, Debug)]
pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    storage: Storage,
    offset: usize,
    len: usize,
}

/// Typed borrowed view of a tensor's elements.
#[derive(Clone, Copy, Debug)]
pub enum TensorData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl<'a> TensorData<'a> {
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(s) => s.len(),
            TensorData::F16(s) => s.len(),
            TensorData::BF16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `start..start + out.len()` converted to f32 into `out`.
    #[inline(always)]
    pub fn read_f32(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            TensorData::F32(s) => out.copy_from_slice(&s[start..start + n]),
            TensorData::F16(s) => {
                for (o, v) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = v.to_f32();
                }
            }
            TensorData::BF16(s) => {
                for (o, v) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = bf16_to_f32(v.to_bits());
                }
            }
        }
    }
}

impl Tensor {
    /// A tensor over `len` elements of a mapped file starting at `byte_offset`. Returns `None`
    /// when the region is not aligned for the dtype or lies outside the map.
    pub fn from_mmap(
        map: Arc<Mmap>,
        byte_offset: usize,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Option<Tensor> {
        let len: usize = shape.iter().product();
        let end = byte_offset.checked_add(len.checked_mul(dtype.size())?)?;
        let base = map.as_ptr() as usize;
        if end > map.len() || !(base + byte_offset).is_multiple_of(dtype.size()) {
            return None;
        }
        Some(Tensor {
            dtype,
            shape,
            storage: Storage::Mapped(map),
            offset: byte_offset / dtype.size(),
            len,
        })
    }

    /// An owned f32 tensor. Panics if `data.len()` is not the product of `shape` (a caller bug).
    pub fn from_f32(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape/data mismatch"
        );
        let len = data.len();
        Tensor {
            dtype: DType::F32,
            shape,
            storage: Storage::F32(Arc::new(data)),
            offset: 0,
            len,
        }
    }

    /// An owned 16-bit tensor (bf16 or f16 bit patterns).
    pub fn from_half_bits(dtype: DType, shape: Vec<usize>, bits: Vec<u16>) -> Tensor {
        assert!(dtype != DType::F32, "from_half_bits takes a 16-bit dtype");
        assert_eq!(
            shape.iter().product::<usize>(),
            bits.len(),
            "shape/data mismatch"
        );
        let len = bits.len();
        Tensor {
            dtype,
            shape,
            storage: Storage::Half(Arc::new(bits)),
            offset: 0,
            len,
        }
    }

    /// An owned tensor from little-endian bytes (used when a mapped region is misaligned).
    pub fn from_le_bytes(dtype: DType, shape: Vec<usize>, bytes: &[u8]) -> Tensor {
        match dtype {
            DType::F32 => Tensor::from_f32(
                shape,
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            _ => Tensor::from_half_bits(
                dtype,
                shape,
                bytes
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
        }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes the elements occupy.
    pub fn nbytes(&self) -> usize {
        self.len * self.dtype.size()
    }

    /// Typed view of the elements.
    pub fn data(&self) -> TensorData<'_> {
        let (o, n) = (self.offset, self.len);
        match &self.storage {
            Storage::F32(v) => TensorData::F32(&v[o..o + n]),
            Storage::Half(v) => half_view(self.dtype, bytemuck::cast_slice(&v[o..o + n])),
            Storage::Mapped(m) => {
                let bytes = &m[o * self.dtype.size()..(o + n) * self.dtype.size()];
                match self.dtype {
                    // Alignment was checked in `from_mmap`.
                    DType::F32 => TensorData::F32(bytemuck::cast_slice(bytes)),
                    _ => half_view(self.dtype, bytemuck::cast_slice(bytes)),
                }
            }
        }
    }

    /// All elements as f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len];
        self.data().read_f32(0, &mut out);
        out
    }

    /// Rows `start..start + n` of the first dimension, sharing the storage.
    /// Panics when out of range (a caller bug: shapes are validated at load).
    pub fn narrow(&self, start: usize, n: usize) -> Tensor {
        assert!(
            !self.shape.is_empty() && start + n <= self.shape[0],
            "narrow out of range"
        );
        let inner: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = n;
        Tensor {
            dtype: self.dtype,
            shape,
            storage: self.storage.clone(),
            offset: self.offset + start * inner,
            len: n * inner,
        }
    }

    /// Same elements under a new shape with the same element count.
    pub fn reshape(&self, shape: Vec<usize>) -> Tensor {
        assert_eq!(
            shape.iter().product::<usize>(),
            self.len,
            "reshape changes element count"
        );
        Tensor {
            shape,
            ..self.clone()
        }
    }

    /// A copy whose rows are gathered from `self` in the order of `rows` (first dimension).
    pub fn gather_rows(&self, rows: &[usize]) -> Tensor {
        let inner: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = rows.len();
        match self.data() {
            TensorData::F32(s) => {
                let mut out = Vec::with_capacity(rows.len() * inner);
                for &r in rows {
                    out.extend_from_slice(&s[r * inner..(r + 1) * inner]);
                }
                Tensor::from_f32(shape, out)
            }
            TensorData::F16(s) => {
                gather_bits(self.dtype, shape, bytemuck::cast_slice(s), rows, inner)
            }
            TensorData::BF16(s) => {
                gather_bits(self.dtype, shape, bytemuck::cast_slice(s), rows, inner)
            }
        }
    }
}

fn half_view(dtype: DType, bits: &[u16]) -> TensorData<'_> {
    match dtype {
        DType::F16 => TensorData::F16(bytemuck::cast_slice(bits)),
        _ => TensorData::BF16(bytemuck::cast_slice(bits)),
    }
}

fn gather_bits(dtype: DType, shape: Vec<usize>, s: &[u16], rows: &[usize], inner: usize) -> Tensor {
    let mut out = Vec::with_capacity(rows.len() * inner);
    for &r in rows {
        out.extend_from_slice(&s[r * inner..(r + 1) * inner]);
    }
    Tensor::from_half_bits(dtype, shape, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrow_and_gather_share_layout() {
        let t = Tensor::from_f32(vec![3, 2], vec![0., 1., 2., 3., 4., 5.]);
        assert_eq!(t.narrow(1, 2).to_f32_vec(), vec![2., 3., 4., 5.]);
        assert_eq!(t.gather_rows(&[2, 0]).to_f32_vec(), vec![4., 5., 0., 1.]);
        let b = Tensor::from_half_bits(
            DType::BF16,
            vec![2, 2],
            [1.0f32, -2.0, 0.5, 3.0]
                .iter()
                .map(|&x| bf16::from_f32(x).to_bits())
                .collect(),
        );
        assert_eq!(b.narrow(1, 1).to_f32_vec(), vec![0.5, 3.0]);
        assert_eq!(
            b.gather_rows(&[1, 0]).to_f32_vec(),
            vec![0.5, 3.0, 1.0, -2.0]
        );
    }
}
