//! The CUDA device's side of [`Device`]: passes over device memory (the
//! model's own, staged there, or a caller's, [`crate::model::device_call`]),
//! every operation queued on the device, with nothing copied to or from
//! the host but pointer tables. A pass over a caller's memory runs on the
//! device as it works on the caller's stream ([`Device::on_stream`]); its
//! scratch memory is then freed stream-ordered when the pass ends.

use super::backward::{backward_on, BackwardIo};
use super::calls::Calls;
use super::device::{Buf, Device as Target};
use super::forward::{forward_on, ForwardIo};
use super::storage::{Home, LayerRun};
use super::Cuda;
use crate::backend::Device;
use crate::error::Result;
use crate::masks::MaskRows;
use crate::pass::{Dropping, LayerBackward, LayerForward, Memory, Pass, RowPairs, RowSpan, Span};
use cellc::precision::Precision;

/// The CUDA device working on one target: its own, or a caller's stream.
struct On<'a> {
    cuda: &'a Cuda,
    target: &'a dyn Target,
}

/// The CUDA device working on a caller's stream, for one pass.
struct OnStream<'a> {
    cuda: &'a Cuda,
    target: Box<dyn Target + 'a>,
}

impl On<'_> {
    /// Runs the calls `make` adds (over a pass of the batch) with the
    /// first layer's module, which holds the prelude's row kernels as
    /// every module does.
    fn run(&self, pass: &Pass, make: impl FnOnce(&mut Calls, &mut LayerRun) -> Result<()>) -> Result<()> {
        let Some(layer) = pass.layers.first() else { return Ok(()) };
        let kernels = self.cuda.kernels(pass.cell, layer)?;
        let batch = pass.batch;
        let mut run = LayerRun::new(self.target, &batch.layout, batch.rows, &batch.order, false);
        let mut calls = Calls::new(self.target.block_size(), pass.precision);
        make(&mut calls, &mut run)?;
        self.target.run(&kernels.module, &calls.list, false)
    }

    /// A layer's run over the batch the layers run (its segments, where it has resets).
    fn layer_run<'p>(&'p self, pass: &'p Pass, reverse: bool) -> LayerRun<'p> {
        let run = pass.batch.running();
        LayerRun::new(self.target, &run.layout, run.rows, &run.order, reverse)
            .in_precision(pass.precision)
            .with_step_loops(self.cuda.step_loops)
    }

    /// Row pairs `(i, j)` of `to` and `from` as address pairs.
    fn row_addrs(to: Span, from: Span, width: usize, pairs: &[(usize, usize)]) -> Vec<(u64, u64)> {
        let row = |s: Span, i: usize| s.addr + 4 * (i * width) as u64;
        pairs.iter().map(|&(i, j)| (row(to, i), row(from, j))).collect()
    }
}

/// Rows of a span as a `Layout` home based at the rows' first feature.
fn layout_home(rows: RowSpan) -> Home {
    Home::Layout { base: rows.span.addr + 4 * rows.offset as u64, width: rows.width }
}

/// Units of a DropConnect mask per row of its launch.
const CHUNK: usize = 4096;

/// A parameter's `units` floats at `addr` as rows of [`CHUNK`] units for
/// `cellc_fill_mask` (the last row may be shorter: the kernel is launched
/// with [`CHUNK`] units a row, so the parameter is padded to a multiple).
fn whole(addr: u64, units: usize) -> Vec<(u64, u32, u32, u32)> {
    use cellc::random::SHARED;
    (0..units.div_ceil(CHUNK))
        .map(|i| (addr + 4 * (i * CHUNK) as u64, SHARED, SHARED, (i * CHUNK) as u32))
        .collect()
}

fn addrs(spans: &[Span]) -> Vec<u64> {
    spans.iter().map(|s| s.addr).collect()
}

