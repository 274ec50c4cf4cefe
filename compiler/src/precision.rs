//! The precision a back end computes its products in, and rounding to bf16,
//! fp16 and TF32.
//!
//! [`Precision::Bf16`] is the mixed precision of `torch.autocast` with
//! bfloat16 and of oneDNN's bf16 RNN: the products of the cell's matrix
//! parameters (hoisted over all steps, per step, and the backward's data
//! products `D · W`) take bf16 operands, both the weight and the vector
//! rounded to nearest even, and sum in f32. Everything else stays f32: the
//! states, every pointwise stage, the products of matrices the cell
//! computes, and the weight gradients `dW += Dᵀ · X`, which accumulate in
//! f32 against the f32 master weights. A bf16 product is within bf16's
//! rounding (a relative 2⁻⁸ of the sum of the products' magnitudes) of the
//! f32 one; NaN and infinity propagate as in f32.
//!
//! [`Precision::F16`] is the same with IEEE binary16 operands (fp16, the
//! default of `torch.autocast` on CUDA): a relative 2⁻¹¹ rounding, but a
//! range that ends at 65504, past which an operand becomes infinite, as
//! under autocast (where a gradient scaler keeps the backward in range).
//! The CUDA back end computes it on the tensor cores; the CPU refuses it.
//!
//! [`Precision::Tf32`] is the same with TensorFloat-32 operands: f32's
//! range and 10 of its 23 mantissa bits (a relative 2⁻¹¹ rounding), what
//! NVIDIA's tensor cores take for f32 products where TF32 is allowed, and
//! what cuDNN's RNN computes in PyTorch on an Ampere or later GPU unless
//! `torch.backends.cudnn.allow_tf32` (`torch.backends.cudnn.rnn.fp32_precision`)
//! says otherwise. The CUDA back end computes it; the CPU refuses it.

/// The precision of a back end's products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 operands, f32 sums.
    #[default]
    F32,
    /// bf16 operands, f32 sums (see the module documentation).
    Bf16,
    /// fp16 operands, f32 sums (see the module documentation).
    F16,
    /// TF32 operands, f32 sums (see the module documentation).
    Tf32,
}

impl Precision {
    /// The name `cellc` and the Python package use: `f32`, `bf16`, `f16`
    /// or `tf32`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
            Precision::Tf32 => "tf32",
        }
    }

    /// `x` as a product's operand in this precision: itself in f32, else
    /// rounded to the nearest bf16, fp16 or TF32 (ties to even).
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::F32 => x,
            Precision::Bf16 => round_bf16(x),
            Precision::F16 => round_f16(x),
            Precision::Tf32 => round_tf32(x),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;

    /// `f32`/`float32`, `bf16`/`bfloat16`, `f16`/`fp16`/`float16` or
    /// `tf32`; anything else is a message naming them.
    fn from_str(s: &str) -> Result<Precision, String> {
        match s {
            "f32" | "float32" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::Bf16),
            "f16" | "fp16" | "float16" => Ok(Precision::F16),
            "tf32" => Ok(Precision::Tf32),
            other => Err(format!(
                "no precision `{other}`: there are `f32`, `bf16`, `f16` and `tf32` (bf16, fp16 or TF32 operands, f32 sums)"
            )),
        }
    }
}

/// The bf16 nearest `x` (ties to even), as its 16 bits; a NaN stays a (quiet) NaN.
pub fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    // Adding just under half a unit of the 16 dropped bits, plus the kept
    // part's lowest bit, rounds ties to even; the carry may reach the
    // exponent (rounding up to the next binade, or to infinity).
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

