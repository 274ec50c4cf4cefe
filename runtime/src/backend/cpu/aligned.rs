//! Memory for weights packed once per model: 2 MiB-aligned memory that
//! Linux is asked to back with huge pages, recycled when freed.
//!
//! Why the alignment: a per-step product streams the same weight every
//! step, and at small batch each core keeps its share of it in its own L2.
//! Spread over 4 KiB pages, that share lands on whatever physical pages the
//! allocator got, and how many of its lines collide in the L2's sets varied
//! from process to process: the same B=1 LSTM training run took 3.3 ms or
//! 6 ms depending on the run. Physically contiguous huge pages map a
//! contiguous share evenly onto the sets.

use std::alloc::{alloc, dealloc, Layout};
use std::sync::Mutex;

const HUGE_PAGE: usize = 2 << 20;

/// A float buffer aligned to (and sized in multiples of) 2 MiB when it is
/// at least one huge page long, else ordinarily aligned.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: *mut f32,
    len: usize,
    layout: Layout,
}

// SAFETY: an owned heap buffer of plain floats.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A copy of `data`.
    #[cfg(test)]
    pub fn copy_of(data: &[f32]) -> AlignedBuf {
        let mut b = AlignedBuf::recycled(data.len());
        b.as_mut_slice().copy_from_slice(data);
        b
    }

    /// A buffer of `len` floats whose contents are unspecified (a freed
    /// buffer of the same size, or zeros): packing weights afresh on every
    /// call then reuses memory already faulted in, instead of paying the
    /// kernel's page faults and zeroing each time.
    pub fn recycled(len: usize) -> AlignedBuf {
        let layout = Self::layout(len);
        let reused = RECYCLED.lock().ok().and_then(|mut kept| {
            let i = kept.iter().position(|&(_, l)| l == layout)?;
            Some(kept.swap_remove(i).0)
        });
        if let Some(ptr) = reused {
            return AlignedBuf { ptr: ptr.0, len, layout };
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc(layout) } as *mut f32;
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        #[cfg(target_os = "linux")]
        if layout.align() == HUGE_PAGE {
            // A hint: without transparent huge pages this is a no-op.
            // SAFETY: the range is this allocation.
            unsafe { libc::madvise(ptr.cast(), layout.size(), libc::MADV_HUGEPAGE) };
        }
        // SAFETY: `size >= len * 4` bytes were just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        AlignedBuf { ptr, len, layout }
    }

    /// 2 MiB-aligned and sized from half a huge page on, else cache-line aligned.
    fn layout(len: usize) -> Layout {
        let bytes = (len * 4).max(4);
        let (size, align) =
            if bytes >= HUGE_PAGE / 2 { (bytes.next_multiple_of(HUGE_PAGE), HUGE_PAGE) } else { (bytes, 64) };
        // The size is non-zero and a multiple of the power-of-two alignment.
        Layout::from_size_align(size, align).unwrap_or(Layout::new::<[f32; 16]>())
    }

    pub fn as_ptr(&self) -> *const f32 {
        self.ptr
    }

    #[cfg(test)]
    pub fn as_slice(&self) -> &[f32] {
        // SAFETY: `len` initialised floats.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: `len` initialised floats, owned.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Freed buffers kept for reuse, at most [`MAX_RECYCLED_BYTES`] in all.
static RECYCLED: Mutex<Vec<(Freed, Layout)>> = Mutex::new(Vec::new());
const MAX_RECYCLED_BYTES: usize = 256 << 20;

/// Frees every buffer kept for reuse.
pub fn release_recycled() {
    let kept = match RECYCLED.lock() {
        Ok(mut kept) => std::mem::take(&mut *kept),
        Err(_) => return,
    };
    for (ptr, layout) in kept {
        // SAFETY: each was allocated with exactly this layout and is owned by the pool.
        unsafe { dealloc(ptr.0.cast(), layout) };
    }
}

/// A freed buffer's address (the floats it holds stay initialised).
struct Freed(*mut f32);
// SAFETY: the allocation is owned by whoever holds this (the pool, then one buffer).
unsafe impl Send for Freed {}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Ok(mut kept) = RECYCLED.lock() {
            let held: usize = kept.iter().map(|(_, l)| l.size()).sum();
            if held + self.layout.size() <= MAX_RECYCLED_BYTES {
                kept.push((Freed(self.ptr), self.layout));
                return;
            }
        }
        // SAFETY: allocated with exactly this layout.
        unsafe { dealloc(self.ptr.cast(), self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_exact_and_huge_ones_aligned() {
        for len in [1usize, 1000, 300_000, 1 << 20] {
            let data: Vec<f32> = (0..len).map(|i| i as f32).collect();
            let b = AlignedBuf::copy_of(&data);
            assert_eq!(b.as_slice(), &data[..]);
            if len * 4 >= HUGE_PAGE / 2 {
                assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
            }
        }
    }
}
