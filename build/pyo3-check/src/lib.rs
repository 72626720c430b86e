use pyo3::prelude::*;

/// The architecture this module was compiled for, as Rust names it.
#[pyfunction]
fn arch() -> &'static str {
    std::env::consts::ARCH
}

#[pymodule]
fn pyo3_check(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(arch, m)?)?;
    Ok(())
}
