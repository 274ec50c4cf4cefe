//! Finding CUDA's libraries (the driver, NVRTC, cuBLAS) of CUDA 13 or 12,
//! by version and by folder, before cudarc first calls into them.
//!
//! cudarc opens each library by bare name (`libnvrtc.so.13`, `.so.12`,
//! ...), so the dynamic loader finds it only on `LD_LIBRARY_PATH` or in
//! the system's folders. This module opens the library first, by absolute
//! path, from these places in turn:
//!
//! 1. a library of that kind already mapped into the process (PyTorch
//!    loads its own cuBLAS and driver);
//! 2. the folders named in [`LIB_DIR_VAR`] (`:`-separated);
//! 3. the `lib` folders of PyTorch's NVIDIA wheels
//!    (`site-packages/nvidia/cu13/lib`, `nvidia/cublas/lib`, ...) when the
//!    process has PyTorch loaded;
//! 4. the system's own search (`ld.so.cache`, `LD_LIBRARY_PATH`).
//!
//! In each place CUDA 13 is tried before CUDA 12. The library stays loaded,
//! and cudarc's own lookup by name then finds it by its `SONAME`. When
//! nothing is found, the error lists every place searched and why each
//! candidate that exists could not be loaded.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The variable naming folders to look for CUDA's libraries in first.
pub const LIB_DIR_VAR: &str = "CELLC_CUDA_LIB_DIR";

/// The CUDA major versions the back end runs on, preferred first.
pub const MAJORS: [u32; 2] = [13, 12];

/// One of the libraries the CUDA back end loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Library {
    /// The CUDA driver, `libcuda.so.1`.
    Driver,
    /// NVRTC, CUDA's run-time compiler: `libnvrtc.so.13` or `.12`.
    Nvrtc,
    /// cuBLAS, `libcublas.so.13` or `.12`.
    Cublas,
}

impl Library {
    /// Every library the back end loads.
    pub const ALL: [Library; 3] = [Library::Driver, Library::Nvrtc, Library::Cublas];

    /// The files to look for, preferred first.
    pub fn file_names(self) -> Vec<String> {
        match self {
            // The driver's ABI name is the same for every CUDA version.
            Library::Driver => vec!["libcuda.so.1".into()],
            Library::Nvrtc => MAJORS.iter().map(|m| format!("libnvrtc.so.{m}")).collect(),
            Library::Cublas => MAJORS.iter().map(|m| format!("libcublas.so.{m}")).collect(),
        }
    }

    /// What it is, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Library::Driver => "the CUDA driver (libcuda)",
            Library::Nvrtc => "NVRTC (libnvrtc, CUDA 13 or 12)",
            Library::Cublas => "cuBLAS (libcublas, CUDA 13 or 12)",
        }
    }

    /// The library of the same version it needs from its own folder:
    /// NVRTC opens its builtins by name at run time, cuBLAS links cuBLASLt.
    fn companion(self) -> Option<&'static str> {
        match self {
            Library::Nvrtc => Some("libnvrtc-builtins"),
            Library::Cublas => Some("libcublasLt"),
            Library::Driver => None,
        }
    }

    /// Whether `file` (a path's last part) is this library, of a supported version.
    fn is_this(self, file: &str) -> bool {
        self.file_names().iter().any(|n| file == n || file.starts_with(&format!("{n}.")))
    }
}

/// Where a library was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Place {
    /// Already mapped into the process.
    Loaded,
    /// A folder of [`LIB_DIR_VAR`].
    Variable,
    /// A folder of PyTorch's NVIDIA wheels.
    TorchWheels,
    /// The system's search path.
    System,
}

/// A library found and loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The path it was loaded from (a bare name where the system's search found it).
    pub path: String,
    /// Which of the places searched it was found in.
    pub place: Place,
}

/// Nothing loadable was found: every candidate tried, and why it failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotFound {
    /// The library looked for.
    pub library: Library,
    /// Each candidate tried, in order: its path (or bare name) and why it could not be loaded.
    pub tried: Vec<(String, String)>,
}

