//! Symbolic dimensions: polynomials in size variables with integer weights.
//!
//! `4*H`, `2*H + I` and `H*H` are all [`Dim`]s. A dimension is kept in a
//! normal form — a sum of distinct monomials, each a sorted product of
//! variables, with non-zero integer coefficients — so that two dimensions
//! are equal exactly when they are equal as polynomials, and printing is
//! canonical (`2*H + I` however it was written).

use std::collections::BTreeMap;
use std::fmt;

/// A product of size variables, sorted (`["H", "H", "I"]` is `H*H*I`); empty is the constant term.
type Monomial = Vec<String>;

/// A symbolic dimension such as `4*H` or `2*H + I`: a polynomial in size
/// variables with integer coefficients, kept in normal form so `==` is
/// polynomial equality.
#[derive(Clone, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Dim {
    terms: BTreeMap<Monomial, i64>,
}

/// The most terms a product of dimensions may expand to.
pub const MAX_TERMS: usize = 64;
/// The most size variables a term of a product may multiply (`H*H*H*H` is 4).
pub const MAX_DEGREE: usize = 8;

/// The size variables' values at instantiation.
pub type Bindings = BTreeMap<String, usize>;

/// Why a dimension has no concrete value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EvalError {
    /// The named size variable has no value in the bindings.
    Unbound(String),
    /// The value, or a size variable's value, does not fit in an `i64`.
    Overflow,
}

impl Dim {
    /// The dimension with constant value `n`.
    pub fn constant(n: i64) -> Dim {
        let mut terms = BTreeMap::new();
        if n != 0 {
            terms.insert(Vec::new(), n);
        }
        Dim { terms }
    }

    /// The dimension that is the size variable `name` (e.g. `H`).
    pub fn var(name: &str) -> Dim {
        Dim { terms: BTreeMap::from([(vec![name.to_string()], 1)]) }
    }

    /// `Some(n)` when the dimension does not depend on any variable.
    pub fn as_constant(&self) -> Option<i64> {
        match self.terms.len() {
            0 => Some(0),
            1 => self.terms.get(&Vec::new()).copied(),
            _ => None,
        }
    }

    /// Whether the dimension is the constant 0.
    pub fn is_zero(&self) -> bool {
        self.terms.is_empty()
    }

    /// `Some` unless a coefficient overflows.
    pub fn checked_add(&self, other: &Dim) -> Option<Dim> {
        let mut terms = self.terms.clone();
        for (m, c) in &other.terms {
            let e = terms.entry(m.clone()).or_insert(0);
            *e = e.checked_add(*c)?;
        }
        terms.retain(|_, c| *c != 0);
        Some(Dim { terms })
    }

    /// `self - other`; `None` if a coefficient overflows.
    pub fn checked_sub(&self, other: &Dim) -> Option<Dim> {
        self.checked_add(&other.checked_scale(-1)?)
    }

    /// `k * self`; `None` if a coefficient overflows.
    pub fn checked_scale(&self, k: i64) -> Option<Dim> {
        let mut terms = BTreeMap::new();
        for (m, c) in &self.terms {
            let v = c.checked_mul(k)?;
            if v != 0 {
                terms.insert(m.clone(), v);
            }
        }
        Some(Dim { terms })
    }

    /// `Some` unless a coefficient overflows or the product is too
    /// complex to keep expanded ([`Dim::product_too_complex`]).
    pub fn checked_mul(&self, other: &Dim) -> Option<Dim> {
        if self.product_too_complex(other) {
            return None;
        }
        let mut terms: BTreeMap<Monomial, i64> = BTreeMap::new();
        for (ma, ca) in &self.terms {
            for (mb, cb) in &other.terms {
                let mut m = ma.clone();
                m.extend(mb.iter().cloned());
                m.sort();
                let e = terms.entry(m).or_insert(0);
                *e = e.checked_add(ca.checked_mul(*cb)?)?;
            }
        }
        terms.retain(|_, c| *c != 0);
        Some(Dim { terms })
    }

    /// Whether `self * other` expands past [`MAX_TERMS`] terms or
    /// [`MAX_DEGREE`] variables in a term. A product of sums expands
    /// exponentially (`(A0+B0)*...*(A13+B13)` has 16384 terms), so such a
    /// size is refused where it is written rather than computed.
    pub fn product_too_complex(&self, other: &Dim) -> bool {
        let degree = |d: &Dim| d.terms.keys().map(Vec::len).max().unwrap_or(0);
        self.terms.len().saturating_mul(other.terms.len()) > MAX_TERMS
            || degree(self) + degree(other) > MAX_DEGREE
    }

