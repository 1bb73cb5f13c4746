//! Speculative decoding on the GPU with the model's MTP layer ([`super::mtp`]). A step of one
//! sequence is a verify pass over its token and the drafts the MTP layer made after it: the
//! rows are consecutive positions of the one slot, each bitwise its decode step (the products
//! of up to four rows give each row its one-row result; the GDN conv and delta rule take the
//! tokens in turn), and each GDN layer keeps its states after every token but the last.
//! [`GpuModel::commit`] keeps a prefix: the position moves past it and, when a draft was
//! rejected, the GDN states kept after the prefix's last token are copied back — KV rows past
//! it are simply overwritten later. Then [`GpuModel::draft`] runs the MTP layer over the pairs
//! (final hidden state, next token) the pass left and drafts the next step's tokens. Each pass
//! is a CUDA graph per row count.

use deltamoe_compute::cuda::vec::VEC_MAX_ROWS;
use deltamoe_compute::cuda::CudaError;

use super::layers::{self, head::Picks};
use super::mtp::{GpuMtp, MtpIo};
use super::pool::GpuSeq;
use super::random::Filler;
use super::{unsupported, DevFormat, GpuModel, PassKind, Result};
use crate::checkpoint::Checkpoint;

/// Most drafts a speculative step verifies on the GPU: the verify pass's rows (drafts + 1) must
/// fit the products that give each row its one-row result.
pub const GPU_MAX_DRAFTS: usize = VEC_MAX_ROWS - 1;

impl GpuModel {
    /// Uploads the checkpoint's MTP layer; false when it has none.
    pub fn upload_mtp(&mut self, ckpt: &Checkpoint) -> Result<bool> {
        let Some(m) = &ckpt.mtp else {
            return Ok(false);
        };
        self.mtp = Some(GpuMtp::upload(&self.gpu, m, &self.cfg).map_err(super::weights_err)?);
        Ok(true)
    }

    /// Gives a synthetic model an MTP layer of random weights in `format` (benchmarks).
    pub fn random_mtp(&mut self, seed: u64, format: DevFormat) -> Result<()> {
        let mut f = Filler::new(&self.gpu, seed, format);
        self.mtp = Some(GpuMtp::random(&mut f, &self.cfg)?);
        self.gpu.sync()
    }

    /// Speculative decoding with up to `drafts` drafts a step (0: off). Reserves the pool anew
    /// for it (dropping its sequences): verify passes keep GDN states per draft, and every slot
    /// gets the MTP layer's KV caches.
    pub fn set_speculative(&mut self, drafts: usize) -> Result<()> {
        if drafts == self.drafts {
            return Ok(());
        }
        if drafts > 0 {
            self.speculation_refused(drafts)?;
        }
        self.drafts = drafts;
        let (slots, ctx) = (self.pool()?.slots, self.pool()?.ctx);
        self.reserve(slots, ctx)
    }

    /// Why this model cannot decode speculatively with `drafts` drafts, if it cannot.
    fn speculation_refused(&self, drafts: usize) -> Result<()> {
        let refuse = |why: String| Err(unsupported(why));
        if self.mtp.is_none() {
            return refuse("the model has no MTP layer on the GPU".into());
        }
        if drafts > GPU_MAX_DRAFTS {
            return refuse(format!(
                "--speculative-tokens {drafts}: CUDA verifies 1 to {GPU_MAX_DRAFTS} drafts a step"
            ));
        }
        if (1..=drafts + 1).any(|r| !self.fused(r)) {
            return refuse(
                "CUDA speculative decoding needs every projection on the single-row kernel \
                 (MLX affine 4- or 8-bit checkpoints); this model's bf16, FP8 or GPTQ products \
                 would not give each verified row its decode step's bits: use --device cpu"
                    .into(),
            );
        }
        if self.offload.is_some() {
            return refuse("CUDA speculative decoding does not run with --expert-cache".into());
        }
        Ok(())
    }

    /// Whether the MTP layer is on the GPU.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Drafts a speculative step verifies at most (0: off).
    pub fn speculative_drafts(&self) -> usize {
        self.drafts
    }

    /// Writes a pass's token ids (rows in order) and the one slot every row belongs to.
    fn write_pass(&mut self, slot: usize, tokens: &[u32]) -> Result<()> {
        let mut io = vec![0i32; 2 * self.rows];
        for (r, &t) in tokens.iter().enumerate() {
            if t as usize >= self.vocab {
                return Err(unsupported(format!(
                    "token id {t} is out of range: vocab_size is {}",
                    self.vocab
                )));
            }
            io[r] = t as i32;
            io[self.rows + r] = slot as i32;
        }
        self.gpu.write(&mut self.io, &io)
    }

