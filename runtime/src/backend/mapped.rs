//! The shared objects mapped into this process, as the dynamic loader
//! lists them (`dl_iterate_phdr`): how the CPU back end finds PyTorch's
//! OpenMP runtime and the CUDA back end the libraries PyTorch loaded.

/// The paths of the shared objects mapped into the process.
#[cfg(target_os = "linux")]
pub fn libraries() -> Vec<String> {
    use std::ffi::{c_int, c_void, CStr};
    unsafe extern "C" fn each(info: *mut libc::dl_phdr_info, _: libc::size_t, data: *mut c_void) -> c_int {
        // SAFETY: the loader hands a valid record; `data` is the Vec below.
        unsafe {
            let paths = &mut *(data as *mut Vec<String>);
            let name = (*info).dlpi_name;
            if !name.is_null() {
                if let Ok(s) = CStr::from_ptr(name).to_str() {
                    if !s.is_empty() {
                        paths.push(s.to_string());
                    }
                }
            }
        }
        0
    }
    let mut paths: Vec<String> = Vec::new();
    // SAFETY: the callback only reads the records and appends to `paths`.
    unsafe { libc::dl_iterate_phdr(Some(each), (&mut paths as *mut Vec<String>).cast()) };
    paths
}

/// No loader to ask elsewhere.
#[cfg(not(target_os = "linux"))]
pub fn libraries() -> Vec<String> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    #[cfg(target_os = "linux")]
    #[test]
    fn the_process_libraries_are_listed() {
        let libs = super::libraries();
        assert!(libs.iter().any(|p| p.contains("libc.so")), "{libs:?}");
    }
}
