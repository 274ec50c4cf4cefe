//! Tensors as the Python half hands them: an address and a shape, of a
//! contiguous tensor it has checked (f32 data, i64 indices), alive for the
//! call; read here when on the CPU, handed on as an address when in
//! device memory.

use cellc_runtime::{DeviceFloats, Result, RuntimeError};

/// A tensor's address and shape.
pub type TensorArg = (usize, Vec<usize>);

/// One tensor of a call, with the name errors give it.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub address: usize,
    pub shape: Vec<usize>,
}

impl Tensor {
    pub fn new(name: impl Into<String>, (address, shape): TensorArg) -> Tensor {
        Tensor { name: name.into(), address, shape }
    }

    /// Each of `args`, named `name[i]`.
    pub fn each(name: &str, args: Vec<TensorArg>) -> Vec<Tensor> {
        args.into_iter().enumerate().map(|(i, a)| Tensor::new(format!("{name}[{i}]"), a)).collect()
    }

    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor as device memory (not read here).
    pub fn on_device(&self) -> DeviceFloats {
        DeviceFloats { addr: self.address as u64, len: self.elements() }
    }

    fn checked_address<T>(&self) -> Result<*mut T> {
        let misaligned = !self.address.is_multiple_of(std::mem::align_of::<T>());
        if (self.address == 0 && self.elements() > 0) || misaligned {
            return Err(RuntimeError::Internal(format!("`{}` has no valid address", self.name)));
        }
        Ok(if self.elements() == 0 { std::ptr::NonNull::dangling().as_ptr() } else { self.address as *mut T })
    }

    /// The tensor's floats.
    ///
    /// # Safety
    /// The Python half checked that this is a contiguous f32 CPU tensor of
    /// this shape, alive and not written by anything else during the call.
    pub unsafe fn floats<'a>(&self) -> Result<&'a [f32]> {
        // SAFETY: per the contract.
        Ok(unsafe { std::slice::from_raw_parts(self.checked_address::<f32>()?, self.elements()) })
    }

    /// The tensor's floats, to write.
    ///
    /// # Safety
    /// As for [`Tensor::floats`], and no other slice of it is alive.
    pub unsafe fn floats_mut<'a>(&self) -> Result<&'a mut [f32]> {
        // SAFETY: per the contract.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.checked_address::<f32>()?, self.elements()) })
    }

    /// The tensor's i64 values as indices (sizes, lengths, permutations):
    /// a negative value is an error naming the tensor, or, for lengths, the
    /// runtime's length error.
    ///
    /// # Safety
    /// As for [`Tensor::floats`], for an i64 tensor.
    pub unsafe fn indices(&self, lengths: bool, steps: usize) -> Result<Vec<usize>> {
        // SAFETY: per the contract.
        let values = unsafe { std::slice::from_raw_parts(self.checked_address::<i64>()?, self.elements()) };
        values
            .iter()
            .enumerate()
            .map(|(i, &v)| match usize::try_from(v) {
                Ok(v) => Ok(v),
                Err(_) if lengths => Err(RuntimeError::Length { sequence: i, length: v, steps }),
                Err(_) => Err(RuntimeError::Shape {
                    tensor: self.name.clone(),
                    expected: "values of at least 0".into(),
                    found: format!("{v} at index {i}"),
                }),
            })
            .collect()
    }
}
