//! Writing files so that a crash, a full disk or a killed process never
//! leaves a truncated file where a good one was, and so that what is not a
//! file is never replaced:
//!
//! - a regular file, or a path that does not exist yet: the bytes go to a
//!   temporary file in the same directory, are flushed to disk, and the
//!   temporary file is renamed over the target (a rename within a
//!   directory replaces the target in one step on POSIX systems);
//! - a symbolic link: followed to its final target, which is written by
//!   the rule that fits it, so the link stays a link (a dangling link gets
//!   its target created);
//! - a device, a FIFO or a socket: written through, in place (`/dev/null`
//!   stays the machine's `/dev/null`); a FIFO that no process reads is an
//!   error at once, not a wait;
//! - a directory: an error.
//!
//! A failed write, a full device's among them, is an error naming the path.
//!
//! Reading is bounded the same way: what cellc reads whole (a cell's source)
//! is read up to a cap, so that `/dev/zero` or a wrong path to a huge file
//! is an error at once rather than all the machine's memory.

use crate::error::{Result, RuntimeError};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The most bytes a `.cell` file may hold: a cell is a page of text, and
/// the shipped library together is a few dozen kilobytes.
pub const MOST_CELL_BYTES: u64 = 16 << 20;

/// Reads `path` whole where it holds at most `most` bytes; a larger file,
/// or a stream that does not end by then (`/dev/zero`), is an error naming
/// the path and the cap, found without reading past it.
pub fn read_at_most(path: &Path, most: u64) -> Result<Vec<u8>> {
    let io = |message: String| RuntimeError::Io { path: path.display().to_string(), message };
    let file = std::fs::File::open(path).map_err(|e| io(e.to_string()))?;
    let too_large = || io(format!("holds more than {most} bytes: not a file of this kind"));
    if file.metadata().is_ok_and(|m| m.is_file() && m.len() > most) {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    file.take(most + 1).read_to_end(&mut bytes).map_err(|e| io(e.to_string()))?;
    if bytes.len() as u64 > most {
        return Err(too_large());
    }
    Ok(bytes)
}

/// Writes `bytes` to `path` atomically where `path` is (or leads by
/// symbolic links to) a regular file or nothing: afterwards it holds either
/// its old contents or all of `bytes`, never a part. A device or FIFO is
/// written through, a directory refused (see the module documentation).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let io =
        |e: std::io::Error| RuntimeError::Io { path: path.display().to_string(), message: e.to_string() };
    let target = final_target(path).map_err(io)?;
    match std::fs::metadata(&target) {
        Ok(m) if m.is_dir() => Err(RuntimeError::Io {
            path: path.display().to_string(),
            message: "is a directory, not a file".into(),
        }),
        Ok(m) if m.is_file() => replace(&target, bytes).map_err(io),
        Ok(_) => write_through(&target, bytes).map_err(io),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => replace(&target, bytes).map_err(io),
        Err(e) => Err(io(e)),
    }
}

/// Where `path` leads through symbolic links: the first path on the way
/// that is not a link (it may not exist).
fn final_target(path: &Path) -> std::io::Result<PathBuf> {
    const MOST_LINKS: usize = 40; // as Linux's own limit on links followed
    let mut at = path.to_path_buf();
    for _ in 0..MOST_LINKS {
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                let to = std::fs::read_link(&at)?;
                at = match at.parent() {
                    Some(dir) if to.is_relative() => dir.join(to),
                    _ => to,
                };
            }
            Ok(_) => return Ok(at),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(at),
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other(format!("more than {MOST_LINKS} symbolic links to follow")))
}

/// A regular file's (or a new path's) replacement through a temporary
/// file beside it.
fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = temporary_beside(path);
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Writes through a device, FIFO or socket, in place. The open does not
/// wait for a FIFO's reader: with none, it is an error at once.
#[cfg(unix)]
fn write_through(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    let mut f =
        std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(|e| {
            if e.raw_os_error() == Some(libc::ENXIO) {
                std::io::Error::other("a FIFO that no process reads: start its reader first")
            } else {
                e
            }
        })?;
    // Opened: from here writes may wait for the reader, as any writer's do.
    let fd = f.as_raw_fd();
    // SAFETY: `fd` is the open descriptor `f` owns; F_GETFL and F_SETFL read and set its flags.
    let set = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) >= 0
    };
    if !set {
        return Err(std::io::Error::last_os_error());
    }
    f.write_all(bytes)?;
    f.flush()
}

