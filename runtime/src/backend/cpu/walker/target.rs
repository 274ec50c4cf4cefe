//! The instruction sets fused loops are compiled for ([`Target`]), and
//! what the compiler needs to know of each: a vector's width, its
//! registers, how constants are read.

/// The instruction set a loop is emitted for: the walker's sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Sixteen lanes in 32 `zmm` registers, comparisons in mask registers.
    Avx512,
    /// Eight lanes in 16 `ymm` registers (VEX encodings), comparisons as vectors.
    Avx2,
}

impl Target {
    /// Bytes of a vector.
    pub fn bytes(self) -> usize {
        match self {
            Target::Avx512 => 64,
            Target::Avx2 => 32,
        }
    }

    /// Floats of a vector.
    pub fn lanes(self) -> usize {
        self.bytes() / 4
    }

    /// Copies of each constant and scalar its pools hold: one where
    /// instructions broadcast them, else a vector's.
    pub fn copies(self) -> usize {
        match self {
            Target::Avx512 => 1,
            Target::Avx2 => 8,
        }
    }

    /// Vector registers the allocator gives out.
    pub fn registers(self) -> usize {
        match self {
            Target::Avx512 => 32,
            Target::Avx2 => 16,
        }
    }
}
