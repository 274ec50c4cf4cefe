//! Float buffers recycled across calls, handed out *unzeroed*: the CPU
//! back end's per-row buffers and tapes, the executor's layer buffers, and
//! the reserves the Python package hands PyTorch.
//!
//! A training step needs tens of megabytes of per-row buffers (hoisted
//! products, the tape, adjoints kept for after the loop), every element of
//! which the driver writes before it reads it. Zeroing them (or having the
//! kernel fault in fresh zero pages) was a quarter of a B=64 LSTM training
//! step. Buffers come back here when a run or a tape is dropped and go out
//! again with whatever floats they hold; a buffer made fresh is filled with
//! NaN, so a read-before-write bug shows up as NaN in the conformance tests
//! instead of as a plausible zero.

use std::sync::Mutex;

/// At most this many floats are kept for reuse (1 GiB).
const MAX_KEPT_FLOATS: usize = 1 << 28;

/// Smaller buffers are not worth the lock.
const MIN_KEPT_FLOATS: usize = 1024;

static POOL: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// A buffer of `len` floats with unspecified (but initialised) contents.
pub fn take(len: usize) -> Vec<f32> {
    if len >= MIN_KEPT_FLOATS {
        let reused = POOL.lock().ok().and_then(|mut pool| {
            // The smallest that fits, so large buffers stay for large requests.
            let best = (0..pool.len()).filter(|&i| pool[i].len() >= len).min_by_key(|&i| pool[i].len())?;
            Some(pool.swap_remove(best))
        });
        if let Some(mut b) = reused {
            b.truncate(len);
            return b;
        }
    }
    vec![f32::NAN; len]
}

/// A buffer of `len` zeros (reused memory is cleared, which is far cheaper
/// than faulting in fresh pages).
pub fn take_zeroed(len: usize) -> Vec<f32> {
    let mut b = take(len);
    b.fill(0.0);
    b
}

/// Hands a buffer back for reuse (dropped when small or when the pool is full).
pub fn give(buffer: Vec<f32>) {
    if buffer.len() < MIN_KEPT_FLOATS {
        return;
    }
    if let Ok(mut pool) = POOL.lock() {
        let kept: usize = pool.iter().map(Vec::len).sum();
        if kept + buffer.len() <= MAX_KEPT_FLOATS {
            pool.push(buffer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_at_the_asked_length() {
        let a = take(5000);
        assert!(a.iter().all(|x| x.is_nan()), "fresh buffers are poisoned");
        give(a);
        let b = take(3000);
        assert_eq!(b.len(), 3000);
        give(b);
        assert_eq!(take(100).len(), 100);
    }
}
