//! The size of this processor's per-core L2 cache, which decides whether a
//! step's weights stay in a core's cache from one step to the next (how a
//! step is shared out, [`super::team`], and what runs in it,
//! [`super::sink`]). Read once from Linux's sysfs; `None` where it cannot
//! be read (another system, a sandbox without `/sys`), and the decisions
//! that would use it then keep their defaults.

use std::path::Path;

/// Bytes of the L2 cache of the first processor (data or unified), if known.
pub fn l2_bytes() -> Option<usize> {
    static L2: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *L2.get_or_init(|| l2_in(Path::new("/sys/devices/system/cpu/cpu0/cache")))
}

/// Whether `bytes` of weights, read by a core at every step, stay in its L2
/// (`l2` bytes) from one step to the next: they may take half of it, the
/// rest being the rows that the products and the pointwise stages read and
/// write. `None` where the L2's size is unknown.
pub fn stays_in_l2(bytes: usize, l2: Option<usize>) -> Option<bool> {
    l2.map(|l2| bytes <= l2 / 2)
}

/// The L2 cache's size among the `index*` directories of `caches`.
fn l2_in(caches: &Path) -> Option<usize> {
    let read = |dir: &Path, name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let mut dirs: Vec<_> = std::fs::read_dir(caches).ok()?.flatten().map(|e| e.path()).collect();
    dirs.sort();
    dirs.into_iter().find_map(|dir| {
        let level = read(&dir, "level")?;
        let kind = read(&dir, "type")?;
        let holds_data = matches!(kind.trim(), "Unified" | "Data");
        (level.trim() == "2" && holds_data).then(|| read(&dir, "size").and_then(|s| parse_size(&s))).flatten()
    })
}

/// `2048K`, `1M` or a plain number of bytes.
fn parse_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => text.split_at(at),
        None => (text, ""),
    };
    let n: usize = digits.parse().ok()?;
    let scale = match unit.trim() {
        "" => 1,
        "K" | "KB" | "KiB" => 1 << 10,
        "M" | "MB" | "MiB" => 1 << 20,
        _ => return None,
    };
    n.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_sysfs_writes_them() {
        assert_eq!(parse_size("2048K\n"), Some(2 << 20));
        assert_eq!(parse_size("1M"), Some(1 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("lots"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn the_l2_is_found_among_the_cache_levels() {
        let dir = std::env::temp_dir().join(format!("cellc-caches-{}", std::process::id()));
        let entries = [
            ("index0", "1", "Data", "48K"),
            ("index1", "1", "Instruction", "32K"),
            ("index2", "2", "Unified", "2048K"),
            ("index3", "3", "Unified", "300M"),
        ];
        for (name, level, kind, size) in entries {
            let d = dir.join(name);
            std::fs::create_dir_all(&d).expect("a scratch directory");
            for (file, text) in [("level", level), ("type", kind), ("size", size)] {
                std::fs::write(d.join(file), format!("{text}\n")).expect("written");
            }
        }
        assert_eq!(l2_in(&dir), Some(2 << 20));
        std::fs::remove_dir_all(&dir).expect("removed");
        assert_eq!(l2_in(&dir), None, "no directory, no size");
    }
}