impl std::fmt::Display for NotFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hint = match self.library {
            Library::Driver => {
                format!("Install NVIDIA's driver, or set {LIB_DIR_VAR} to the folder of libcuda.so.1.")
            }
            _ => format!(
                "Set {LIB_DIR_VAR} to the folder that holds it, or install it (the pip wheels \
                 nvidia-cuda-nvrtc and nvidia-cublas, which PyTorch's CUDA 13 build brings)."
            ),
        };
        write!(f, "{} not found. {hint} Searched:", self.library.describe())?;
        for (candidate, why) in &self.tried {
            write!(f, "\n  {candidate}: {why}")?;
        }
        Ok(())
    }
}

impl std::error::Error for NotFound {}

/// A candidate: a path, or a bare name for the system's search.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Candidate {
    pub path: String,
    pub place: Place,
}

/// The places to try for `library`, in order (see the module documentation).
pub(crate) fn candidates(library: Library, mapped: &[String], variable: Option<&str>) -> Vec<Candidate> {
    let mut out = Vec::new();
    let file = |p: &str| Path::new(p).file_name().and_then(|f| f.to_str()).unwrap_or("").to_string();
    for path in mapped.iter().filter(|p| library.is_this(&file(p))) {
        out.push(Candidate { path: path.clone(), place: Place::Loaded });
    }
    let folders =
        [(variable_folders(variable), Place::Variable), (torch_wheel_folders(mapped), Place::TorchWheels)];
    for (dirs, place) in folders {
        for dir in dirs {
            for name in library.file_names() {
                let path = dir.join(&name).to_string_lossy().into_owned();
                out.push(Candidate { path, place: place.clone() });
            }
        }
    }
    for name in library.file_names() {
        out.push(Candidate { path: name, place: Place::System });
    }
    out
}

fn variable_folders(variable: Option<&str>) -> Vec<PathBuf> {
    variable.map(|v| v.split(':').filter(|d| !d.is_empty()).map(PathBuf::from).collect()).unwrap_or_default()
}

/// The `lib` folders of the NVIDIA wheels beside a loaded PyTorch
/// (`site-packages/torch/lib/libtorch*.so` → `site-packages/nvidia/*/lib`),
/// CUDA 13's shared folder first.
pub(crate) fn torch_wheel_folders(mapped: &[String]) -> Vec<PathBuf> {
    let mut folders = Vec::new();
    for path in mapped {
        let path = Path::new(path);
        let is_torch = path.file_name().and_then(|f| f.to_str()).is_some_and(|f| f.starts_with("libtorch"));
        let Some(site) = path.parent().filter(|_| is_torch).and_then(Path::parent).and_then(Path::parent)
        else {
            continue;
        };
        let Ok(entries) = std::fs::read_dir(site.join("nvidia")) else { continue };
        let mut libs: Vec<PathBuf> =
            entries.filter_map(|e| e.ok()).map(|e| e.path().join("lib")).filter(|p| p.is_dir()).collect();
        // `cu13` (CUDA 13's wheels share one folder) first, then by name.
        libs.sort_by_key(|p| (!p.parent().is_some_and(|d| d.ends_with("cu13")), p.clone()));
        for lib in libs {
            if !folders.contains(&lib) {
                folders.push(lib);
            }
        }
    }
    folders
}

/// Loads the first candidate `open` accepts. A folder's candidate that
/// does not exist is skipped (and listed as such if nothing is found).
pub(crate) fn load_first(
    library: Library,
    candidates: &[Candidate],
    open: impl Fn(&str) -> Result<(), String>,
) -> Result<Found, NotFound> {
    let mut tried = Vec::new();
    for c in candidates {
        if c.place != Place::System && !Path::new(&c.path).exists() {
            tried.push((c.path.clone(), "no such file".to_string()));
            continue;
        }
        match open(&c.path) {
            Ok(()) => return Ok(Found { path: c.path.clone(), place: c.place.clone() }),
            Err(why) => tried.push((c.path.clone(), why)),
        }
    }
    Err(NotFound { library, tried })
}

