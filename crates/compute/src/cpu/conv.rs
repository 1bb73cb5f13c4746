//! Causal depthwise conv1d with a carried state, followed by SiLU.
//!
//! Per channel c with kernel `w[c, 0..K]` (the reference's `[C, 1, K]` weight) and inputs
//! `x[t, c]`: `y[t, c] = silu(Σ_j w[c, j] · x[t − (K−1) + j, c])`, where inputs before the first
//! token come from `state` (`[K−1, C]`, oldest first; zeros for a new sequence). After the call,
//! `state` holds the last K−1 inputs.

use super::act::silu;

/// `x: [T, C]` in, `y: [T, C]` out, `w: [C, K]`, `state: [K−1, C]` updated.
pub fn causal_conv1d_silu(x: &[f32], w: &[f32], k: usize, state: &mut [f32], y: &mut [f32]) {
    let c = w.len() / k;
    let t = x.len() / c;
    let hist = k - 1;
    // Window of the previous K−1 inputs followed by the new ones: [K−1 + T, C].
    let mut win = Vec::with_capacity((hist + t) * c);
    win.extend_from_slice(state);
    win.extend_from_slice(x);
    for tt in 0..t {
        let out = &mut y[tt * c..(tt + 1) * c];
        for (ch, o) in out.iter_mut().enumerate() {
            let wc = &w[ch * k..(ch + 1) * k];
            let mut s = 0.0;
            for (j, wj) in wc.iter().enumerate() {
                s += wj * win[(tt + j) * c + ch];
            }
            *o = silu(s);
        }
    }
    state.copy_from_slice(&win[t * c..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_calls_equal_one_call() {
        let (c, k, t) = (3, 4, 7);
        let w: Vec<f32> = (0..c * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let x: Vec<f32> = (0..t * c).map(|i| (i as f32 * 0.91).cos()).collect();
        let mut s1 = vec![0.0; (k - 1) * c];
        let mut y1 = vec![0.0; t * c];
        causal_conv1d_silu(&x, &w, k, &mut s1, &mut y1);
        let mut s2 = vec![0.0; (k - 1) * c];
        let mut y2 = vec![0.0; t * c];
        for (a, b) in [(0, 2), (2, 3), (3, 7)] {
            causal_conv1d_silu(&x[a * c..b * c], &w, k, &mut s2, &mut y2[a * c..b * c]);
        }
        assert_eq!(y1, y2);
        assert_eq!(s1, s2);
    }
}
