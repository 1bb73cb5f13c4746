//! Speculative decoding's acceptance rule (Leviathan et al. 2023, Chen et al. 2023). Draft
//! `d_j` was drawn from the draft distribution `q_j`; the model's distribution at the same
//! position is `p_j`. Each draft is kept with probability `min(1, p_j(d_j) / q_j(d_j))`; at the
//! first rejection the next token is drawn from the residual `max(0, p_j − q_j)` (normalised),
//! and when every draft is kept, from `p_N`. Every token so produced is distributed exactly as
//! `p`, whatever `q` is. Greedy sampling is the case where every distribution is one-hot: a
//! draft is kept iff it is the model's argmax, and the next token is the argmax.

use crate::sampler::Sampler;

/// A distribution over token ids: `(id, probability)` pairs, summing to 1.
pub type Dist = Vec<(u32, f32)>;

/// The probability of `id` under `d` (0 when absent).
fn prob(d: &[(u32, f32)], id: u32) -> f32 {
    d.iter().find(|c| c.0 == id).map_or(0.0, |c| c.1)
}

/// Applies the rule to `drafts` (drawn from `q`, one distribution each) against the model's
/// distributions `p` (one more than the drafts: the last follows every draft). Returns how many
/// drafts are kept and the token that follows them.
pub fn accept(drafts: &[u32], q: &[Dist], p: &[Dist], sampler: &mut Sampler) -> (usize, u32) {
    for (j, (&d, qj)) in drafts.iter().zip(q).enumerate() {
        let (pd, qd) = (prob(&p[j], d), prob(qj, d));
        let keep = pd >= qd || (sampler.uniform() as f32) * qd < pd;
        if !keep {
            return (j, sampler.pick(&residual(&p[j], qj)));
        }
    }
    let n = drafts.len().min(p.len() - 1);
    (n, sampler.pick(&p[n]))
}

/// `max(0, p − q)` over the ids of `p` (unnormalised); `p` itself where that is all zero.
fn residual(p: &[(u32, f32)], q: &[(u32, f32)]) -> Dist {
    let r: Dist = p
        .iter()
        .map(|&(id, pv)| (id, (pv - prob(q, id)).max(0.0)))
        .filter(|c| c.1 > 0.0)
        .collect();
    if r.is_empty() {
        p.to_vec()
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplingParams;

    fn sampler(seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        })
    }

    #[test]
    fn one_hot_distributions_keep_exactly_the_argmax_prefix() {
        let hot = |id| vec![(id, 1.0)];
        let mut s = sampler(1);
        let p = [hot(4), hot(7), hot(2)];
        assert_eq!(accept(&[4, 7], &[hot(4), hot(7)], &p, &mut s), (2, 2));
        assert_eq!(accept(&[4, 9], &[hot(4), hot(9)], &p, &mut s), (1, 7));
        assert_eq!(accept(&[5, 7], &[hot(5), hot(7)], &p, &mut s), (0, 4));
    }

    /// Chi-square statistic of `counts` against `expected` probabilities over `n` draws.
    fn chi2(counts: &[usize], expected: &[f64], n: usize) -> f64 {
        counts
            .iter()
            .zip(expected)
            .map(|(&c, &e)| (c as f64 - e * n as f64).powi(2) / (e * n as f64))
            .sum()
    }

    #[test]
    fn the_tokens_it_emits_are_distributed_as_the_model_says() {
        // Two positions over 5 ids; the draft distribution differs from the model's (and misses
        // id 4). The first emitted token must follow p0, and the second (the next token after
        // an accepted first draft, or the residual draw) the joint law of p0 then p1.
        let p0: Dist = vec![(0, 0.1), (1, 0.4), (2, 0.2), (3, 0.2), (4, 0.1)];
        let p1: Dist = vec![(0, 0.3), (1, 0.1), (2, 0.1), (3, 0.5)];
        let p2: Dist = vec![(2, 0.6), (4, 0.4)];
        let q0: Dist = vec![(0, 0.3), (1, 0.1), (2, 0.5), (3, 0.1)];
        let q1: Dist = vec![(0, 0.25), (1, 0.25), (2, 0.25), (3, 0.25)];
        let mut s = sampler(7);
        let n = 200_000;
        let (mut first, mut second) = ([0usize; 5], [0usize; 5]);
        for _ in 0..n {
            let d0 = s.pick(&q0);
            let d1 = s.pick(&q1);
            let (kept, next) = accept(
                &[d0, d1],
                &[q0.clone(), q1.clone()],
                &[p0.clone(), p1.clone(), p2.clone()],
                &mut s,
            );
            let emitted: Vec<u32> = [d0, d1][..kept].iter().copied().chain([next]).collect();
            first[emitted[0] as usize] += 1;
            if emitted.len() > 1 && emitted[0] == 1 {
                second[emitted[1] as usize] += 1;
            }
        }
        let e0: Vec<f64> = (0..5).map(|i| prob(&p0, i) as f64).collect();
        // 4 degrees of freedom: the 0.1% critical value is 18.5.
        let c0 = chi2(&first, &e0, n);
        assert!(c0 < 18.5, "first token: chi2 {c0}, counts {first:?}");
        // Given a first token 1, the second follows p1 (ids 0..3; 3 degrees of freedom, 16.3).
        let m = second.iter().sum();
        let e1: Vec<f64> = (0..4).map(|i| prob(&p1, i) as f64).collect();
        let c1 = chi2(&second[..4], &e1, m);
        assert!(c1 < 16.3, "second token: chi2 {c1}, counts {second:?}");
        assert_eq!(second[4], 0);
    }
}
