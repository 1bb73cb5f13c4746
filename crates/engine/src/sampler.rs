//! Token sampling: repetition penalty, then greedy argmax or temperature / top-k / top-p /
//! min-p sampling with a seeded, deterministic random number generator.

use std::borrow::Cow;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::{EngineError, Result};

/// How the next token is chosen from the logits.
#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// Softmax temperature; `0` (or less) means greedy argmax.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` = off.
    pub top_k: usize,
    /// Nucleus sampling threshold; `1.0` = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top probability; `0` = off.
    pub min_p: f32,
    /// Hugging Face style repetition penalty; `1.0` = off.
    pub repetition_penalty: f32,
    /// Seed of the random number generator.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy decoding with every filter off.
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// True when the choice is always the (penalised) argmax: temperature <= 0 or top_k == 1.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0 || self.top_k == 1
    }

    /// Checks that every value is in range; the error names the value and its valid range.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, v: f32, range: &str| {
            Err(EngineError::Input(format!(
                "sampling {what} = {v} is out of range; use a value in {range}"
            )))
        };
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", self.temperature, "[0, inf) (0 = greedy)");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "(0, 1] (1 = off)");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", self.min_p, "[0, 1] (0 = off)");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(
                "repetition_penalty",
                self.repetition_penalty,
                "(0, inf) (1 = off)",
            );
        }
        Ok(())
    }
}

/// Index of the first maximum of `x` (NaN never wins); 0 for an empty slice.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best
}

/// Chooses tokens from logits according to [`SamplingParams`].
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

impl Sampler {
    /// A sampler whose random number generator is seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler { params, rng }
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token id from `logits`, penalising the ids in `history`.
    /// Returns 0 for empty logits.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let logits = &self.penalised(logits, history)[..];
        if self.params.is_greedy() {
            return argmax(logits) as u32;
        }
        let probs = self.filtered_probs(logits);
        if probs.is_empty() {
            return argmax(logits) as u32;
        }
        self.pick(&probs)
    }

    /// `logits` with the repetition penalty applied to the ids in `history` (borrowed as they
    /// are when the penalty is off).
    fn penalised<'a>(&self, logits: &'a [f32], history: &[u32]) -> Cow<'a, [f32]> {
        let penalty = self.params.repetition_penalty;
        if penalty != 1.0 && !history.is_empty() {
            Cow::Owned(apply_repetition_penalty(logits, history, penalty))
        } else {
            Cow::Borrowed(logits)
        }
    }

    /// The distribution [`Self::sample`] draws from: `(id, probability)` pairs summing to 1
    /// (one pair, the argmax, when greedy).
    pub fn probs(&self, logits: &[f32], history: &[u32]) -> Vec<(u32, f32)> {
        let logits = &self.penalised(logits, history)[..];
        let mut probs = if self.params.is_greedy() {
            Vec::new()
        } else {
            self.filtered_probs(logits)
        };
        let total: f32 = probs.iter().map(|c| c.1).sum();
        if total.is_nan() || total <= 0.0 {
            return vec![(argmax(logits) as u32, 1.0)];
        }
        for c in probs.iter_mut() {
            c.1 /= total;
        }
        probs
    }

    /// A uniform draw from [0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Candidate `(id, probability)` pairs left after temperature, top-k, softmax, top-p and
    /// min-p; not renormalised (`pick` divides by their sum).
    fn filtered_probs(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let inv_t = 1.0 / self.params.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (i as u32, v * inv_t))
            .collect();
        let k = self.params.top_k;
        if k > 0 && k < cand.len() {
            cand.select_nth_unstable_by(k - 1, by_value_desc);
            cand.truncate(k);
        }
        softmax_in_place(&mut cand);
        if self.params.top_p < 1.0 {
            top_p_in_place(&mut cand, self.params.top_p);
        }
        if self.params.min_p > 0.0 {
            min_p_in_place(&mut cand, self.params.min_p);
        }
        cand
    }

    /// Draws one id from `(id, probability)` pairs (not necessarily normalised).
    pub fn pick(&mut self, probs: &[(u32, f32)]) -> u32 {
        let total: f64 = probs.iter().map(|&(_, p)| p as f64).sum();
        let target = self.rng.random::<f64>() * total;
        let mut acc = 0.0f64;
        for &(id, p) in probs {
            acc += p as f64;
            if target < acc {
                return id;
            }
        }
        probs.last().map_or(0, |&(id, _)| id)
    }
}

