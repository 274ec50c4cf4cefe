//! Recursion over trees as deep as their source makes them. A chain of
//! 2,000 terms (`a + b + ...`) is a left-leaning tree 2,000 levels deep,
//! and the passes that walk it recurse once per level; [`deep`] grows the
//! stack on the heap where too little of it is left, so that no input
//! within the parser's limits overflows the stack of whatever thread
//! compiles it (a test's, a Python thread's).

/// Stack that must be left when a recursive step starts.
const RED_ZONE: usize = 64 * 1024;
/// What is added, on the heap, when less is left.
const GROWTH: usize = 1024 * 1024;

/// Runs `f`, first growing the stack if less than [`RED_ZONE`] is left.
pub(crate) fn deep<R>(f: impl FnOnce() -> R) -> R {
    stacker::maybe_grow(RED_ZONE, GROWTH, f)
}