/// Opens the library at `path` (or by bare name) and keeps it loaded for
/// the life of the process. A library in a folder has its companions from
/// that folder opened first: NVRTC opens `libnvrtc-builtins.so.<version>`
/// by bare name, and cuBLAS needs `libcublasLt.so.<version>`, which the
/// system's search does not find in a wheel's folder, but finds once it
/// is loaded (by its `SONAME`).
fn open_with_companions(library: Library, path: &str) -> Result<(), String> {
    let path = Path::new(path);
    if let (Some(dir), Some(prefix)) =
        (path.parent().filter(|d| !d.as_os_str().is_empty()), library.companion())
    {
        let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
        let version = file.rsplit_once(".so.").map_or("", |(_, v)| v);
        let wanted = format!("{prefix}.so.{version}.");
        let mut companions: Vec<PathBuf> = std::fs::read_dir(dir)
            .map(|entries| entries.filter_map(|e| e.ok()).map(|e| e.path()).collect())
            .unwrap_or_default();
        companions.retain(|p| {
            p.file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with(&wanted) || f == &wanted[..wanted.len() - 1])
        });
        companions.sort();
        for companion in companions {
            open_and_keep(&companion.to_string_lossy())
                .map_err(|e| format!("its companion {}: {e}", companion.display()))?;
        }
    }
    open_and_keep(&path.to_string_lossy())
}

/// Opens the library at `path` (or by bare name) and keeps it loaded for
/// the life of the process.
fn open_and_keep(path: &str) -> Result<(), String> {
    // SAFETY: loading CUDA's libraries runs only their initialisers, which
    // have no preconditions.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| {
        let message = e.to_string();
        message.strip_prefix(&format!("{path}: ")).map(str::to_string).unwrap_or(message)
    })?;
    std::mem::forget(lib);
    Ok(())
}