    /// The verify pass: feeds `tokens` (the sequence's next token and its drafts) at positions
    /// `seq.pos …` in one pass and returns the greedy pick after each. Keeps what
    /// [`Self::commit`] needs; the position does not move until then.
    pub fn verify(&mut self, seq: &mut GpuSeq, tokens: &[u32]) -> Result<Vec<u32>> {
        let r = tokens.len();
        if r == 0 || r > self.drafts + 1 {
            return Err(unsupported(format!(
                "a verify pass takes 1 to {} tokens, not {r}",
                self.drafts + 1
            )));
        }
        if seq.pos + r > self.context() {
            return Err(unsupported(format!(
                "the sequence is full: {} tokens is its context",
                self.context()
            )));
        }
        self.write_pass(seq.slot, tokens)?;
        self.run_pass(PassKind::Verify, r)?;
        if seq.mtp_carry {
            // The prompt's last hidden state pairs with this pass's first token.
            seq.mtp_carry = false;
            seq.carry_token = Some(tokens[0]);
        }
        Ok(self
            .gpu
            .read(&self.io, r)?
            .into_iter()
            .map(|t| t as u32)
            .collect())
    }

    /// Keeps the first `n` tokens of the verify pass of `r` just run (1 ≤ n ≤ r): the state
    /// becomes what decoding those tokens one by one leaves.
    pub fn commit(&mut self, seq: &mut GpuSeq, r: usize, n: usize) -> Result<()> {
        if n == 0 || n > r {
            return Err(unsupported(format!(
                "commit of {n} tokens of a verify pass of {r}"
            )));
        }
        let g = self.gpu.clone();
        let pool = self.pool_mut()?;
        if n < r {
            pool.roll_back(&g, seq.slot, n - 1)?;
        }
        seq.pos += n;
        g.write_at(&mut pool.pos, seq.slot, &[seq.pos as i32])
    }

    /// Drafts `n` tokens after the verify pass just committed: the MTP layer over the pairs of
    /// the pass's first `tokens.len()` final hidden states and `tokens` (the kept drafts, then
    /// the next token), which join its cache, then `n − 1` more passes each on its own draft.
    /// The drafts' rows of the MTP cache are not kept.
    pub fn draft(&mut self, seq: &mut GpuSeq, tokens: &[u32], n: usize) -> Result<Vec<u32>> {
        let k = tokens.len();
        if k == 0 || k > self.drafts + 1 || n == 0 || n > self.drafts {
            return Err(unsupported(format!(
                "a draft of {n} tokens after {k} pairs (the model drafts up to {})",
                self.drafts
            )));
        }
        if seq.mtp_pos + k + n + 1 > self.context() {
            return Ok(Vec::new());
        }
        let carried = match seq.carry_token.take() {
            Some(t) if k < self.rows => Some(t),
            _ => None,
        };
        let pairs: Vec<u32> = carried
            .iter()
            .copied()
            .chain(tokens.iter().copied())
            .collect();
        if carried.is_some() {
            self.put_carry_first(seq.slot, k)?;
        }
        let k = pairs.len();
        self.write_pass(seq.slot, &pairs)?;
        self.mtp_pass(seq.slot, seq.mtp_pos, k)?;
        seq.mtp_pos += k;
        let mut drafts = vec![self.last_pick(k)?];
        let h = self.hidden;
        while drafts.len() < n {
            // The next pass's hidden state is the last pass's last output row.
            let rows = if drafts.len() == 1 { k } else { 1 };
            if rows > 1 {
                let normed = &self.scratch.normed;
                let (dst, src) = (normed.ptr(), normed.at((rows - 1) * h));
                // SAFETY: normed holds self.rows ≥ k rows of h floats; rows 0 and k − 1 differ.
                unsafe { self.gpu.copy_rows_f32((dst, h), (src, h), h, 1)? };
            }
            self.write_pass(seq.slot, &drafts[drafts.len() - 1..])?;
            self.mtp_pass(seq.slot, seq.mtp_pos + drafts.len() - 1, 1)?;
            drafts.push(self.last_pick(1)?);
        }
        Ok(drafts)
    }