impl Device for On<'_> {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn memory(&self) -> Memory {
        Memory::Device
    }

    /// Every precision: at bf16, fp16 or TF32, cuBLAS rounds the operands
    /// of the products of matrix parameters and sums in f32 on the tensor
    /// cores (`CUBLAS_COMPUTE_32F_FAST_16BF`, `_16F` or `_TF32`); the
    /// emulated device rounds them the same way. Everything else stays f32.
    fn precision(&self, asked: Precision) -> Result<Precision> {
        Ok(asked)
    }

    fn scratch(&self, _: &Pass, floats: usize, _zeroed: bool) -> Result<Buf> {
        self.target.zeros(floats)
    }

    /// Zeros every row: one call, and the valid ones are written after.
    fn zero(&self, pass: &Pass, span: Span, _rows: Option<(usize, &[usize])>) -> Result<()> {
        self.run(pass, |calls, _| {
            calls.zero(span.addr, span.len);
            Ok(())
        })
    }

    fn move_rows(&self, pass: &Pass, rows: RowPairs) -> Result<()> {
        let RowPairs { to, from, width, pairs, add } = rows;
        if let ([(0, 0)], false) = (pairs, add) {
            // One row: a copy of any length, in rows of the kernel's size.
            return self.run(pass, |calls, run| calls.copy_floats(run, to.addr, from.addr, width));
        }
        let pairs = Self::row_addrs(to, from, width, pairs);
        self.run(pass, |calls, run| match add {
            true => calls.add_rows(run, &pairs, width),
            false => calls.copy_rows(run, &pairs, width),
        })
    }

    fn upload(&self, data: &[f32]) -> Result<Buf> {
        self.target.upload(data)
    }

    fn download(&self, _: &Pass, from: Span, to: &mut [f32]) -> Result<()> {
        let data = self.target.download(&Buf::new(from.addr, from.len, Box::new(())), 0, from.len)?;
        crate::sequence::check_len("download", to.len(), &[data.len()])?;
        to.copy_from_slice(&data);
        Ok(())
    }

    fn fill_masks(&self, pass: &Pass, rows: RowSpan, masks: &MaskRows) -> Result<()> {
        let (order, layout) = (&pass.batch.order, &pass.batch.layout);
        self.run(pass, |calls, run| {
            for fill in &masks.fills {
                if rows.width == 0 {
                    // One row, read by every row (evaluation).
                    let at = [(rows.span.addr + 4 * fill.offset as u64, 0, 0, 0)];
                    calls.fill_mask(run, &at, fill.units, (fill, false))?;
                    continue;
                }
                let at: Vec<(u64, u32, u32, u32)> = (0..order.batch())
                    .flat_map(|b| (0..order.lengths()[b]).map(move |t| (b, t)))
                    .map(|(b, t)| {
                        let addr = rows.span.addr + 4 * (layout.row(b, t) * rows.width + fill.offset) as u64;
                        let (sequence, step) = fill.coordinates(b, t);
                        (addr, sequence, step, 0)
                    })
                    .collect();
                calls.fill_mask(run, &at, fill.units, (fill, false))?;
            }
            Ok(())
        })
    }

    fn drop_out(&self, pass: &Pass, rows: RowSpan, masks: Dropping) -> Result<()> {
        let masks = match masks {
            Dropping::Rows(masks) => masks,
            Dropping::Parameter(fill) => {
                let at = whole(rows.span.addr, fill.units);
                return self.run(pass, |calls, run| calls.fill_mask(run, &at, CHUNK, (fill, true)));
            }
        };
        let (order, layout) = (&pass.batch.order, &pass.batch.layout);
        let valid: Vec<(u64, usize, usize)> = (0..order.batch())
            .flat_map(|b| (0..order.lengths()[b]).map(move |t| (b, t)))
            .map(|(b, t)| (rows.span.addr + 4 * (layout.row(b, t) * rows.width + rows.offset) as u64, b, t))
            .collect();
        self.run(pass, |calls, run| calls.drop_rows(run, &valid, masks))
    }

    fn forward(&self, pass: &Pass, job: LayerForward) -> Result<()> {
        let kernels = self.cuda.kernels(pass.cell, job.layer)?;
        let io = ForwardIo {
            input: layout_home(job.input),
            masks: job.masks.map(layout_home),
            params: addrs(&job.params),
            h0: addrs(&job.h0),
            output: layout_home(job.output),
            finals: addrs(&job.finals),
            tape: job.tape.map(|t| t.addr),
        };
        let mut run = self.layer_run(pass, job.reverse);
        let cell = (pass.cell, job.layer);
        forward_on(&mut run, &kernels.module, &kernels.forward, cell, &io, self.cuda.graphs)?;
        self.cuda.count_step_loops(run.step_loops_taken);
        Ok(())
    }

    fn backward(&self, pass: &Pass, job: LayerBackward) -> Result<()> {
        let kernels = self.cuda.kernels(pass.cell, job.layer)?;
        let io = BackwardIo {
            input: layout_home(job.input),
            masks: job.masks.map(layout_home),
            params: addrs(&job.params),
            tape: job.tape.addr,
            d_output: layout_home(job.d_output),
            d_final: addrs(&job.d_final),
            h0: addrs(&job.h0),
            d_input: layout_home(job.d_input),
            d_params: addrs(&job.d_params),
            d_h0: addrs(&job.d_h0),
        };
        let mut run = self.layer_run(pass, job.reverse);
        let cell = (pass.cell, job.layer);
        backward_on(&mut run, &kernels.module, &kernels.backward, cell, &io, self.cuda.graphs)?;
        self.cuda.count_step_loops(run.step_loops_taken);
        Ok(())
    }
}