#[cfg(not(unix))]
fn write_through(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
    f.write_all(bytes)?;
    f.flush()
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

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("cellc-files-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn reads_are_capped_before_they_are_made() {
        let dir = temp_dir("capped");
        let path = dir.join("small");
        std::fs::write(&path, b"twelve bytes").expect("write");
        assert_eq!(read_at_most(&path, 12).expect("at the cap"), b"twelve bytes");
        let err = read_at_most(&path, 11).expect_err("past the cap");
        assert!(err.to_string().contains("more than 11 bytes"), "{err}");
        #[cfg(target_os = "linux")]
        {
            let started = std::time::Instant::now();
            let err = read_at_most(Path::new("/dev/zero"), 1 << 20).expect_err("an endless stream");
            assert!(err.to_string().contains("/dev/zero"), "{err}");
            assert!(started.elapsed().as_secs() < 5);
        }
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn replaces_whole_files_and_leaves_no_temporary() {
        let dir = temp_dir("regular");
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
        // A directory: refused.
        let err = write_atomically(&dir, b"x").expect_err("a directory");
        assert!(err.to_string().contains("directory"), "{err}");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[cfg(unix)]
    #[test]
    fn links_stay_links_and_their_targets_are_written() {
        use std::os::unix::fs::symlink;
        let dir = temp_dir("links");
        let (file, link) = (dir.join("file"), dir.join("link"));
        std::fs::write(&file, b"old").expect("file");
        symlink("file", &link).expect("link");
        write_atomically(&link, b"new").expect("through the link");
        assert!(std::fs::symlink_metadata(&link).expect("link").file_type().is_symlink());
        assert_eq!(std::fs::read_link(&link).expect("link"), Path::new("file"));
        assert_eq!(std::fs::read(&file).expect("target"), b"new");
        // A chain of links, the last one dangling: its target is created.
        let (dangling, chain, missing) = (dir.join("dangling"), dir.join("chain"), dir.join("missing"));
        symlink(&missing, &dangling).expect("dangling link");
        symlink("dangling", &chain).expect("chain");
        write_atomically(&chain, b"made").expect("through two links");
        assert!(std::fs::symlink_metadata(&chain).expect("chain").file_type().is_symlink());
        assert!(std::fs::symlink_metadata(&dangling).expect("dangling").file_type().is_symlink());
        assert_eq!(std::fs::read(&missing).expect("created"), b"made");
        // A loop: an error, nothing replaced.
        let (a, b) = (dir.join("a"), dir.join("b"));
        symlink("b", &a).expect("a");
        symlink("a", &b).expect("b");
        let err = write_atomically(&a, b"x").expect_err("a loop");
        assert!(err.to_string().contains("symbolic links"), "{err}");
        assert!(std::fs::symlink_metadata(&a).expect("a").file_type().is_symlink());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[cfg(unix)]
    #[test]
    fn fifos_are_written_through_and_never_waited_on() {
        use std::os::unix::fs::FileTypeExt;
        let dir = temp_dir("fifo");
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("skipped: no mkfifo");
            return;
        }
        // No reader: an error at once.
        let err = write_atomically(&fifo, b"x").expect_err("no reader");
        assert!(err.to_string().contains("no process reads"), "{err}");
        // A reader: the bytes go through it.
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(fifo).expect("read the FIFO"))
        };
        let mut tries = 0;
        while let Err(e) = write_atomically(&fifo, b"through") {
            // The reader may not have opened its end yet.
            tries += 1;
            assert!(tries < 500, "{e}");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(reader.join().expect("reader"), b"through");
        assert!(std::fs::symlink_metadata(&fifo).expect("fifo").file_type().is_fifo());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn devices_are_written_through_and_a_full_one_is_an_error() {
        use std::os::unix::fs::FileTypeExt;
        let is_char_device =
            |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_char_device());
        if is_char_device(Path::new("/dev/null")) {
            write_atomically(Path::new("/dev/null"), b"gone").expect("/dev/null takes anything");
            assert!(is_char_device(Path::new("/dev/null")));
        }
        if is_char_device(Path::new("/dev/full")) {
            let err = write_atomically(Path::new("/dev/full"), b"x").expect_err("a full device");
            assert!(err.to_string().contains("/dev/full"), "{err}");
            assert!(is_char_device(Path::new("/dev/full")));
        }
        // Nodes of our own (needs root, as CI runs): the same rules in a folder of ours.
        let dir = temp_dir("nodes");
        let (null, full) = (dir.join("null"), dir.join("full"));
        let mknod = |p: &Path, minor: &str| {
            std::process::Command::new("mknod")
                .arg(p)
                .args(["c", "1", minor])
                .status()
                .is_ok_and(|s| s.success())
        };
        if mknod(&null, "3") && mknod(&full, "7") {
            write_atomically(&null, b"gone").expect("a null device");
            assert!(write_atomically(&full, b"x").is_err(), "a full device");
            assert!(is_char_device(&null) && is_char_device(&full));
        } else {
            eprintln!("skipped: mknod needs root");
        }
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
