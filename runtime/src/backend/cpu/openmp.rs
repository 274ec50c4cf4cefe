//! The OpenMP runtime another library already loaded into the process
//! (PyTorch's `libgomp`, or Intel's `libiomp5`), found and called through
//! its GNU ABI: `GOMP_parallel` and the `omp_*` queries.
//!
//! Why: inside a PyTorch process, PyTorch's OpenMP workers keep spinning
//! on the cores for a while after each of its parallel operations. A pool
//! of cellc's own threads started right after one of those then shares the
//! cores with spinning threads, and a time loop whose threads meet every
//! step runs several times slower. Run on the same OpenMP team, cellc's
//! parallel regions find those very threads waiting for work: no third
//! thread, no hand-off between two pools.
//!
//! Nothing is linked: the runtime is found among the libraries already
//! mapped (`dl_iterate_phdr`) and opened with `RTLD_NOLOAD`, so a process
//! without OpenMP gets `None` and keeps cellc's own pool.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

type Parallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type Query = unsafe extern "C" fn() -> c_int;

/// An OpenMP runtime's entry points.
#[derive(Debug)]
pub struct OpenMp {
    /// The library's path, as the process mapped it.
    pub library: String,
    parallel: Parallel,
    thread_num: Query,
    num_threads: Query,
    in_parallel: Query,
}

// SAFETY: plain function pointers into a library that stays loaded (it is
// opened once more and never closed).
unsafe impl Send for OpenMp {}
unsafe impl Sync for OpenMp {}

/// The OpenMP runtime loaded in this process, looked up once (first use).
pub fn loaded() -> Option<&'static OpenMp> {
    static FOUND: OnceLock<Option<OpenMp>> = OnceLock::new();
    FOUND.get_or_init(find).as_ref()
}

/// The file names an OpenMP runtime with the GNU ABI goes by.
fn is_openmp(path: &str) -> bool {
    let file = path.rsplit('/').next().unwrap_or(path);
    ["libgomp", "libiomp5", "libomp."].iter().any(|p| file.starts_with(p))
}

#[cfg(target_os = "linux")]
fn find() -> Option<OpenMp> {
    crate::backend::mapped::libraries().into_iter().filter(|p| is_openmp(p)).find_map(|p| open(&p))
}

#[cfg(not(target_os = "linux"))]
fn find() -> Option<OpenMp> {
    None
}

/// The entry points of the already-loaded library at `path`, if it has them all.
#[cfg(target_os = "linux")]
fn open(path: &str) -> Option<OpenMp> {
    let c_path = CString::new(path).ok()?;
    // SAFETY: RTLD_NOLOAD opens nothing new: it only returns a handle to a
    // library that is mapped already (and keeps it mapped).
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    let symbol = |name: &CStr| -> Option<*mut c_void> {
        // SAFETY: a valid handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(handle, name.as_ptr() as *const c_char) };
        (!p.is_null()).then_some(p)
    };
    // SAFETY: the GNU OpenMP ABI's signatures, which libgomp and libiomp5 both export.
    unsafe {
        Some(OpenMp {
            library: path.to_string(),
            parallel: std::mem::transmute::<*mut c_void, Parallel>(symbol(c"GOMP_parallel")?),
            thread_num: std::mem::transmute::<*mut c_void, Query>(symbol(c"omp_get_thread_num")?),
            num_threads: std::mem::transmute::<*mut c_void, Query>(symbol(c"omp_get_num_threads")?),
            in_parallel: std::mem::transmute::<*mut c_void, Query>(symbol(c"omp_in_parallel")?),
        })
    }
}

/// What one region's threads share.
struct Region<'a> {
    runtime: &'a OpenMp,
    threads: usize,
    f: &'a (dyn Fn(usize) + Sync),
    /// Set when the team had another size than asked: nothing ran.
    short: std::sync::atomic::AtomicBool,
}

extern "C" fn region_thread(data: *mut c_void) {
    // SAFETY: `data` is the `Region` that `OpenMp::broadcast` keeps alive
    // until `GOMP_parallel` returns, after every thread has left.
    let region = unsafe { &*(data as *const Region) };
    // SAFETY: called inside the region, as OpenMP requires.
    let (index, team) = unsafe { ((region.runtime.thread_num)(), (region.runtime.num_threads)()) };
    if team as usize != region.threads {
        region.short.store(true, std::sync::atomic::Ordering::Relaxed);
        return;
    }
    // A panic must not unwind into C.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (region.f)(index as usize))).is_err() {
        std::process::abort();
    }
}

impl OpenMp {
    /// Runs `f(i)` for every `i < threads` at once, on the calling thread
    /// (as 0) and the OpenMP team's. `false` when the runtime gave another
    /// number of threads (it may, under `OMP_DYNAMIC` or a thread limit):
    /// then `f` did not run at all.
    pub fn broadcast(&self, threads: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
        let region = Region { runtime: self, threads, f, short: false.into() };
        // SAFETY: `region` outlives the call, which returns once every
        // thread of the team has finished `region_thread`.
        unsafe {
            (self.parallel)(region_thread, (&region as *const Region).cast_mut().cast(), threads as c_uint, 0)
        };
        !region.short.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the calling thread is inside an OpenMP parallel region.
    pub fn in_parallel(&self) -> bool {
        // SAFETY: a query with no preconditions.
        unsafe { (self.in_parallel)() != 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmp_runtimes_are_told_by_their_file_names() {
        assert!(is_openmp("/x/torch/lib/libgomp.so.1"));
        assert!(is_openmp("/x/torch.libs/libgomp-a34b3233.so.1"));
        assert!(is_openmp("libiomp5.so"));
        assert!(!is_openmp("/usr/lib/libgompx/libc.so.6"));
        assert!(!is_openmp("/usr/lib/libomptarget.so"));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_loaded_libgomp_runs_regions_on_every_thread_asked_for() {
        // The C toolchain's libgomp, loaded here as PyTorch loads its own.
        let path =
            ["/usr/lib/x86_64-linux-gnu/libgomp.so.1", "/usr/lib64/libgomp.so.1", "/usr/lib/libgomp.so.1"]
                .into_iter()
                .find(|p| std::path::Path::new(p).exists())
                .expect("libgomp (GCC's OpenMP runtime) is installed with the C toolchain");
        // SAFETY: loading GCC's OpenMP runtime runs no code of ours.
        let lib = unsafe { libloading::Library::new(path) }.expect("libgomp loads");
        let omp = open(path).expect("the loaded libgomp is found and has the GNU entry points");
        for threads in [1, 2, 3] {
            let seen: Vec<std::sync::atomic::AtomicUsize> = (0..threads).map(|_| 0.into()).collect();
            let ids = std::sync::Mutex::new(std::collections::HashSet::new());
            assert!(omp.broadcast(threads, &|i| {
                seen[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                ids.lock().unwrap_or_else(|e| e.into_inner()).insert(std::thread::current().id());
                assert!(omp.in_parallel() || threads == 1);
            }));
            assert!(seen.iter().all(|s| s.load(std::sync::atomic::Ordering::Relaxed) == 1));
            assert_eq!(ids.into_inner().unwrap_or_default().len(), threads, "one thread per index");
        }
        assert!(!omp.in_parallel());
        std::mem::forget(lib);
    }
}