/// `library`, found and loaded once per process.
pub fn load(library: Library) -> Result<&'static Found, &'static NotFound> {
    static FOUND: [OnceLock<Result<Found, NotFound>>; 3] =
        [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let slot = &FOUND[Library::ALL.iter().position(|&l| l == library).unwrap_or(0)];
    slot.get_or_init(|| {
        let variable = std::env::var(LIB_DIR_VAR).ok();
        let mapped = crate::backend::mapped::libraries();
        let open = |path: &str| open_with_companions(library, path);
        load_first(library, &candidates(library, &mapped, variable.as_deref()), open)
    })
    .as_ref()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_tree(test: &str) -> (PathBuf, String) {
        let root = std::env::temp_dir().join(format!("cellc-libs-{}-{test}", std::process::id()));
        let site = root.join("lib/python3.12/site-packages");
        for dir in ["torch/lib", "nvidia/cu13/lib", "nvidia/cublas/lib", "nvidia/cudnn/include", "mine"] {
            std::fs::create_dir_all(site.join(dir)).expect("fake folders");
        }
        for file in ["nvidia/cu13/lib/libnvrtc.so.13", "mine/libnvrtc.so.12", "torch/lib/libtorch_cuda.so"] {
            std::fs::write(site.join(file), b"not an ELF file").expect("fake library");
        }
        let torch = site.join("torch/lib/libtorch_cuda.so").to_string_lossy().into_owned();
        (site, torch)
    }

    #[test]
    fn places_come_in_order_and_cuda_13_before_12() {
        let (site, torch) = fake_tree("order");
        let mine = site.join("mine").to_string_lossy().into_owned();
        let mapped = vec!["/usr/lib/libc.so.6".to_string(), torch, "/opt/x/libnvrtc.so.12.9".to_string()];
        let got = candidates(Library::Nvrtc, &mapped, Some(&format!("{mine}:")));
        let want = [
            ("/opt/x/libnvrtc.so.12.9".to_string(), Place::Loaded),
            (format!("{mine}/libnvrtc.so.13"), Place::Variable),
            (format!("{mine}/libnvrtc.so.12"), Place::Variable),
            (site.join("nvidia/cu13/lib/libnvrtc.so.13").to_string_lossy().into_owned(), Place::TorchWheels),
            (site.join("nvidia/cu13/lib/libnvrtc.so.12").to_string_lossy().into_owned(), Place::TorchWheels),
            (
                site.join("nvidia/cublas/lib/libnvrtc.so.13").to_string_lossy().into_owned(),
                Place::TorchWheels,
            ),
            (
                site.join("nvidia/cublas/lib/libnvrtc.so.12").to_string_lossy().into_owned(),
                Place::TorchWheels,
            ),
            ("libnvrtc.so.13".to_string(), Place::System),
            ("libnvrtc.so.12".to_string(), Place::System),
        ];
        let got: Vec<(String, Place)> = got.into_iter().map(|c| (c.path, c.place)).collect();
        assert_eq!(got, want);
        // A folder without `lib` inside (cudnn/include only) is not searched.
        assert!(torch_wheel_folders(&mapped).iter().all(|f| !f.to_string_lossy().contains("cudnn")));
        let _ = std::fs::remove_dir_all(site.ancestors().nth(3).expect("root"));
    }

    #[test]
    fn the_first_loadable_candidate_wins_and_missing_files_are_skipped() {
        let (site, torch) = fake_tree("first");
        let list = candidates(Library::Nvrtc, &[torch], None);
        let found = load_first(Library::Nvrtc, &list, |p| {
            if p.ends_with("libnvrtc.so.13") && p.contains("cu13") {
                Ok(())
            } else {
                Err("refused".into())
            }
        })
        .expect("found");
        assert_eq!(found.place, Place::TorchWheels);
        assert!(found.path.ends_with("nvidia/cu13/lib/libnvrtc.so.13"), "{}", found.path);
        let _ = std::fs::remove_dir_all(site.ancestors().nth(3).expect("root"));
    }

    #[test]
    fn nothing_loadable_lists_every_place_and_the_loaders_reason() {
        let (site, torch) = fake_tree("nothing");
        let mine = site.join("mine").to_string_lossy().into_owned();
        let list = candidates(Library::Nvrtc, &[torch], Some(&mine));
        // The real loader, on files that are not libraries, and on names the system lacks.
        let no_system = |p: &str| {
            if p.contains('/') {
                open_and_keep(p)
            } else {
                Err("not on the system's search path".into())
            }
        };
        let err = load_first(Library::Nvrtc, &list, no_system).expect_err("nothing loads");
        let text = err.to_string();
        assert!(
            text.starts_with("NVRTC (libnvrtc, CUDA 13 or 12) not found. Set CELLC_CUDA_LIB_DIR"),
            "{text}"
        );
        assert!(text.contains(&format!("{mine}/libnvrtc.so.12: ")), "{text}");
        assert!(text.contains(&format!("{mine}/libnvrtc.so.13: no such file")), "{text}");
        assert!(text.contains("nvidia/cu13/lib/libnvrtc.so.13: "), "{text}");
        assert!(text.contains("libnvrtc.so.12: not on the system's search path"), "{text}");
        // The loader's own reason for a file that exists but is no library.
        let bad = err.tried.iter().find(|(p, _)| p == &format!("{mine}/libnvrtc.so.12")).expect("tried");
        assert_ne!(bad.1, "no such file");
        assert_eq!(err.tried.len(), list.len());
        let _ = std::fs::remove_dir_all(site.ancestors().nth(3).expect("root"));
    }

    #[test]
    fn nvrtc_is_loaded_after_its_builtins_from_the_same_folder() {
        let (site, _) = fake_tree("companions");
        let dir = site.join("nvidia/cu13/lib");
        std::fs::write(dir.join("libnvrtc-builtins.so.13.0"), b"not an ELF file").expect("fake builtins");
        let nvrtc = dir.join("libnvrtc.so.13").to_string_lossy().into_owned();
        let err = open_with_companions(Library::Nvrtc, &nvrtc).expect_err("fake files do not load");
        assert!(
            err.starts_with(&format!("its companion {}: ", dir.join("libnvrtc-builtins.so.13.0").display())),
            "{err}"
        );
        let err = open_with_companions(Library::Driver, &nvrtc).expect_err("fake files do not load");
        assert!(!err.contains("its companion"), "the driver has none: {err}");
        let _ = std::fs::remove_dir_all(site.ancestors().nth(3).expect("root"));
    }

    #[test]
    fn libraries_are_told_by_name_and_version() {
        assert!(Library::Nvrtc.is_this("libnvrtc.so.13"));
        assert!(Library::Nvrtc.is_this("libnvrtc.so.12.9.86"));
        assert!(!Library::Nvrtc.is_this("libnvrtc.so.11.2"));
        assert!(!Library::Nvrtc.is_this("libnvrtc-builtins.so.13.0"));
        assert!(Library::Cublas.is_this("libcublas.so.13"));
        assert!(!Library::Cublas.is_this("libcublasLt.so.13"));
        assert!(Library::Driver.is_this("libcuda.so.1"));
        assert!(Library::Driver.is_this("libcuda.so.1.1"));
        assert!(!Library::Driver.is_this("libcudart.so.13"));
    }
}