    /// Moves the `k` hidden rows in `normed` down one row and puts the slot's carried prompt
    /// hidden state first.
    fn put_carry_first(&self, slot: usize, k: usize) -> Result<()> {
        let (h, normed) = (self.hidden, &self.scratch.normed);
        let carry = self.pool()?.mtp_carry.at(slot * h);
        for r in (0..k).rev() {
            // SAFETY: rows r and r + 1 < self.rows of normed (k < rows, checked by the caller).
            unsafe {
                self.gpu
                    .copy_rows_f32((normed.at((r + 1) * h), h), (normed.at(r * h), h), h, 1)?
            };
        }
        // SAFETY: carry is the slot's row of mtp_carry, normed's row 0 apart from it.
        unsafe { self.gpu.copy_rows_f32((normed.ptr(), h), (carry, h), h, 1) }
    }

    /// A prefill pass's part for the MTP layer (after the layers, `normed` holding every row's
    /// final hidden state): the pairs of each hidden state with the token after it — the carried
    /// one of the part before with this part's first token, then within the part — join the MTP
    /// cache; the part's last hidden state is carried to the next part or the first decode step.
    pub(super) fn mtp_prefill(
        &mut self,
        ps: &layers::PrefillScratch,
        seq: &mut GpuSeq,
        t: usize,
    ) -> Result<()> {
        let h = self.hidden;
        if self.mtp_rows.as_ref().is_none_or(|b| b.len() < ps.rows * h) {
            self.mtp_rows = Some(self.gpu.zeros(ps.rows * h)?);
        }
        let g = self.gpu.clone();
        g.write_at(
            &mut self.pool_mut()?.mtp_pos,
            seq.slot,
            &[seq.mtp_pos as i32],
        )?;
        let (Some(rows), Some(m)) = (&self.mtp_rows, &self.mtp) else {
            return Err(unsupported("speculative decoding is off".into()));
        };
        let g = &*g;
        let pool = self.pool()?;
        let Some(state) = pool.mtp_state() else {
            return Err(unsupported("speculative decoding is off".into()));
        };
        let carry = pool.mtp_carry.at(seq.slot * h);
        let c = usize::from(seq.mtp_carry);
        // SAFETY: rows holds ps.rows ≥ t rows of h floats; carry is one row of mtp_carry; normed
        // holds t rows. The pairs' hidden rows: the carried one, then rows 0 … t − 2.
        unsafe {
            if c == 1 {
                g.copy_rows_f32((rows.ptr(), h), (carry, h), h, 1)?;
            }
            g.copy_rows_f32((rows.at(c * h), h), (ps.normed.ptr(), h), h, t - 1)?;
            g.copy_rows_f32((carry, h), (ps.normed.at((t - 1) * h), h), h, 1)?;
        }
        let pairs = t - 1 + c;
        if pairs > 0 {
            let p = layers::Pass {
                g,
                ps,
                t: pairs,
                slot: seq.slot,
                pos0: seq.mtp_pos,
                eps: self.eps,
                hidden: h,
                pos: pool.mtp_pos.ptr(),
                ctx: pool.ctx,
                gdn: self.prefill_gdn,
                gemm: self.prefill_gemm,
                shard: None,
            };
            let tokens = ps.tok.at(1 - c);
            m.prefill(&p, &self.head, (tokens, rows.ptr()), state)?;
            seq.mtp_pos += pairs;
        }
        seq.mtp_carry = true;
        Ok(())
    }

    /// An MTP pass of `rows` pairs from MTP position `pos` of `slot`.
    fn mtp_pass(&mut self, slot: usize, pos: usize, rows: usize) -> Result<()> {
        let g = self.gpu.clone();
        g.write_at(&mut self.pool_mut()?.mtp_pos, slot, &[pos as i32])?;
        self.run_pass(PassKind::Mtp, rows)
    }

    /// The pick of row `rows − 1` of the pass just run.
    fn last_pick(&self, rows: usize) -> Result<u32> {
        Ok(self.gpu.read_at(&self.io, rows - 1, 1)?[0] as u32)
    }

    /// Enqueue an MTP pass (see [`super::mtp`]): the pairs, the layer, its norm, the lm_head
    /// and a pick per row.
    pub(super) fn enqueue_mtp(&self, st: &super::layers::Step) -> Result<()> {
        let pool = self.pool()?;
        let (Some(m), Some(state)) = (&self.mtp, pool.mtp_state()) else {
            return Err(CudaError::Unsupported("speculative decoding is off".into()));
        };
        let io = MtpIo {
            tokens: self.io.ptr(),
            state,
            ids: self.scratch.ffn.ids.ptr(),
        };
        m.enqueue(st, &self.head, &io)?;
        let picks = Picks {
            tokens: self.io.ptr(),
            sampling: pool.sampling.ptr(),
            pos: st.pos,
        };
        self.head.decode(st, true, picks)
    }
}
