//! Which experts outside a layer's device cache the host computes instead of the GPU reading
//! their weights over PCIe (expert offload's CPU fallback): a pure function of the experts'
//! expected uses and of measured costs, tested here without a GPU.
//!
//! Cost model, per layer and decode step: the GPU reads a far expert's weights once per use,
//! `link` seconds each, while the host computes its experts in parallel with that, `fixed` +
//! `each` seconds per use (the fixed part: the hand-off of the layer's inputs and outputs and
//! waking the host's threads). The layer waits for the slower of the two. With expected uses
//! `p_e`, the link's load is `Σ_far p_e · link` and the host's `fixed + Σ_host p_e · each`.
//! [`split`] assigns experts, the most used first, to whichever side then finishes first
//! (longest-processing-time-first scheduling on two machines), and keeps the host out when
//! that does not beat the link alone.

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

/// For experts outside the cache with expected uses per step `rates`, which ones the host
/// computes (true) rather than the GPU over PCIe.
pub fn split(rates: &[f64], c: Costs) -> Vec<bool> {
    let mut order: Vec<usize> = (0..rates.len()).collect();
    order.sort_by(|&a, &b| rates[b].total_cmp(&rates[a]).then(a.cmp(&b)));
    let mut host = vec![false; rates.len()];
    let (mut link_t, mut host_t) = (0.0, c.fixed);
    for e in order {
        let p = rates[e].max(0.0);
        if host_t + p * c.each < link_t + p * c.link {
            host[e] = true;
            host_t += p * c.each;
        } else {
            link_t += p * c.link;
        }
    }
    let link_only: f64 = rates.iter().map(|p| p.max(0.0) * c.link).sum();
    if host.iter().any(|&h| h) && link_t.max(host_t) < link_only {
        host
    } else {
        vec![false; rates.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expected time per layer and step of an assignment under the cost model (seconds).
    fn layer_time(rates: &[f64], host: &[bool], c: Costs) -> f64 {
        let (mut link_t, mut host_t, mut any) = (0.0, c.fixed, false);
        for (p, &h) in rates.iter().zip(host) {
            if h {
                host_t += p * c.each;
                any = true;
            } else {
                link_t += p * c.link;
            }
        }
        if any {
            link_t.max(host_t)
        } else {
            link_t
        }
    }

    /// Qwen3.6-35B-A3B at half cache, uniform routing: 128 experts outside, 8 uses per step of
    /// 256 experts.
    fn uniform() -> Vec<f64> {
        vec![8.0 / 256.0; 128]
    }

    #[test]
    fn equal_speeds_share_the_misses() {
        let c = Costs {
            link: 30e-6,
            fixed: 5e-6,
            each: 30e-6,
        };
        let h = split(&uniform(), c);
        let n = h.iter().filter(|&&x| x).count();
        assert!((56..=64).contains(&n), "{n}");
        assert!(layer_time(&uniform(), &h, c) < 0.6 * layer_time(&uniform(), &[false; 128], c));
    }

    #[test]
    fn a_slow_host_is_left_out() {
        let c = Costs {
            link: 30e-6,
            fixed: 200e-6,
            each: 300e-6,
        };
        assert!(split(&uniform(), c).iter().all(|&x| !x));
    }

    #[test]
    fn a_fast_host_takes_more() {
        let c = Costs {
            link: 30e-6,
            fixed: 5e-6,
            each: 10e-6,
        };
        let n = split(&uniform(), c).iter().filter(|&&x| x).count();
        assert!(n > 90, "{n}");
    }

    #[test]
    fn few_misses_do_not_pay_the_fixed_cost() {
        // A hot cache: the experts outside are rarely used.
        let rates = vec![0.001; 128];
        let c = Costs {
            link: 30e-6,
            fixed: 20e-6,
            each: 30e-6,
        };
        assert!(split(&rates, c).iter().all(|&x| !x));
    }

    #[test]
    fn the_most_used_go_first_and_the_split_never_loses() {
        // Zipf-like rates: whatever the split, its expected time is at most the link's alone.
        let rates: Vec<f64> = (0..128).map(|i| 0.5 / (i + 1) as f64).collect();
        for each in [5e-6, 20e-6, 40e-6, 80e-6] {
            let c = Costs {
                link: 30e-6,
                fixed: 8e-6,
                each,
            };
            let h = split(&rates, c);
            let t = layer_time(&rates, &h, c);
            assert!(t <= layer_time(&rates, &[false; 128], c), "{each}");
        }
        let c = Costs {
            link: 30e-6,
            fixed: 0.0,
            each: 25e-6,
        };
        // The hottest expert outside is assigned first, to the faster side: the host here.
        assert!(split(&rates, c)[0]);
    }
}