/// Orders candidates by descending value, then ascending id (deterministic ties).
fn by_value_desc(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// HF repetition penalty: for each distinct id seen, positive logits are divided by the
/// penalty and the others multiplied by it. Ids outside the vocabulary are ignored.
fn apply_repetition_penalty(logits: &[f32], history: &[u32], penalty: f32) -> Vec<f32> {
    let mut out = logits.to_vec();
    let mut ids = history.to_vec();
    ids.sort_unstable();
    ids.dedup();
    for id in ids {
        if let Some(v) = out.get_mut(id as usize) {
            *v = if *v > 0.0 { *v / penalty } else { *v * penalty };
        }
    }
    out
}

/// Replaces the values (logits) with their softmax probabilities.
fn softmax_in_place(cand: &mut [(u32, f32)]) {
    let max = cand.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        // All -inf (or +inf present): fall back to uniform over the maxima.
        for c in cand.iter_mut() {
            c.1 = if c.1 == max { 1.0 } else { 0.0 };
        }
        return;
    }
    let mut sum = 0.0f32;
    for c in cand.iter_mut() {
        c.1 = (c.1 - max).exp();
        sum += c.1;
    }
    for c in cand.iter_mut() {
        c.1 /= sum;
    }
}

/// Keeps the smallest set of most likely candidates whose cumulative probability reaches
/// `top_p` (always at least one). Leaves the candidates sorted by descending probability.
fn top_p_in_place(cand: &mut Vec<(u32, f32)>, top_p: f32) {
    cand.sort_unstable_by(by_value_desc);
    let mut acc = 0.0f32;
    let mut keep = cand.len();
    for (i, c) in cand.iter().enumerate() {
        acc += c.1;
        if acc >= top_p {
            keep = i + 1;
            break;
        }
    }
    cand.truncate(keep.max(1));
}

/// Drops candidates whose probability is below `min_p` times the largest probability.
fn min_p_in_place(cand: &mut Vec<(u32, f32)>, min_p: f32) {
    let max = cand.iter().map(|c| c.1).fold(0.0f32, f32::max);
    let threshold = min_p * max;
    cand.retain(|c| c.1 >= threshold);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(temperature: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            seed,
            ..SamplingParams::default()
        }
    }

    const LOGITS: [f32; 6] = [0.1, 2.0, -1.0, 1.9, 0.5, 1.5];

    #[test]
    fn argmax_picks_first_max() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0]), 1);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn greedy_picks_argmax() {
        let params = SamplingParams::default();
        assert!(params.is_greedy());
        let mut s = Sampler::new(params);
        assert_eq!(s.sample(&LOGITS, &[]), 1);
    }

    #[test]
    fn same_seed_same_sequence() {
        let run = |seed| {
            let mut s = Sampler::new(sampling(1.0, seed));
            (0..64).map(|_| s.sample(&LOGITS, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let mut s = Sampler::new(SamplingParams {
            top_k: 1,
            ..sampling(1.5, 3)
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&LOGITS, &[]), 1);
        }
    }

    #[test]
    fn tiny_top_p_equals_greedy() {
        let mut s = Sampler::new(SamplingParams {
            top_p: 1e-6,
            ..sampling(1.5, 3)
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&LOGITS, &[]), 1);
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let mut s = Sampler::new(SamplingParams {
            min_p: 0.5,
            ..sampling(1.0, 11)
        });
        for _ in 0..200 {
            let id = s.sample(&LOGITS, &[]);
            assert!(id == 1 || id == 3 || id == 5, "unexpected id {id}");
        }
    }

    #[test]
    fn repetition_penalty_changes_choice() {
        let logits = [1.0, 3.0, 2.9, -0.5];
        let mut plain = Sampler::new(SamplingParams::default());
        assert_eq!(plain.sample(&logits, &[1]), 1);
        let mut pen = Sampler::new(SamplingParams {
            repetition_penalty: 1.5,
            ..SamplingParams::default()
        });
        // 3.0 / 1.5 = 2.0 < 2.9, repeated ids and out-of-range ids are harmless.
        assert_eq!(pen.sample(&logits, &[1, 1, 99]), 2);
        // Negative logits are multiplied: 1.0 -> 1.0 / 1.5, -0.5 -> -0.75.
        let out = apply_repetition_penalty(&logits, &[0, 3], 1.5);
        assert_eq!(out, vec![1.0 / 1.5, 3.0, 2.9, -0.75]);
    }

    #[test]
    fn frequencies_follow_softmax() {
        let logits = [1.0f32, 2.0, 0.5];
        let exps: Vec<f32> = logits.iter().map(|v| v.exp()).collect();
        let sum: f32 = exps.iter().sum();
        let mut s = Sampler::new(sampling(1.0, 42));
        let n = 4000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            counts[s.sample(&logits, &[]) as usize] += 1;
        }
        for i in 0..3 {
            let freq = counts[i] as f32 / n as f32;
            let p = exps[i] / sum;
            assert!((freq - p).abs() < 0.03, "token {i}: freq {freq} vs p {p}");
        }
    }

    #[test]
    fn validate_rejects_bad_values() {
        assert!(SamplingParams::default().validate().is_ok());
        let err = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        }
        .validate();
        let msg = err.map_err(|e| e.to_string()).err().unwrap_or_default();
        assert!(msg.contains("top_p"), "{msg}");
        assert!(SamplingParams {
            temperature: -1.0,
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
