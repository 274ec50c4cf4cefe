//! Refusing work that cannot fit, before anything is allocated.
//!
//! A size typed by mistake (`-D H=1000000000`) must end in an error that
//! states the bytes needed, not in an allocation failure that aborts the
//! process. Each tensor is bounded by the compiler
//! ([`cellc::interp::MAX_TENSOR_ELEMENTS`]); here a model's weights and a
//! pass's buffers are held against the memory this process may use. The
//! estimates are lower bounds (what must exist at once), so a refusal is
//! never a false alarm.

use crate::error::{Result, RuntimeError};

/// The most memory this process may use, in bytes, and what sets it: the
/// machine's physical memory, a cgroup limit (containers) or `ulimit -v`,
/// whichever is least. `None` where none can be read. Read once: every
/// forward pass checks against it.
pub fn memory_limit() -> Option<(u128, &'static str)> {
    static LIMIT: std::sync::OnceLock<Option<(u128, &'static str)>> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(read_memory_limit)
}

fn read_memory_limit() -> Option<(u128, &'static str)> {
    let mut limits: Vec<(u128, &'static str)> = Vec::new();
    #[cfg(unix)]
    {
        // SAFETY: sysconf reads a system constant; it has no preconditions.
        let (pages, page) =
            unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        if pages > 0 && page > 0 {
            limits.push((pages as u128 * page as u128, "this machine has"));
        }
        let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit writes the struct it is given, which lives on this stack.
        if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut rl) } == 0 && rl.rlim_cur != libc::RLIM_INFINITY {
            limits.push((rl.rlim_cur as u128, "this process may map (ulimit -v)"));
        }
    }
    if let Some(bytes) =
        std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok().and_then(|s| s.trim().parse::<u128>().ok())
    {
        limits.push((bytes, "this process's cgroup may use"));
    }
    limits.into_iter().min_by_key(|&(bytes, _)| bytes)
}

/// `f32` elements as bytes.
pub(crate) fn f32_bytes(elements: u128) -> u128 {
    elements * std::mem::size_of::<f32>() as u128
}

/// Errs when `bytes` (what `what` needs at least) exceed [`memory_limit`].
pub(crate) fn ensure_fits(what: impl FnOnce() -> String, bytes: u128) -> Result<()> {
    match memory_limit() {
        Some((limit, source)) if bytes > limit => Err(RuntimeError::TooLarge {
            what: what(),
            bytes,
            limit: format!("{source} {}", cellc::interp::bytes_text(limit)),
        }),
        _ => Ok(()),
    }
}
