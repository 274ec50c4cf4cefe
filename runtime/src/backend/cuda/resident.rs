//! Passes over the caller's device memory ([`crate::device_call`]): the
//! [`PassTarget`] on which the driver runs each layer and direction with
//! [`forward_on`] / [`backward_on`], on the device as it works on the
//! caller's stream ([`Device::on_stream`]), with nothing copied to or from
//! the host but pointer tables. The spans are device addresses; the
//! pass's scratch memory is the device's, freed (stream-ordered) when the
//! pass ends.

use super::backward::{backward_on, BackwardIo};
use super::calls::Calls;
use super::device::{Buf, Device};
use super::forward::{forward_on, ForwardIo};
use super::storage::{Home, LayerRun};
use super::Cuda;
use crate::backend::DevicePasses;
use crate::backend::PreparedWeights;
use crate::cell::{CompiledCell, Layer};
use crate::dropout::LayerMasks;
use crate::error::Result;
use crate::masks::{MaskFill, MaskRows};
use crate::pass::{LayerBackward, LayerForward, PassTarget, RowSpan, Span};
use crate::sequence::LaidOutBatch;
use std::sync::Arc;

/// A pass of a cell on one device (the caller's stream, or the device itself).
struct DeviceTarget<'a> {
    cuda: &'a Cuda,
    /// The device on the caller's stream, where it has streams.
    on_stream: Option<Box<dyn Device + 'a>>,
    cell: &'a CompiledCell,
    batch: &'a LaidOutBatch,
    /// `[layer * directions + direction][param]`.
    weights: Vec<Vec<Span>>,
    layers: &'a [Layer],
    scratch: Vec<Buf>,
}

impl DeviceTarget<'_> {
    fn device(&self) -> &dyn Device {
        self.on_stream.as_deref().unwrap_or(self.cuda.device.as_ref())
    }

    /// Runs the calls `make` adds (over a pass of the batch) with the
    /// first layer's module, which holds the prelude's row kernels as
    /// every module does.
    fn run(&self, make: impl FnOnce(&mut Calls, &mut LayerRun) -> Result<()>) -> Result<()> {
        let Some(layer) = self.layers.first() else { return Ok(()) };
        let kernels = self.cuda.kernels(self.cell, layer)?;
        let device = self.device();
        let mut pass = LayerRun::new(device, &self.batch.layout, self.batch.rows, &self.batch.order, false);
        let mut calls = Calls::new(device.block_size(), self.cuda.precision);
        make(&mut calls, &mut pass)?;
        device.run(&kernels.module, &calls.list, false)
    }

    /// Slot `slot`'s parameters, those with a DropConnect mask copied into
    /// scratch memory of the pass and multiplied by it.
    fn masked_params(&mut self, slot: usize, drop_connect: &[(usize, MaskFill)]) -> Result<Vec<u64>> {
        let mut params = addrs(&self.weights[slot]);
        for (param, fill) in drop_connect {
            let from = self.weights[slot][*param];
            let to = self.scratch(from.len, false)?;
            self.run(|calls, pass| {
                calls.copy_floats(pass, to.addr, from.addr, from.len)?;
                calls.fill_mask(pass, &whole(to.addr, fill.units), CHUNK, (fill, true))
            })?;
            params[*param] = to.addr;
        }
        Ok(params)
    }

    /// A layer's run over the batch the layers run (its segments, where it has resets).
    fn layer_run(&self, reverse: bool) -> LayerRun<'_> {
        let run = self.batch.running();
        LayerRun::new(self.device(), &run.layout, run.rows, &run.order, reverse)
            .in_precision(self.cuda.precision)
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

