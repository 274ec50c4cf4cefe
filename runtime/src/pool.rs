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

/// Smaller buffers are not worth the lock (the Python package takes those from PyTorch).
pub const MIN_KEPT_FLOATS: usize = 1024;

/// Buffers kept for reuse, the smallest that fits handed out first.
struct Pool(Mutex<Vec<Vec<f32>>>);

static POOL: Pool = Pool(Mutex::new(Vec::new()));

/// Whether buffers given back are kept: false from [`release`] until the
/// next [`take`], so that buffers freed after the last model (tensors a
/// framework frees late) go back to the system rather than into the pool.
static KEEPING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

impl Pool {
    fn take(&self, len: usize) -> Vec<f32> {
        if len >= MIN_KEPT_FLOATS {
            let reused = self.0.lock().ok().and_then(|mut pool| {
                // The smallest that fits, so large buffers stay for large
                // requests. Fit is by capacity: a buffer handed out shorter
                // than it was comes back with its whole allocation, already
                // faulted in.
                let best = (0..pool.len())
                    .filter(|&i| pool[i].capacity() >= len)
                    .min_by_key(|&i| pool[i].capacity())?;
                Some(pool.swap_remove(best))
            });
            if let Some(mut b) = reused {
                // Within the capacity: no reallocation, no fresh pages.
                b.resize(len, f32::NAN);
                return b;
            }
        }
        vec![f32::NAN; len]
    }

    fn give(&self, buffer: Vec<f32>) {
        if buffer.len() < MIN_KEPT_FLOATS {
            return;
        }
        if let Ok(mut pool) = self.0.lock() {
            let kept: usize = pool.iter().map(Vec::capacity).sum();
            if kept + buffer.capacity() <= MAX_KEPT_FLOATS {
                pool.push(buffer);
            }
        }
    }
}

/// A buffer of `len` floats with unspecified (but initialised) contents.
pub fn take(len: usize) -> Vec<f32> {
    KEEPING.store(true, std::sync::atomic::Ordering::Relaxed);
    POOL.take(len)
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
    if KEEPING.load(std::sync::atomic::Ordering::Relaxed) {
        return POOL.give(buffer);
    }
    // After `release`: freed, and a large one handed back to the system
    // at once (glibc keeps freed memory of its heap until trimmed).
    let large = buffer.capacity() >= 1 << 18;
    drop(buffer);
    if large {
        trim_malloc();
    }
}

/// Returns the C allocator's free memory to the system.
fn trim_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: glibc's malloc_trim only returns free memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Gives the pool's buffers, and what the C allocator holds free, back to
/// the system ([`crate::release_memory`]); buffers given back after it are
/// freed, until the next [`take`].
pub fn release() {
    KEEPING.store(false, std::sync::atomic::Ordering::Relaxed);
    if let Ok(mut pool) = POOL.0.lock() {
        *pool = Vec::new();
    }
    trim_malloc();
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

    #[test]
    fn a_shortened_buffer_serves_its_whole_capacity_again() {
        // A pool of the test's own: the global one is shared with other tests.
        let pool = Pool(Mutex::new(Vec::new()));
        let a = pool.take(1 << 20);
        let address = a.as_ptr();
        pool.give(a);
        let shorter = pool.take((1 << 20) - 5000);
        assert_eq!(shorter.as_ptr(), address, "the same allocation, shortened");
        pool.give(shorter);
        let full = pool.take(1 << 20);
        assert_eq!(full.len(), 1 << 20);
        assert_eq!(full.as_ptr(), address, "reused at its capacity, not reallocated");
    }
}
