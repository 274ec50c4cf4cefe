//! A training forward's tape on the CPU: the parts the layer's program
//! lays out ([`cellc::program::TapeLayout`]), over the caller's memory.

use super::host::HostForward;
use crate::backend::check_tape;
use crate::cell::Layer;
use crate::error::{Result, RuntimeError};
use cellc::program::{Kept, TapePart};

/// A tape in the caller's memory, part by part as the layer's program
/// lays it out ([`cellc::program::TapeLayout`]), in the reserve's order.
pub(super) struct CpuTape {
    pub(super) parts: Vec<(TapePart, TapeBuf)>,
}

/// One part of a tape: `len` floats of the caller's, borrowed for one call.
pub(super) struct TapeBuf {
    ptr: *mut f32,
    len: usize,
}

unsafe impl Send for TapeBuf {}

unsafe impl Sync for TapeBuf {}

impl std::ops::Deref for TapeBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: the caller's memory is valid for `len` floats while the tape lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for TapeBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: as for `deref`; only a forward's tape (over a mutable borrow) is written.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl CpuTape {
    /// A tape laid out over the caller's `memory` (`rows` times the tape's
    /// floats per row, checked).
    ///
    /// # Safety
    /// `memory` is valid for `len` floats while the tape lives, and the
    /// tape is written only where `memory` may be.
    pub(super) unsafe fn in_caller(
        layer: &Layer,
        rows: usize,
        memory: *mut f32,
        len: usize,
    ) -> Result<CpuTape> {
        check_tape(layer, rows, len)?;
        let parts = layer
            .tape()
            .ranges(rows)
            // SAFETY: the parts' ranges end at `len` (checked above).
            .map(|(part, floats)| {
                (part, TapeBuf { ptr: unsafe { memory.add(floats.start) }, len: floats.len() })
            })
            .collect();
        Ok(CpuTape { parts })
    }

    /// The part keeping `kept`.
    pub(super) fn part(&self, kept: Kept) -> Result<&TapeBuf> {
        self.parts.iter().find(|(p, _)| p.kept == kept).map(|(_, rows)| rows).ok_or_else(|| {
            RuntimeError::Internal(format!("the backward reads {kept:?}, which the tape does not keep"))
        })
    }

    /// Zeros the rows of padding, which no step writes: a tape in the
    /// caller's memory then holds nothing but what this pass computed.
    pub(super) fn zero_padding(&mut self, job: &HostForward, rows: usize) {
        let padding = crate::sequence::padding_rows(job.order, job.input.layout, rows);
        if padding.is_empty() {
            return;
        }
        for (part, data) in &mut self.parts {
            crate::sequence::zero_rows(data, part.floats, &padding);
        }
    }
}
