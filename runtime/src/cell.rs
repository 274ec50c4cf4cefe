//! A cell compiled once ([`CompiledCell`]), and its program at one
//! layer's sizes ([`Layer`]): what every back end reads. Nothing here
//! knows of models or back ends.

use crate::error::{Result, RuntimeError};
use crate::plan::PassPlan;
use cellc::dims::Bindings;
use cellc::ir::Cell;
pub use cellc::program::Side;
use cellc::program::{Program, Steps};

/// A cell compiled once: its simplified forward step and derived backward
/// step (a [`Steps`], which it dereferences to: `forward`, `backward`, `graph(side)`).
#[derive(Debug)]
pub struct CompiledCell {
    steps: Steps,
    /// Both steps' IR as text: what back ends key compiled kernels by.
    identity: String,
}

impl std::ops::Deref for CompiledCell {
    type Target = Steps;

    fn deref(&self) -> &Steps {
        &self.steps
    }
}

impl CompiledCell {
    /// Compiles the first cell of `source` (or the one named `cell`).
    pub fn from_source(file_name: &str, source: &str, cell: Option<&str>) -> Result<CompiledCell> {
        CompiledCell::from_cell(Self::checked(file_name, source, cell)?)
    }

    /// The first cell of `source` (or the one named `cell`), checked by the
    /// front end only: its declarations, without deriving its backward.
    pub fn checked(file_name: &str, source: &str, cell: Option<&str>) -> Result<Cell> {
        let module = cellc::compile(file_name, source)
            .into_result()
            .map_err(|e| RuntimeError::Compile(Box::new(e)))?;
        let found = match cell {
            Some(n) => module.cells.into_iter().find(|c| c.name == n),
            None => module.cells.into_iter().next(),
        };
        found.ok_or_else(|| RuntimeError::NoCell {
            file: file_name.to_string(),
            name: cell.map(str::to_string),
        })
    }

    /// Simplifies a checked cell (from [`cellc::compile`]) and derives its
    /// backward step, through the compiler's one pipeline ([`Steps::compile`]).
    pub fn from_cell(cell: Cell) -> Result<CompiledCell> {
        let steps = Steps::compile(&cell).map_err(|e| {
            RuntimeError::Internal(e.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))
        })?;
        let identity = steps.identity();
        Ok(CompiledCell { steps, identity })
    }

    /// The cell's steps at `sizes` ([`Program::new`]).
    pub fn program(&self, sizes: &Bindings) -> std::result::Result<Program, cellc::InterpError> {
        self.steps.program(sizes)
    }

    /// The forward and backward steps' IR as text: two cells with the same
    /// identity compile to the same kernels at the same sizes.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Reads and compiles a `.cell` file.
    pub fn from_file(path: &std::path::Path, cell: Option<&str>) -> Result<CompiledCell> {
        let source = crate::files::read_at_most(path, crate::files::MOST_CELL_BYTES)?;
        let name = path.display().to_string();
        match std::str::from_utf8(&source) {
            Ok(s) => CompiledCell::from_source(&name, s, cell),
            Err(_) => match cellc::compile_bytes(&name, &source).into_result() {
                Err(e) => Err(RuntimeError::Compile(Box::new(e))),
                Ok(_) => Err(RuntimeError::Internal(format!("{name} is not UTF-8 but compiled"))),
            },
        }
    }

    /// Parameter names of the cell, in declaration order.
    pub fn param_names(&self) -> Vec<&str> {
        self.forward.params.iter().map(|p| p.name.as_str()).collect()
    }
}

/// One layer's program: the cell's steps at this layer's sizes (shared by
/// its directions), and the plans of its three passes, which every device
/// executes. Dereferences to the [`Program`].
#[derive(Clone, Debug)]
pub struct Layer {
    /// The layer's position in the stack, from 0.
    pub index: usize,
    /// The cell's forward and backward steps at this layer's sizes.
    pub program: Program,
    /// The forward for inference, the forward for training, the backward.
    passes: [PassPlan; 3],
}

impl Layer {
    /// Layer `index` of `cell`, at `sizes`: its program and its passes' plans.
    pub fn new(cell: &CompiledCell, index: usize, sizes: &Bindings) -> Result<Layer> {
        let at_layer = |message: String| RuntimeError::Layer { layer: index, message };
        let program = cell.program(sizes).map_err(|e| at_layer(e.to_string()))?;
        let passes = [
            PassPlan::forward(cell, &program, false)?,
            PassPlan::forward(cell, &program, true)?,
            PassPlan::backward(cell, &program)?,
        ];
        Ok(Layer { index, program, passes })
    }

    /// The plan of the pass of `side` (`training`: a forward that fills the tape).
    pub fn pass(&self, side: Side, training: bool) -> &PassPlan {
        match (side, training) {
            (Side::Forward, false) => &self.passes[0],
            (Side::Forward, true) => &self.passes[1],
            (Side::Backward, _) => &self.passes[2],
        }
    }
}

impl std::ops::Deref for Layer {
    type Target = Program;

    fn deref(&self) -> &Program {
        &self.program
    }
}
