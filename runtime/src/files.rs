//! Writing files so that a crash, a full disk or a killed process never
//! leaves a truncated file where a good one was: the bytes go to a
//! temporary file in the same directory, are flushed to disk, and the
//! temporary file is renamed over the target (a rename within a
//! directory replaces the target in one step on POSIX systems).

use crate::error::{Result, RuntimeError};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically: afterwards `path` holds either
/// its old contents or all of `bytes`, never a part.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let io =
        |e: std::io::Error| RuntimeError::Io { path: path.display().to_string(), message: e.to_string() };
    let tmp = temporary_beside(path);
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(e));
    }
    Ok(())
}

/// A name for a temporary file next to `path`, unique in this process.
fn temporary_beside(path: &Path) -> PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}-{n}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_files_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("cellc-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("a.bin");
        write_atomically(&path, b"first").expect("write");
        write_atomically(&path, b"second, longer").expect("rewrite");
        assert_eq!(std::fs::read(&path).expect("read"), b"second, longer");
        let names: Vec<_> = std::fs::read_dir(&dir).expect("list").flatten().map(|e| e.file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
        // A directory that does not exist: an error naming the path, nothing written.
        let missing = dir.join("no/such/dir/b.bin");
        let err = write_atomically(&missing, b"x").expect_err("no such directory");
        assert!(err.to_string().contains("b.bin"), "{err}");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