/// The f32 value of bf16 `bits`.
pub fn bf16_value(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// `x` rounded to the nearest bf16 (ties to even).
pub fn round_bf16(x: f32) -> f32 {
    bf16_value(bf16_bits(x))
}

/// `x` rounded to the nearest TF32 (f32's sign and exponent, 10 mantissa
/// bits; ties to even), as an f32; a NaN stays a (quiet) NaN, and a value
/// past TF32's largest finite one becomes infinite.
pub fn round_tf32(x: f32) -> f32 {
    if x.is_nan() {
        return f32::from_bits(x.to_bits() | 0x0040_0000);
    }
    // As for bf16: just under half a unit of the 13 dropped bits, plus the
    // kept part's lowest bit, then the dropped bits cleared.
    let bits = x.to_bits();
    f32::from_bits((bits + 0x0fff + ((bits >> 13) & 1)) & !0x1fff)
}

/// `x` rounded to the nearest IEEE binary16 (ties to even, subnormals kept,
/// past 65504 infinite); a NaN stays a NaN.
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for p in [Precision::F32, Precision::Bf16, Precision::F16, Precision::Tf32] {
            assert_eq!(p.name().parse::<Precision>().unwrap(), p);
        }
        assert_eq!("bfloat16".parse::<Precision>().unwrap(), Precision::Bf16);
        assert_eq!("fp16".parse::<Precision>().unwrap(), Precision::F16);
        let e = "fp8".parse::<Precision>().unwrap_err();
        assert!(e.contains("fp8") && e.contains("bf16") && e.contains("f16") && e.contains("tf32"), "{e}");
    }

    #[test]
    fn rounding_is_to_nearest_even_and_keeps_specials() {
        assert_eq!(round_bf16(1.0), 1.0);
        // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even 1.
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 1.0);
        // 1 + 3·2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: to the even one.
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
        assert_eq!(round_bf16(1.0 + 1.0 / 256.0 + 1e-6), 1.0 + 1.0 / 128.0);
        assert_eq!(round_bf16(-2.5), -2.5);
        assert!(round_bf16(f32::NAN).is_nan());
        assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_bf16(f32::NEG_INFINITY), f32::NEG_INFINITY);
        // The largest f32 rounds past bf16's largest finite value.
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(round_bf16(-0.0).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn fp16_rounding_is_to_nearest_even_with_its_range() {
        // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties go to the even 1.
        assert_eq!(round_f16(1.0 + 1.0 / 2048.0), 1.0);
        assert_eq!(round_f16(1.0 + 3.0 / 2048.0), 1.0 + 1.0 / 512.0);
        assert_eq!(round_f16(65504.0), 65504.0);
        assert_eq!(round_f16(65520.0), f32::INFINITY);
        // The smallest subnormal, 2^-24, is kept; half of it rounds to zero.
        assert_eq!(round_f16(2f32.powi(-24)), 2f32.powi(-24));
        assert_eq!(round_f16(2f32.powi(-26)), 0.0);
        assert!(round_f16(f32::NAN).is_nan());
        assert_eq!(Precision::F32.round(0.1), 0.1);
        assert_eq!(Precision::Bf16.round(0.1), round_bf16(0.1));
        assert_eq!(Precision::F16.round(0.1), round_f16(0.1));
        assert_eq!(Precision::Tf32.round(0.1), round_tf32(0.1));
    }

    #[test]
    fn tf32_rounding_keeps_ten_bits_and_f32s_range() {
        // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties go to the even 1.
        assert_eq!(round_tf32(1.0 + 1.0 / 2048.0), 1.0);
        assert_eq!(round_tf32(1.0 + 3.0 / 2048.0), 1.0 + 1.0 / 512.0);
        assert_eq!(round_tf32(1.0 + 1.0 / 2048.0 + 1e-6), 1.0 + 1.0 / 1024.0);
        // Unlike fp16, f32's range: 65520 (fp16's first infinite value) is a tie that goes to
        // the even 65536, and tiny values stay normal.
        assert_eq!(round_tf32(65520.0), 65536.0);
        assert_eq!(round_tf32(-3.0), -3.0);
        assert_eq!(round_tf32(f32::INFINITY), f32::INFINITY);
        assert_eq!(round_tf32(f32::MAX), f32::INFINITY);
        assert!(round_tf32(f32::NAN).is_nan());
        assert_eq!(round_tf32(-0.0).to_bits(), (-0.0f32).to_bits());
        // Every result has its 13 low bits clear, and is within half a unit of the tenth bit.
        for x in [0.1f32, -7.3, 1234.567, 3.0e-5, 1e-30] {
            let r = round_tf32(x);
            assert_eq!(r.to_bits() & 0x1fff, 0, "{x}");
            assert!(((r - x) / x).abs() <= 2f32.powi(-11), "{x} -> {r}");
        }
    }
}