/// A device whose every operation is `On`'s, on the target `$on` names
/// (it has no step path: a stream runs each call as a batch).
macro_rules! on_target {
    ($ty:ty, |$s:ident| $on:expr) => {
        impl Device for $ty {
            fn name(&self) -> &'static str {
                let $s = self;
                $on.name()
            }

            fn memory(&self) -> Memory {
                let $s = self;
                $on.memory()
            }

            fn precision(&self, asked: Precision) -> Result<Precision> {
                let $s = self;
                $on.precision(asked)
            }

            fn scratch(&self, pass: &Pass, floats: usize, zeroed: bool) -> Result<Buf> {
                let $s = self;
                $on.scratch(pass, floats, zeroed)
            }

            fn zero(&self, pass: &Pass, span: Span, rows: Option<(usize, &[usize])>) -> Result<()> {
                let $s = self;
                $on.zero(pass, span, rows)
            }

            fn move_rows(&self, pass: &Pass, rows: RowPairs) -> Result<()> {
                let $s = self;
                $on.move_rows(pass, rows)
            }

            fn upload(&self, data: &[f32]) -> Result<Buf> {
                let $s = self;
                $on.upload(data)
            }

            fn download(&self, pass: &Pass, from: Span, to: &mut [f32]) -> Result<()> {
                let $s = self;
                $on.download(pass, from, to)
            }

            fn fill_masks(&self, pass: &Pass, rows: RowSpan, masks: &MaskRows) -> Result<()> {
                let $s = self;
                $on.fill_masks(pass, rows, masks)
            }

            fn drop_out(&self, pass: &Pass, rows: RowSpan, masks: Dropping) -> Result<()> {
                let $s = self;
                $on.drop_out(pass, rows, masks)
            }

            fn forward(&self, pass: &Pass, job: LayerForward) -> Result<()> {
                let $s = self;
                $on.forward(pass, job)
            }

            fn backward(&self, pass: &Pass, job: LayerBackward) -> Result<()> {
                let $s = self;
                $on.backward(pass, job)
            }

            fn on_stream(&self, stream: u64) -> Result<Option<Box<dyn Device + '_>>> {
                let $s = self;
                let cuda = $on.cuda;
                let target = cuda.device.on_stream(stream)?;
                Ok(target.map(|target| Box::new(OnStream { cuda, target }) as Box<dyn Device + '_>))
            }
        }
    };
}

on_target!(Cuda, |s| On { cuda: s, target: s.device.as_ref() });
on_target!(OnStream<'_>, |s| On { cuda: s.cuda, target: s.target.as_ref() });
