//! The embedding and the head on the GPU: token rows looked up (bf16, or affine rows
//! dequantized), and at the end the final RMSNorm, the lm_head and each row's next token picked
//! on the device (greedy or sampled).
use deltamoe_compute::cuda::ops;
use deltamoe_compute::cuda::vec::{self, VecIo};
use deltamoe_compute::cuda::{DevBuf, Gpu, Result};

use super::bufs::{PrefillScratch, LOGIT_ROWS};
use super::{rows_mv, Step};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::gpu::format::{DevFormat, DevMat};
use crate::gpu::random::Filler;
use crate::Logits;

pub(crate) struct Head {
    embed: DevMat,
    lm_head: DevMat,
    final_norm: DevBuf<f32>,
}

/// Where a decode step's head writes its picks: token ids `[rows]` (the step's inputs,
/// overwritten), and the pool's sampling words and positions.
pub(crate) struct Picks {
    pub tokens: u64,
    pub sampling: u64,
    pub pos: u64,
}

impl Head {
    /// A loaded model's embedding, lm_head and final norm on the device.
    pub fn upload(g: &Gpu, m: &Checkpoint) -> Result<Head> {
        let (v, h) = (m.config.vocab_size, m.config.hidden_size);
        Ok(Head {
            embed: DevMat::table(g, &m.embed, v, h)?,
            lm_head: DevMat::stack(g, &[&m.lm_head], v, h, None)?,
            final_norm: g.upload(&m.final_norm)?,
        })
    }

    /// Random weights of config `c`'s shape (the embedding bf16).
    pub fn random(f: &mut Filler, c: &ModelConfig) -> Result<Head> {
        let (v, h) = (c.vocab_size, c.hidden_size);
        Ok(Head {
            embed: f.mats_as(DevFormat::Bf16, 1, v, h)?,
            lm_head: f.lm_head(v, h)?,
            final_norm: f.vec(h, 0.5, 1.5)?,
        })
    }

    pub fn final_norm(&self) -> u64 {
        self.final_norm.ptr()
    }

    /// Bytes one decode step reads: an embedding row and the lm_head.
    pub fn bytes_per_token(&self) -> usize {
        self.embed.bytes() / self.embed.n + self.lm_head.bytes()
    }

    /// Weights one token multiplies (the embedding is a lookup).
    pub fn params(&self) -> usize {
        self.lm_head.params()
    }

    /// `x[r] = embed[tok[r]]` for `rows` rows.
    pub fn embed(&self, g: &Gpu, tok: u64, x: u64, rows: usize) -> Result<()> {
        ops::embed(g, self.embed.mv(), tok, x, self.embed.k, rows)
    }

    /// Final norm (unless the last layer applied it: `normed`), lm_head and each row's next
    /// token.
    pub fn decode(&self, st: &Step, normed: bool, out: Picks) -> Result<()> {
        let (g, s, b) = (st.g, st.s, st.rows());
        if st.fused {
            st.add_norm(0, self.final_norm.ptr())?;
        } else if !normed {
            st.add_norm(s.delta.ptr(), self.final_norm.ptr())?;
        }
        let (head, rows) = (self.lm_head.mv(), st.row_slots(st.hidden));
        // One row through the ring kernel: its blocks hand the sampler their largest logit and
        // its index, so a greedy pick need not scan the vocabulary.
        let ring = if b == 1 && vec::takes(&head, &rows) {
            vec::ring_blocks(g, &head)?
        } else {
            None
        };
        let best = ring.map(|n| (s.best.ptr(), n as usize));
        match best {
            Some((p, _)) => {
                let io = VecIo {
                    best: p,
                    ..VecIo::default()
                };
                vec::matvec(g, head, s.normed.ptr(), s.logits.ptr(), io)?;
            }
            None => ops::matvec(g, head, s.normed.ptr(), s.logits.ptr(), rows)?,
        }
        let v = self.lm_head.n;
        ops::sample_advance(
            g,
            s.logits.ptr(),
            v,
            out.sampling,
            out.tokens,
            out.pos,
            st.bt,
            best,
            !st.verify,
        )
    }

    /// A prefill pass's logits: final norm (joining `delta` to the residual `x`, unless `joined`
    /// says it was) and lm_head for the rows `which` wants of `t`, `LOGIT_ROWS` at a time;
    /// appended to `out` (All) or left as `out` (Last).
    pub fn prefill_logits(
        &self,
        g: &Gpu,
        ps: &PrefillScratch,
        (t, eps, joined): (usize, f32, bool),
        which: Logits,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let (h, v) = (self.embed.k, self.lm_head.n);
        let (x, delta, normed, logits) = (&ps.x, &ps.delta, &ps.normed, &ps.logits);
        let mut r0 = match which {
            Logits::All => 0,
            Logits::Last => t - 1,
        };
        while r0 < t {
            let n = (t - r0).min(LOGIT_ROWS);
            let dr = if joined { 0 } else { delta.at(r0 * h) };
            let (xr, nr) = (x.at(r0 * h), normed.at(r0 * h));
            ops::add_rmsnorm(g, xr, dr, self.final_norm.ptr(), nr, n, h, eps)?;
            rows_mv(g, self.lm_head.mv(), (nr, logits.ptr()), n, h, false)?;
            let got = g.read(logits, n * v)?;
            match which {
                Logits::All => out.extend_from_slice(&got),
                Logits::Last => *out = got,
            }
            r0 += n;
        }
        Ok(())
    }
}
