//! A loaded checkpoint: the model's weights by layer kind, every tensor's shape checked against
//! the config as it is read. Both backends are built from it: the CPU model runs its layers
//! ([`crate::layers`], [`crate::Qwen3Hybrid`]) and the GPU model uploads them ([`crate::gpu`]).
//! A weight format enters here ([`LinearWeight`]); a layer kind is one file here and one arm in
//! [`load_layer`].

pub mod attention;
pub mod gdn;
pub mod heads;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod mtp;

pub use attention::Attention;
pub use gdn::GatedDeltaNet;
pub use linear::{DenseSource, Linear, LinearWeight};
pub use mlp::Mlp;
pub use moe::Moe;
pub use mtp::Mtp;

use crate::config::{FfnKind, LayerKind, ModelConfig};
use crate::error::Result;
use crate::weights::WeightStore;

#[derive(Clone, Debug)]
pub enum Mixer {
    Linear(GatedDeltaNet),
    Full(Attention),
}

#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)] // one per layer; boxing buys nothing
pub enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

#[derive(Clone, Debug)]
pub struct Layer {
    pub input_norm: Vec<f32>,
    pub mixer: Mixer,
    pub post_norm: Vec<f32>,
    pub ffn: Ffn,
}

/// The weights of a Qwen3 hybrid model, as loaded.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub config: ModelConfig,
    pub embed: LinearWeight,
    pub layers: Vec<Layer>,
    pub final_norm: Vec<f32>,
    pub lm_head: LinearWeight,
    /// The multi-token-prediction layer, when the checkpoint has one.
    pub mtp: Option<Mtp>,
}

impl Checkpoint {
    /// Read every tensor of config `config` from `store` (the lm_head tied to the embedding when
    /// configured), checking its shape.
    pub fn from_store(config: ModelConfig, store: &WeightStore) -> Result<Checkpoint> {
        let c = &config;
        let (v, h) = (c.vocab_size, c.hidden_size);
        let embed = LinearWeight::load(store, "model.embed_tokens", v, h)?;
        let lm_head = if c.tie_word_embeddings {
            embed.clone()
        } else {
            LinearWeight::load(store, "lm_head", v, h)?
        };
        let layers = (0..c.num_layers)
            .map(|i| load_layer(store, c, i))
            .collect::<Result<Vec<_>>>()?;
        let mtp = Mtp::load(store, c)?;
        Ok(Checkpoint {
            embed,
            lm_head,
            layers,
            final_norm: store.zero_centred_norm("model.norm.weight", h)?,
            mtp,
            config,
        })
    }

    /// Bytes of the weights as loaded (matrices in their stored format, vectors as f32), and of
    /// them the routed experts': what uploading them takes on a device, within its small
    /// vectors. The MTP layer is not counted: the GPU model does not upload it.
    pub fn weight_bytes(&self) -> (usize, usize) {
        let mut total = self.embed.nbytes() + vec_bytes(&[&self.final_norm]);
        if !self.config.tie_word_embeddings {
            total += self.lm_head.nbytes();
        }
        let mut experts = 0;
        for l in &self.layers {
            let (t, e) = l.weight_bytes();
            total += t;
            experts += e;
        }
        (total, experts)
    }
}

fn linear_bytes(l: &Linear) -> usize {
    l.weight.nbytes() + l.bias.as_ref().map_or(0, |b| 4 * b.len())
}

fn vec_bytes(v: &[&Vec<f32>]) -> usize {
    v.iter().map(|x| 4 * x.len()).sum()
}

impl Layer {
    /// Bytes of the layer's weights as loaded, and of them the routed experts'.
    fn weight_bytes(&self) -> (usize, usize) {
        let lin = linear_bytes;
        let mixer = match &self.mixer {
            Mixer::Full(a) => {
                lin(&a.q_proj)
                    + lin(&a.k_proj)
                    + lin(&a.v_proj)
                    + lin(&a.o_proj)
                    + vec_bytes(&[&a.q_norm, &a.k_norm])
            }
            Mixer::Linear(g) => {
                let proj = match &g.proj {
                    gdn::InProj::Split { qkv, z, b, a } => lin(qkv) + lin(z) + lin(b) + lin(a),
                    gdn::InProj::Packed { qkvz, ba } => lin(qkvz) + lin(ba),
                };
                proj + lin(&g.out_proj) + vec_bytes(&[&g.conv_w, &g.neg_a, &g.dt_bias, &g.norm_w])
            }
        };
        let (ffn, experts) = match &self.ffn {
            Ffn::Dense(m) => (m.nbytes(), 0),
            Ffn::Moe(m) => {
                let routed: usize = m.experts.iter().map(Mlp::nbytes).sum();
                let rest = lin(&m.router) + m.shared.nbytes() + lin(&m.shared_gate);
                (routed + rest, routed)
            }
        };
        let norms = vec_bytes(&[&self.input_norm, &self.post_norm]);
        (norms + mixer + ffn, experts)
    }
}

/// Layer `i`'s weights, by the config's layer kinds.
fn load_layer(store: &WeightStore, c: &ModelConfig, i: usize) -> Result<Layer> {
    let p = format!("model.layers.{i}");
    load_block(store, c, &p, c.layer_kinds[i], c.ffn_kinds[i])
}

/// The decoder block under `p`: its mixer and ffn of the kinds given, and its norms.
pub(crate) fn load_block(
    store: &WeightStore,
    c: &ModelConfig,
    p: &str,
    mixer: LayerKind,
    ffn: FfnKind,
) -> Result<Layer> {
    let h = c.hidden_size;
    let mixer = match mixer {
        LayerKind::LinearAttention => {
            Mixer::Linear(GatedDeltaNet::load(store, &format!("{p}.linear_attn"), c)?)
        }
        LayerKind::FullAttention => {
            Mixer::Full(Attention::load(store, &format!("{p}.self_attn"), c)?)
        }
    };
    let ffn = match ffn {
        FfnKind::Dense => Ffn::Dense(Mlp::load(
            store,
            &format!("{p}.mlp"),
            h,
            c.intermediate_size,
        )?),
        FfnKind::Moe => Ffn::Moe(Moe::load(store, &format!("{p}.mlp"), c)?),
    };
    Ok(Layer {
        input_norm: store.zero_centred_norm(&format!("{p}.input_layernorm.weight"), h)?,
        mixer,
        post_norm: store.zero_centred_norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
        ffn,
    })
}
