//! How many of a token's experts outside a layer's device cache the host computes instead of
//! the GPU reading their weights over PCIe (expert offload's CPU fallback): a pure function of
//! measured costs, tested here without a GPU.
//!
//! Cost model, per layer and row: the GPU reads a far expert's weights once per use, `link`
//! seconds each, while the host computes its experts in parallel with that, `fixed` + `each`
//! seconds per expert (the fixed part: the hand-off of the layer's inputs and outputs and
//! waking the host's threads). The layer waits for the slower of the two. The router knows how
//! many of the row's picks are outside the cache (`c`) and hands the host [`take`]`(c)` of them:
//! the count that minimises the slower side's time. Deciding per token, rather than marking
//! experts for the host ahead of time, keeps the two sides balanced whatever the routing (a
//! fixed assignment leaves one side waiting for the other when a layer's misses fall unevenly).
//!
//! Handing off costs the GPU time even when the host gets nothing (its outputs are awaited in
//! every layer), so the host takes part only while [`expected_gain`] at the observed miss rate
//! beats that cost.

/// Measured costs of one expert use (seconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// The GPU reading one expert's weights over PCIe.
    pub link: f64,
    /// The host's per-layer cost of taking part at all.
    pub fixed: f64,
    /// The host computing one expert (all its threads on it).
    pub each: f64,
}

/// Time of a layer whose `c` far experts are split `h` to the host, the rest to the link.
fn layer_time(c: usize, h: usize, k: Costs) -> f64 {
    let host = if h > 0 {
        k.fixed + h as f64 * k.each
    } else {
        0.0
    };
    host.max((c - h) as f64 * k.link)
}

/// Of `c` experts outside the cache in one row, how many the host computes: the fewest that
/// reach the lowest layer time.
pub fn take(c: usize, k: Costs) -> usize {
    let mut best = 0;
    for h in 1..=c {
        if layer_time(c, h, k) < layer_time(c, best, k) {
            best = h;
        }
    }
    best
}

/// Expected time saved per layer and row by [`take`] when each of a row's `top_k` picks is
/// outside the cache with probability `p`, independently.
pub fn expected_gain(top_k: usize, p: f64, k: Costs) -> f64 {
    let p = p.clamp(0.0, 1.0);
    let mut binom = 1.0;
    let mut gain = 0.0;
    for c in 0..=top_k {
        if c > 0 {
            binom *= (top_k + 1 - c) as f64 / c as f64;
        }
        let pc = binom * p.powi(c as i32) * (1.0 - p).powi((top_k - c) as i32);
        gain += pc * (layer_time(c, 0, k) - layer_time(c, take(c, k), k));
    }
    gain
}

/// [`take`] for every count 0..=`top_k`: the router's table.
pub fn table(top_k: usize, k: Costs) -> Vec<i32> {
    (0..=top_k).map(|c| take(c, k) as i32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn costs(fixed: f64, each: f64) -> Costs {
        Costs {
            link: 30e-6,
            fixed,
            each,
        }
    }

    #[test]
    fn equal_speeds_share_the_misses() {
        let k = costs(0.0, 30e-6);
        assert_eq!(table(8, k), [0, 0, 1, 1, 2, 2, 3, 3, 4]);
    }

    #[test]
    fn a_slow_host_is_left_out() {
        assert!(table(8, costs(200e-6, 300e-6)).iter().all(|&h| h == 0));
    }

    #[test]
    fn a_fast_host_takes_more() {
        // Host 10 µs an expert against the link's 30: three of every four.
        let t = table(8, costs(5e-6, 10e-6));
        assert_eq!(t[4], 3);
        assert_eq!(t[8], 6);
        // A host far faster than the link takes them all.
        assert!(table(8, costs(0.0, 1e-9))
            .iter()
            .enumerate()
            .all(|(c, &h)| h as usize == c));
    }

    #[test]
    fn one_miss_does_not_pay_the_fixed_cost() {
        // The host's fixed cost makes a lone miss cheaper over the link.
        let k = costs(20e-6, 20e-6);
        assert_eq!(take(1, k), 0);
        assert!(take(4, k) > 0);
    }

    #[test]
    fn the_gain_follows_the_miss_rate() {
        let k = costs(5e-6, 30e-6);
        assert_eq!(expected_gain(8, 0.0, k), 0.0);
        let (rare, half, all) = (
            expected_gain(8, 0.03, k),
            expected_gain(8, 0.5, k),
            expected_gain(8, 1.0, k),
        );
        assert!(
            rare < 3e-6 && rare < half && half < all,
            "{rare} {half} {all}"
        );
        // Every pick outside: 8 over the link (240 µs) against 4 + 4 (125 µs).
        assert!((all - 115e-6).abs() < 1e-9, "{all}");
    }

    #[test]
    fn the_split_never_loses_to_the_link_alone() {
        for each in [5e-6, 20e-6, 40e-6, 80e-6] {
            for fixed in [0.0, 8e-6, 50e-6] {
                let k = costs(fixed, each);
                for c in 0..=10 {
                    let h = take(c, k);
                    assert!(h <= c);
                    assert!(
                        layer_time(c, h, k) <= layer_time(c, 0, k),
                        "{each} {fixed} {c}"
                    );
                }
            }
        }
    }
}
