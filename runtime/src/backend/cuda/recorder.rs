//! Replayable images of the emulated device's step-loop launches, so a
//! launch can run again outside the process: in a harness built with
//! sanitizers (`tests/cuda/step_loop_harness.cpp`), where each block of
//! device memory is a heap allocation of its own.
//!
//! An image (little-endian u64 words; byte strings padded to 8 bytes):
//!
//! ```text
//! module file name (length, bytes), kernel name (length, bytes),
//! grid, block, shared bytes, argument count, the arguments' slots,
//! block count, per block: address, bytes, 1 if it holds addresses, its bytes;
//! then per block again: its bytes after the launch.
//! ```
//!
//! Every word of a block that holds addresses (pointer tables, step-loop
//! descriptors), and every argument, that falls inside a block is a
//! pointer the harness relocates; other words (counts, strides) are far
//! below any heap address.

use crate::error::cuda_error as error;
use crate::error::Result;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Where the images go, and every block of memory the device handed out.
#[derive(Debug)]
pub(crate) struct Recorder {
    dir: PathBuf,
    /// By address: bytes, and whether the block was last handed out for addresses.
    blocks: Mutex<BTreeMap<u64, (usize, bool)>>,
    images: std::sync::atomic::AtomicUsize,
}

impl Recorder {
    pub fn new(dir: &Path) -> Result<Recorder> {
        std::fs::create_dir_all(dir).map_err(|e| error(format!("{}: {e}", dir.display())))?;
        Ok(Recorder { dir: dir.to_path_buf(), blocks: Mutex::default(), images: 0.into() })
    }

    /// A block handed out (again): `bytes` at `addr`, holding addresses or not.
    pub fn handed_out(&self, addr: u64, bytes: usize, addresses: bool) {
        if let Ok(mut blocks) = self.blocks.lock() {
            blocks.insert(addr, (bytes, addresses));
        }
    }

    /// Keeps a module's source beside the images, named by its hash.
    pub fn module_source(&self, name: &str, source: &str) -> Result<()> {
        crate::files::write_atomically(&self.dir.join(name), source.as_bytes())
            .map_err(|e| error(e.to_string()))
    }

    /// Runs `launch` (a step loop's), writing the memory before and after
    /// into the next image.
    /// `args` are the launch's argument slots (a pointer, or an i32 in the low 4 bytes).
    pub fn record(
        &self,
        (module_file, kernel): (&str, &str),
        (grid, block, shared): (u32, u32, u32),
        args: &[u64],
        launch: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let blocks: Vec<(u64, usize, bool)> = match self.blocks.lock() {
            Ok(b) => b.iter().map(|(&a, &(n, t))| (a, n, t)).collect(),
            Err(_) => return Err(error("recorder poisoned")),
        };
        let mut words = Vec::new();
        for text in [module_file, kernel] {
            words.push(text.len() as u64);
            words.extend(padded_words(text.as_bytes()));
        }
        words.extend([grid as u64, block as u64, shared as u64, args.len() as u64]);
        words.extend_from_slice(args);
        words.push(blocks.len() as u64);
        for &(addr, bytes, addresses) in &blocks {
            words.extend([addr, bytes as u64, addresses as u64]);
            words.extend(padded_words(contents(addr, bytes)));
        }
        launch()?;
        for &(addr, bytes, _) in &blocks {
            words.extend(padded_words(contents(addr, bytes)));
        }
        let n = self.images.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let path = self.dir.join(format!("step-loop-{n:04}.img"));
        crate::files::write_atomically(&path, &bytes).map_err(|e| error(e.to_string()))
    }
}

/// A block's bytes, as they are now.
fn contents<'a>(addr: u64, bytes: usize) -> &'a [u8] {
    // SAFETY: the emulated device's blocks are host memory it never frees
    // while it lives (freed blocks stay in its pool), `bytes` long.
    unsafe { std::slice::from_raw_parts(addr as *const u8, bytes) }
}

/// `bytes` as little-endian words, the last padded with zeros.
fn padded_words(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes.chunks(8).map(|c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        u64::from_le_bytes(w)
    })
}