    /// `self / n` when every coefficient is divisible by `n` (so `4*H / 4 = H`,
    /// but `H / 2` has no symbolic answer).
    pub fn exact_div(&self, n: i64) -> Option<Dim> {
        if n == 0 || self.terms.values().any(|c| c % n != 0) {
            return None;
        }
        Some(Dim { terms: self.terms.iter().map(|(m, c)| (m.clone(), c / n)).collect() })
    }

    /// The size variables this dimension mentions, sorted, without repeats.
    pub fn variables(&self) -> Vec<String> {
        let mut v: Vec<String> = self.terms.keys().flatten().cloned().collect();
        v.sort();
        v.dedup();
        v
    }

    /// True when the dimension cannot be positive for any positive sizes:
    /// every coefficient is zero or negative.
    pub fn is_never_positive(&self) -> bool {
        self.terms.values().all(|c| *c <= 0)
    }

    /// The dimension's value under `bindings`.
    pub fn eval(&self, bindings: &Bindings) -> Result<i64, EvalError> {
        let mut total: i64 = 0;
        for (m, c) in &self.terms {
            let mut v = *c;
            for name in m {
                let x = *bindings.get(name).ok_or_else(|| EvalError::Unbound(name.clone()))?;
                let x = i64::try_from(x).map_err(|_| EvalError::Overflow)?;
                v = v.checked_mul(x).ok_or(EvalError::Overflow)?;
            }
            total = total.checked_add(v).ok_or(EvalError::Overflow)?;
        }
        Ok(total)
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.terms.is_empty() {
            return f.write_str("0");
        }
        // Highest degree first, the constant last: `H*H + 4*H + 1`.
        let mut terms: Vec<_> = self.terms.iter().collect();
        terms.sort_by(|(ma, _), (mb, _)| mb.len().cmp(&ma.len()).then(ma.cmp(mb)));
        for (i, (m, c)) in terms.into_iter().enumerate() {
            let (neg, mag) = (*c < 0, c.unsigned_abs());
            match (i, neg) {
                (0, true) => f.write_str("-")?,
                (0, false) => {}
                (_, true) => f.write_str(" - ")?,
                (_, false) => f.write_str(" + ")?,
            }
            if m.is_empty() {
                write!(f, "{mag}")?;
            } else {
                if mag != 1 {
                    write!(f, "{mag}*")?;
                }
                f.write_str(&m.join("*"))?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Dim({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h() -> Dim {
        Dim::var("H")
    }
    fn i() -> Dim {
        Dim::var("I")
    }

    #[test]
    fn normal_form_makes_equal_polynomials_equal() {
        let a = h().checked_scale(2).unwrap().checked_add(&i()).unwrap(); // 2*H + I
        let b = i().checked_add(&h()).unwrap().checked_add(&h()).unwrap(); // I + H + H
        assert_eq!(a, b);
        assert_eq!(a.to_string(), "2*H + I");
        let sq = h().checked_mul(&h().checked_add(&Dim::constant(1)).unwrap()).unwrap();
        assert_eq!(sq.to_string(), "H*H + H");
        assert!(h().checked_sub(&h()).unwrap().is_zero());
        assert_eq!(Dim::constant(3).checked_sub(&h()).unwrap().to_string(), "-H + 3");
    }

    #[test]
    fn divisibility_is_symbolic() {
        let four_h = h().checked_scale(4).unwrap();
        assert_eq!(four_h.exact_div(4), Some(h()));
        assert_eq!(four_h.exact_div(2), Some(h().checked_scale(2).unwrap()));
        assert_eq!(h().exact_div(2), None);
        assert_eq!(four_h.checked_add(&i()).unwrap().exact_div(2), None);
    }

    #[test]
    fn evaluates_and_reports_unbound() {
        let d = h().checked_scale(4).unwrap().checked_add(&i()).unwrap();
        let b = Bindings::from([("H".into(), 5), ("I".into(), 3)]);
        assert_eq!(d.eval(&b), Ok(23));
        assert_eq!(d.eval(&Bindings::new()), Err(EvalError::Unbound("H".into())));
    }
}