impl PassTarget for DeviceTarget<'_> {
    fn scratch(&mut self, floats: usize, _zeroed: bool) -> Result<Span> {
        let buf = self.device().zeros(floats)?;
        let span = Span { addr: buf.addr, len: floats };
        self.scratch.push(buf);
        Ok(span)
    }

    /// Zeros every row: one call, and the valid ones are written after.
    fn zero_padding(&mut self, rows: RowSpan, _padding: &[usize]) -> Result<()> {
        self.zero(rows.span)
    }

    fn zero(&mut self, span: Span) -> Result<()> {
        self.run(|calls, _| {
            calls.zero(span.addr, span.len);
            Ok(())
        })
    }

    fn copy(&mut self, to: Span, from: Span) -> Result<()> {
        self.run(|calls, pass| calls.copy_floats(pass, to.addr, from.addr, to.len.min(from.len)))
    }

    fn copy_rows(&mut self, to: Span, from: Span, width: usize, pairs: &[(usize, usize)]) -> Result<()> {
        let pairs = Self::row_addrs(to, from, width, pairs);
        self.run(|calls, pass| calls.copy_rows(pass, &pairs, width))
    }

    fn add_rows(&mut self, to: Span, from: Span, width: usize, pairs: &[(usize, usize)]) -> Result<()> {
        let pairs = Self::row_addrs(to, from, width, pairs);
        self.run(|calls, pass| calls.add_rows(pass, &pairs, width))
    }

    fn drop_out(&mut self, rows: RowSpan, masks: &LayerMasks) -> Result<()> {
        let (order, layout) = (&self.batch.order, &self.batch.layout);
        let valid: Vec<(u64, usize, usize)> = (0..order.batch())
            .flat_map(|b| (0..order.lengths()[b]).map(move |t| (b, t)))
            .map(|(b, t)| (rows.span.addr + 4 * (layout.row(b, t) * rows.width + rows.offset) as u64, b, t))
            .collect();
        self.run(|calls, pass| calls.drop_rows(pass, &valid, masks))
    }

    fn fill_masks(&mut self, rows: RowSpan, masks: &MaskRows) -> Result<()> {
        let (order, layout) = (&self.batch.order, &self.batch.layout);
        self.run(|calls, pass| {
            for fill in &masks.fills {
                if rows.width == 0 {
                    // One row, read by every row (evaluation).
                    let at = [(rows.span.addr + 4 * fill.offset as u64, 0, 0, 0)];
                    calls.fill_mask(pass, &at, fill.units, (fill, false))?;
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
                calls.fill_mask(pass, &at, fill.units, (fill, false))?;
            }
            Ok(())
        })
    }

    fn forward(&mut self, job: LayerForward) -> Result<()> {
        let kernels = self.cuda.kernels(self.cell, job.layer)?;
        let params = self.masked_params(job.slot, &job.drop_connect)?;
        let io = ForwardIo {
            input: layout_home(job.input),
            masks: job.masks.map(layout_home),
            params,
            h0: addrs(&job.h0),
            output: layout_home(job.output),
            finals: addrs(&job.finals),
            tape: job.tape.map(|t| t.addr),
        };
        let mut pass = self.layer_run(job.reverse);
        let cell = (self.cell, job.layer);
        forward_on(&mut pass, &kernels.module, &kernels.forward, cell, &io, self.cuda.graphs)
    }

    fn backward(&mut self, job: LayerBackward) -> Result<()> {
        let kernels = self.cuda.kernels(self.cell, job.layer)?;
        let params = self.masked_params(job.slot, &job.drop_connect)?;
        let io = BackwardIo {
            input: layout_home(job.input),
            masks: job.masks.map(layout_home),
            params,
            tape: job.tape.addr,
            d_output: layout_home(job.d_output),
            d_final: addrs(&job.d_final),
            d_input: layout_home(job.d_input),
            d_params: addrs(&job.d_params),
            d_h0: addrs(&job.d_h0),
        };
        let mut pass = self.layer_run(job.reverse);
        let cell = (self.cell, job.layer);
        backward_on(&mut pass, &kernels.module, &kernels.backward, cell, &io, self.cuda.graphs)?;
        drop(pass);
        // The masked parameter's gradient, times the mask: the parameter's.
        self.run(|calls, pass| {
            for (param, fill) in &job.drop_connect {
                calls.fill_mask(pass, &whole(io.d_params[*param], fill.units), CHUNK, (fill, true))?;
            }
            Ok(())
        })
    }
}

impl DevicePasses for Cuda {
    fn target<'a>(
        &'a self,
        cell: &'a CompiledCell,
        layers: &'a [Layer],
        batch: &'a LaidOutBatch,
        weights: Vec<Vec<Span>>,
        stream: Option<u64>,
    ) -> Result<Box<dyn PassTarget + 'a>> {
        let on_stream = match stream {
            Some(stream) => self.device.on_stream(stream)?,
            None => None,
        };
        let scratch = Vec::new();
        Ok(Box::new(DeviceTarget { cuda: self, on_stream, cell, batch, weights, layers, scratch }))
    }

    fn upload(&self, data: &[f32]) -> Result<Buf> {
        self.device.upload(data)
    }

    fn zeros(&self, len: usize) -> Result<Buf> {
        self.device.zeros(len)
    }

    fn download(&self, buf: &Buf) -> Result<Vec<f32>> {
        self.device.download(buf, 0, buf.len)
    }

    fn params(&self, params: &[&[f32]], prepared: &PreparedWeights) -> Result<Arc<Vec<Buf>>> {
        super::forward::params_on_device(self.device.as_ref(), params, prepared)
    }
}
