//! The CPU twin of an upload: a checkpoint whose every matrix holds the values the GPU holds for
//! it (`DevFormat::arrays` of the stack it is part of): bf16 stacks as their bf16 values, affine
//! stacks with their codes and parameters in the stack's form (bf16, f16 scales and zero points,
//! or f32), the embedding in its lookup format, FP8 as it is. The CPU engine on this checkpoint
//! is the reference with the GPU's roundings that a CUDA run of a checkpoint the GPU does not
//! hold exactly (a GGUF's f32 router) is checked against. The stacks are the layers' uploads' (`layers/*.rs`), listed again here.

use deltamoe_compute::dtype::round_bf16;
use deltamoe_compute::{AffineWeight, DType, Tensor};

use super::format::{bf16_bits, f16_scales_zeros, DevFormat};
use crate::checkpoint::gdn::InProj;
use crate::checkpoint::{Checkpoint, Ffn, Layer, LinearWeight, Mixer};
use crate::error::{ModelError, Result};

/// `ckpt` with the weights its upload puts on the GPU (see the module doc).
pub fn held_checkpoint(ckpt: &Checkpoint) -> Result<Checkpoint> {
    let mut c = ckpt.clone();
    c.embed = held(DevFormat::lookup(&c.embed), &c.embed)?;
    hold(vec![&mut c.lm_head])?;
    for l in &mut c.layers {
        hold_layer(l)?;
    }
    if let Some(m) = &mut c.mtp {
        hold(vec![&mut m.fc.weight])?;
        hold_layer(&mut m.layer)?;
    }
    Ok(c)
}

fn hold_layer(l: &mut Layer) -> Result<()> {
    match &mut l.mixer {
        Mixer::Full(a) => {
            hold(vec![
                &mut a.q_proj.weight,
                &mut a.k_proj.weight,
                &mut a.v_proj.weight,
            ])?;
            hold(vec![&mut a.o_proj.weight])?;
        }
        Mixer::Linear(g) => {
            let (main, tail) = match &mut g.proj {
                InProj::Split { qkv, z, b, a } => (
                    vec![&mut qkv.weight, &mut z.weight],
                    vec![&mut b.weight, &mut a.weight],
                ),
                InProj::Packed { qkvz, ba } => (vec![&mut qkvz.weight], vec![&mut ba.weight]),
            };
            // As `GdnMixer::upload`: `[b; a]` in a stack of its own when the main rows are in
            // a quantized format that theirs is not.
            let (fm, ft) = (format_of(&main), format_of(&tail));
            if fm != DevFormat::Bf16 && fm != ft {
                hold(main)?;
                hold(tail)?;
            } else {
                hold(main.into_iter().chain(tail).collect())?;
            }
            hold(vec![&mut g.out_proj.weight])?;
        }
    }
    match &mut l.ffn {
        Ffn::Dense(m) => {
            hold(vec![&mut m.gate.weight, &mut m.up.weight])?;
            hold(vec![&mut m.down.weight])?;
        }
        Ffn::Moe(m) => {
            hold(vec![&mut m.router.weight, &mut m.shared_gate.weight])?;
            // As `MoeFfn::upload`: the shared expert joins the routed stacks when alike.
            let i = m.experts[0].gate.out_features();
            let stacked = m.shared.gate.out_features() == i
                && m.shared.gate.weight.stored_alike(&m.experts[0].gate.weight);
            let mut mlps: Vec<_> = m.experts.iter_mut().collect();
            if stacked {
                mlps.push(&mut m.shared);
            } else {
                hold(vec![&mut m.shared.gate.weight, &mut m.shared.up.weight])?;
                hold(vec![&mut m.shared.down.weight])?;
            }
            let (mut gu, mut down) = (Vec::new(), Vec::new());
            for x in mlps {
                gu.extend([&mut x.gate.weight, &mut x.up.weight]);
                down.push(&mut x.down.weight);
            }
            hold(gu)?;
            hold(down)?;
        }
    }
    Ok(())
}

fn format_of(parts: &[&mut LinearWeight]) -> DevFormat {
    DevFormat::of(&parts.iter().map(|p| &**p).collect::<Vec<_>>())
}

/// The parts of one stack, each replaced by what the GPU holds for it.
fn hold(parts: Vec<&mut LinearWeight>) -> Result<()> {
    let format = format_of(&parts);
    for p in parts {
        *p = held(format, p)?;
    }
    Ok(())
}

/// `w`, one part of a stack in `format`, as the GPU holds it.
fn held(format: DevFormat, w: &LinearWeight) -> Result<LinearWeight> {
    let bad = |e: deltamoe_compute::QuantError| ModelError::Input(e.to_string());
    Ok(match (format, w.as_affine()) {
        (DevFormat::Bf16, _) => {
            let [n, k] = w.shape();
            LinearWeight::Dense(Tensor::from_half_bits(
                DType::BF16,
                vec![n, k],
                bf16_bits(w),
            ))
        }
        (DevFormat::Affine { params, .. }, Some(a)) => {
            let shape = a.scales().shape().to_vec();
            let (s, b) = match params {
                deltamoe_compute::cuda::ops::AffineParams::Bf16 => {
                    let r = |t: &Tensor| t.to_f32_vec().into_iter().map(round_bf16).collect();
                    (r(a.scales()), r(a.biases()))
                }
                deltamoe_compute::cuda::ops::AffineParams::F16Zero => {
                    let (s, z) = f16_scales_zeros(a);
                    let f = |v: u16| half::f16::from_bits(v).to_f32();
                    let s: Vec<f32> = s.into_iter().map(f).collect();
                    let b = z.into_iter().zip(&s).map(|(z, s)| -f(z) * s).collect();
                    (s, b)
                }
                deltamoe_compute::cuda::ops::AffineParams::F32 => {
                    (a.scales().to_f32_vec(), a.biases().to_f32_vec())
                }
            };
            let (n, k) = (a.out_features(), a.in_features());
            let words = deltamoe_compute::PackedWords::from_vec(a.words().into_owned());
            let (s, b) = (
                Tensor::from_f32(shape.clone(), s),
                Tensor::from_f32(shape, b),
            );
            let h = AffineWeight::new(a.bits(), a.group_size(), n, k, words, s, b).map_err(bad)?;
            LinearWeight::Affine(Box::new(match a.has_zero_points() {
                true => h.with_zero_points(),
                false => h,
            }))
        }
        _ => w.clone(),
    })
}
