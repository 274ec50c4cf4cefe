//! Random batches, and the same batch in each of the runtime's layouts:
//! padded (batch- or time-first, padding at the end or the start) with
//! NaN at every padding position, so a back end that reads padding shows
//! it, or packed as PyTorch packs.

use cellc::fuzzgen::Entropy;
use cellc_runtime::{Align, BatchOrder, Input, Major, PackedSequence, RowLayout};
use serde::{Deserialize, Serialize};

/// How a batch is laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Layout {
    Padded { batch_first: bool, right_aligned: bool },
    Packed,
}

impl Layout {
    pub const ALL: [Layout; 5] = [
        Layout::Padded { batch_first: true, right_aligned: false },
        Layout::Padded { batch_first: true, right_aligned: true },
        Layout::Padded { batch_first: false, right_aligned: false },
        Layout::Padded { batch_first: false, right_aligned: true },
        Layout::Packed,
    ];
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Layout::Padded { batch_first, right_aligned } => write!(
                f,
                "padded {}, {}",
                if *batch_first { "batch-first" } else { "time-first" },
                if *right_aligned { "right-aligned" } else { "left-aligned" }
            ),
            Layout::Packed => write!(f, "packed"),
        }
    }
}

/// A batch of sequences with their initial states and the adjoints a
/// backward pass starts from.
#[derive(Clone, Debug)]
pub struct Batch {
    pub lengths: Vec<usize>,
    /// The padded length (at least the longest sequence).
    pub steps: usize,
    /// `xs[b][t]`: the input features of sequence `b` at step `t`.
    pub xs: Vec<Vec<Vec<f32>>>,
    /// `d_out[b][t]`: the output adjoint.
    pub d_out: Vec<Vec<Vec<f32>>>,
    /// One buffer per state, `[layers * directions, B, size]`.
    pub h0: Vec<Vec<f32>>,
    pub d_final: Vec<Vec<f32>>,
    /// `(sequence, step)`s at which the state restarts from the initial
    /// states (per-step resets); those at a first step or past a
    /// sequence's end change nothing.
    pub resets: Vec<(usize, usize)>,
}

fn uniform(rng: &mut Entropy, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale).collect()
}

impl Batch {
    /// Random values for sequences of `lengths` padded to `steps`, with
    /// `features` inputs and `outputs` outputs per step, and `ld`
    /// (layers times directions) initial states of each of `states`' sizes.
    pub fn random(
        rng: &mut Entropy,
        lengths: &[usize],
        steps: usize,
        (features, outputs): (usize, usize),
        states: &[usize],
        ld: usize,
    ) -> Batch {
        let rows = |rng: &mut Entropy, n: usize| -> Vec<Vec<Vec<f32>>> {
            lengths.iter().map(|&l| (0..l).map(|_| uniform(rng, n, 1.0)).collect()).collect()
        };
        let xs = rows(rng, features);
        let d_out = rows(rng, outputs);
        let batch = lengths.len();
        let h0 = states.iter().map(|&n| uniform(rng, ld * batch * n, 0.5)).collect();
        let d_final = states.iter().map(|&n| uniform(rng, ld * batch * n, 1.0)).collect();
        Batch { lengths: lengths.to_vec(), steps, xs, d_out, h0, d_final, resets: Vec::new() }
    }

    /// The resets as the runtime takes them, one flag per row of
    /// `layout`; `None` without resets. Padding rows are flagged, which
    /// must change nothing.
    pub fn reset_flags(&self, layout: Layout) -> Result<Option<Vec<bool>>, String> {
        if self.resets.is_empty() {
            return Ok(None);
        }
        let rows = match layout {
            Layout::Packed => self.lengths.iter().sum(),
            Layout::Padded { .. } => self.lengths.len() * self.steps,
        };
        let at = self.row_layout(layout)?;
        let mut flags = vec![true; rows];
        for (b, &len) in self.lengths.iter().enumerate() {
            for t in 0..len {
                flags[at.row(b, t)] = self.resets.contains(&(b, t));
            }
        }
        Ok(Some(flags))
    }

    pub fn order(&self) -> Result<BatchOrder, String> {
        BatchOrder::new(&self.lengths, self.steps).map_err(|e| e.to_string())
    }

    /// Where row `(b, t)` lives in `layout`.
    pub fn row_layout(&self, layout: Layout) -> Result<RowLayout, String> {
        let plan = self.order()?;
        Ok(match layout {
            Layout::Padded { batch_first, right_aligned } => {
                RowLayout::padded(&plan, self.steps, major(batch_first), align(right_aligned))
            }
            Layout::Packed => RowLayout::packed(&plan),
        })
    }

    /// Rows of `per_step` (`[b][t]`, `width` features each) in `layout`,
    /// NaN at padding.
    pub fn lay_out(
        &self,
        layout: Layout,
        per_step: &[Vec<Vec<f32>>],
        width: usize,
    ) -> Result<Vec<f32>, String> {
        let rows = match layout {
            Layout::Packed => self.lengths.iter().sum(),
            Layout::Padded { .. } => self.lengths.len() * self.steps,
        };
        let at = self.row_layout(layout)?;
        let mut data = vec![f32::NAN; rows * width];
        for (b, seq) in per_step.iter().enumerate() {
            for (t, row) in seq.iter().enumerate() {
                let r = at.row(b, t);
                data[r * width..(r + 1) * width].copy_from_slice(row);
            }
        }
        Ok(data)
    }
}

/// A batch's inputs laid out for the runtime.
#[derive(Debug)]
pub enum LaidOut {
    Padded { data: Vec<f32>, batch_first: bool, right_aligned: bool },
    Packed(PackedSequence),
}

impl LaidOut {
    /// The batch's inputs in `layout`.
    pub fn inputs(batch: &Batch, layout: Layout, features: usize) -> Result<LaidOut, String> {
        let data = batch.lay_out(layout, &batch.xs, features)?;
        Ok(match layout {
            Layout::Padded { batch_first, right_aligned } => {
                LaidOut::Padded { data, batch_first, right_aligned }
            }
            Layout::Packed => {
                let plan = batch.order()?;
                let order = plan.order().to_vec();
                let mut unsorted = vec![0; order.len()];
                for (rank, &b) in order.iter().enumerate() {
                    unsorted[b] = rank;
                }
                LaidOut::Packed(PackedSequence {
                    data,
                    features,
                    batch_sizes: plan.batch_sizes().to_vec(),
                    sorted_indices: order,
                    unsorted_indices: unsorted,
                })
            }
        })
    }

    pub fn input<'a>(&'a self, batch: &'a Batch) -> Input<'a> {
        match self {
            LaidOut::Packed(p) => Input::Packed(p.view()),
            LaidOut::Padded { data, batch_first, right_aligned } => Input::Padded {
                data,
                batch: batch.lengths.len(),
                steps: batch.steps,
                major: major(*batch_first),
                align: align(*right_aligned),
                lengths: &batch.lengths,
            },
        }
    }
}

fn major(batch_first: bool) -> Major {
    if batch_first {
        Major::BatchFirst
    } else {
        Major::TimeFirst
    }
}

fn align(right: bool) -> Align {
    if right {
        Align::Right
    } else {
        Align::Left
    }
}
